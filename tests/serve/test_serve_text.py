"""Stop strings as text arrives (serve/text.py), without a model: a fake one whose tokens
are bytes. The incremental matcher must give what searching the whole text gives: the
text before the earliest stop string, never any of the stop string, never a split
character, and nothing held back once the generation ends."""
from __future__ import annotations

import random

import pytest

from swarmkv_ffi.serve.text import StopMatcher, TextStream

pytestmark = pytest.mark.unit


class ByteModel:
    """Token i is the byte i, so a UTF-8 character may span tokens."""

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return bytes([token])


def run(text: str, stops: list[str]) -> tuple[str, list[str], TextStream]:
    stream = TextStream(ByteModel(), stops)
    chunks = []
    for b in text.encode():
        chunks.append(stream.feed(b))
        if stream.stopped:
            break
    else:
        chunks.append(stream.flush())
    return "".join(chunks), chunks, stream


def expected(text: str, stops: list[str]) -> tuple[str, int | None]:
    """The reference: the text cut where the earliest stop string begins."""
    found = [text.find(s) for s in stops if s and s in text]
    return (text[:min(found)], min(found)) if found else (text, None)


@pytest.mark.parametrize("seed", range(300))
def test_the_stream_cuts_where_the_earliest_stop_string_begins(seed):
    rng = random.Random(seed)
    alphabet = "ab\u00e9c"                        # é is two bytes: two tokens
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
    out, chunks, stream = run(text, stops)
    want, at = expected(text, stops)
    assert out == want and stream.sent == want
    assert stream.stopped == (at is not None)
    if at is not None:
        assert text.startswith(stream.stop_string, at)
    assert all("\ufffd" not in c for c in chunks)             # no character split across chunks


def test_text_is_held_back_only_while_it_could_begin_a_stop_string():
    stream = TextStream(ByteModel(), ["</answer>"])
    assert stream.feed(ord("x")) == "x"
    assert [stream.feed(b) for b in b"</ans"] == ["", "", "", "", ""]
    assert stream.feed(ord("!")) == "</ans!"                # not a stop string after all
    assert [stream.feed(b) for b in b"</answer>"][-1] == "" and stream.stopped
    assert stream.sent == "x</ans!"


def test_a_stop_string_that_overlaps_itself_is_found():
    """aab inside aaab: a naive restart after the failed third a would miss it."""
    out, _, stream = run("xaaaby", ["aab"])
    assert out == "xa" and stream.stopped


def test_a_long_stop_string_that_keeps_almost_matching():
    """A 512-character stop string over 20,000 characters that match all of it but its
    last: the matcher holds 511 matched (what the stream holds back), then ends on the b."""
    m = StopMatcher("a" * 511 + "b")
    assert all(m.advance("a") is None for _ in range(20_000))
    assert m.matched == 511 and m.advance("ca") is None and m.matched == 1
    assert m.advance("a" * 510 + "b") == 511
