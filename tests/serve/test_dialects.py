"""Reading answers in a model family's own dialect (serve/dialects.py), model-free: the
Hermes `<tool_call>` form, Llama 3.x's and Mistral's forms and the generic JSON form,
thoughts between <think> tags, whole and as a stream cut at every place a tokenizer
could cut it. A stream reassembled as OpenAI's clients do it must equal the whole
answer read at once."""
from __future__ import annotations

import json
import re

import pytest

from swarmkv_ffi.serve.dialects import (Blocks, Dialect, Reader, detect, opens_thought, read_generic, read_hermes,
                                        read_llama3, read_mistral, split_thought)

pytestmark = pytest.mark.unit

HERMES, GENERIC = Dialect("hermes"), Dialect("generic")
THINKING_HERMES = Dialect("hermes", thinks=True)
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\"}{\\" [x]", "days": [1, {"a": 2}]}}'
        '\n</tool_call>')
ARGS = {"city": 'Oslo "}{" [x]', "days": [1, {"a": 2}]}


def streamed(reader: Reader, text: str, size: int, ids: str = r"call_[0-9a-f]{24}") -> dict:
    """Feed `text` in pieces of `size` characters; reassemble as a client does (each
    call's id of the pattern `ids`)."""
    parts = [p for i in range(0, len(text), size) for p in reader.feed(text[i:i + size])] + reader.finish()
    out = {"content": "", "reasoning": "", "calls": {}}
    for p in parts:
        if p.kind in ("content", "reasoning"):
            out[p.kind] += p.text
        elif p.kind == "call":
            assert p.index not in out["calls"] and re.fullmatch(ids, p.id)
            out["calls"][p.index] = [p.text, ""]
        else:
            out["calls"][p.index][1] += p.text
    out["calls"] = [(name, json.loads(args)) for _, (name, args) in sorted(out["calls"].items())]
    return out


def test_templates_are_told_apart_by_the_markers_they_name():
    assert detect(None) == GENERIC and detect("{{ messages }} tool_calls") == GENERIC
    assert detect("{% for c in m.tool_calls %}<tool_call>{{ c }}</tool_call>{% endfor %}") == HERMES
    assert detect("<tool_call> {{ m.tool_calls }} {{ '</think>' }}") == THINKING_HERMES
    assert detect("<tool_call>, but no calls rendered") == GENERIC
    assert detect("{{ '</think>' }}").thinks and not detect("{{ '</think>' }}").tells_tools


def test_a_hermes_answer_whole_words_then_calls():
    reply = read_hermes("Let me look.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome"))
    assert reply.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == \
        [("get_weather", ARGS), ("get_weather", dict(ARGS, city=ARGS["city"].replace("Oslo", "Rome")))]
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize("cut", [CALL[:-3], CALL.replace('"arguments"', '"args"'),
                                 "words <tool_call>\n{not json}\n</tool_call>"])
def test_a_hermes_call_cut_short_or_malformed_stays_text(cut):
    reply = read_hermes(cut)
    assert reply.content == cut and reply.tool_calls == []


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_streamed_hermes_answer_reassembles_into_the_whole(size):
    text = "Let me look.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome")
    got = streamed(Reader(HERMES, tools=True), text, size)
    whole = read_hermes(text)
    assert got["content"].strip() == whole.content
    assert got["calls"] == [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]


def test_hermes_arguments_stream_before_the_call_ends():
    reader = Reader(HERMES, tools=True)
    head = CALL[:CALL.index('"days"')]
    parts = [p for ch in head for p in reader.feed(ch)]
    assert [p.kind for p in parts][0] == "call" and parts[0].text == "get_weather"
    assert "".join(p.text for p in parts if p.kind == "arguments") == '{"city": "Oslo \\"}{\\" [x]", '


def test_a_call_written_arguments_first_is_sent_whole_at_its_end():
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    assert streamed(Reader(HERMES, tools=True), text, 1)["calls"] == [("get_weather", {"city": "Oslo"})]


def test_words_that_only_look_like_a_marker_are_sent_as_words():
    text = "a <tool_cal> b <tool_"
    got = streamed(Reader(HERMES, tools=True), text, 1)
    assert got == {"content": text, "reasoning": "", "calls": []}


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_generic_form_streams_each_call(size):
    text = json.dumps({"tool_calls": [{"name": "a", "arguments": {"x": "}"}}, {"name": "b", "arguments": {}}]})
    assert streamed(Reader(GENERIC, tools=True), text, size)["calls"] == [("a", {"x": "}"}), ("b", {})]
    answer = json.dumps({"response": "in words"})
    assert streamed(Reader(GENERIC, tools=True), answer, size) == {"content": "in words", "reasoning": "", "calls": []}
    assert read_generic(answer).content == "in words"


def test_the_generic_form_cut_short_is_content():
    cut = json.dumps({"response": "in words"})[:-3]
    assert streamed(Reader(GENERIC, tools=True), cut, 2)["content"] == cut


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_thought_is_split_off_the_answer(size):
    text = "<think>\nweigh it </thin up</think>\n\nThe answer."
    assert split_thought(text, opened=False) == ("weigh it </thin up", "The answer.")
    got = streamed(Reader(Dialect(thinks=True), tools=False), text, size)
    assert (got["reasoning"], got["content"]) == ("weigh it </thin up", "The answer.")
    spaced = streamed(Reader(Dialect(thinks=True), tools=False, opened=True), "\n a \n b \n", size)
    assert spaced["reasoning"] == split_thought("\n a \n b \n", opened=True)[0] == "a \n b"


def test_a_thought_the_prompt_opened_runs_to_its_close_or_the_end():
    assert split_thought("still thinking", opened=True) == ("still thinking", "")
    got = streamed(Reader(Dialect(thinks=True), tools=False, opened=True), "a</think>b", 1)
    assert (got["reasoning"], got["content"]) == ("a", "b")
    assert opens_thought("<|im_start|>assistant\n<think>\n") and not opens_thought("<think>x</think>\n")


def test_without_a_thought_a_thinking_model_answers_in_content():
    for size in (1, 1000):
        got = streamed(Reader(Dialect(thinks=True), tools=False), "<thi is not a tag", size)
        assert got == {"content": "<thi is not a tag", "reasoning": "", "calls": []}
    assert split_thought("plain", opened=False) == (None, "plain")


def test_a_thought_then_a_hermes_call():
    text = "<think>need weather</think>\n" + CALL
    got = streamed(Reader(THINKING_HERMES, tools=True), text, 2)
    assert got["reasoning"] == "need weather" and got["calls"] == [("get_weather", ARGS)] and got["content"] == ""


def test_blocks_open_one_per_thought_words_and_call_in_the_order_written():
    """What the Responses and Messages streams send: each block opened by its first part,
    closed by a part of another kind or a new call; the reply they make is the answer."""
    reader, blocks = Reader(THINKING_HERMES, tools=True), Blocks()
    text = "<think>hm</think>Sure.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome")
    events = [e for ch in text for e in blocks.feed(reader.feed(ch))] + blocks.feed(reader.finish()) + blocks.close()
    opened = [(e[1].index, e[1].kind) for e in events if e[0] == "open"]
    assert opened == [(0, "reasoning"), (1, "content"), (2, "call"), (3, "call")]
    assert [e[1].index for e in events if e[0] == "close"] == [0, 1, 2, 3]
    assert sum(1 for e in events if e[0] == "delta" and e[1].index == 2) > 1
    reply = blocks.reply()
    assert (reply.reasoning, reply.content.strip()) == ("hm", "Sure.")
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in read_hermes(text.split("</think>")[1]).tool_calls]


LLAMA3 = Dialect("llama3")


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_llama3_answer_is_one_call_or_words(size):
    call = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1]}}'
    assert [(c.name, json.loads(c.arguments)) for c in read_llama3(call).tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": [1]})]
    got = streamed(Reader(LLAMA3, tools=True), " " + call, size)
    assert got["calls"] == [("get_weather", {"city": "Oslo", "days": [1]})] and not got["content"].strip()
    words = "It is sunny {maybe}."
    assert read_llama3(words).content == words and read_llama3(call[:-2]).content == call[:-2]
    assert streamed(Reader(LLAMA3, tools=True), words, size) == {"content": words, "reasoning": "", "calls": []}
    assert detect("{{ m.tool_calls }}<|start_header_id|>ipython<|end_header_id|>") == LLAMA3


MISTRAL = Dialect("mistral")
MISTRAL_ID = r"[A-Za-z0-9]{9}"
MISTRAL_CALLS = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo \\"]}", "days": [1]}}, '
                 '{"name": "lookup", "arguments": {}}]')


def test_mistral_templates_are_told_by_their_calls_marker_and_take_the_vocabularys_token():
    source = "{% for c in m.tool_calls %}[TOOL_CALLS][{{ c | tojson }}]{% endfor %}"
    assert detect(source) == MISTRAL and MISTRAL.tells_tools
    assert detect(source + "[ARGS]") == GENERIC        # Ministral 3's name[ARGS]{...}: not this form
    assert MISTRAL.with_vocabulary({"[TOOL_CALLS]": 5}).opener == 5
    assert MISTRAL.with_vocabulary({}).opener is None and HERMES.with_vocabulary({"[TOOL_CALLS]": 5}) == HERMES


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_mistral_answer_is_a_list_of_calls_or_words(size):
    expected = [("get_weather", {"city": 'Oslo "]}', "days": [1]}), ("lookup", {})]
    whole = read_mistral(MISTRAL_CALLS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == expected and whole.content is None
    assert all(re.fullmatch(MISTRAL_ID, c.id) for c in whole.tool_calls)
    got = streamed(Reader(MISTRAL, tools=True), MISTRAL_CALLS, size, ids=MISTRAL_ID)
    assert got["calls"] == expected and not got["content"].strip()
    words = "It is [sunny] in [TOOL_CALLS land."
    assert read_mistral(words).content == words and read_mistral(MISTRAL_CALLS[:-3]).content == MISTRAL_CALLS[:-3]
    assert streamed(Reader(MISTRAL, tools=True), words, size) == {"content": words, "reasoning": "", "calls": []}
    for start in ("[TOOL", "[TOOL_CALLS"):      # a marker's start that never became one is words
        assert streamed(Reader(MISTRAL, tools=True), start, size)["content"] == start


def test_mistral_arguments_stream_before_the_call_ends():
    reader = Reader(MISTRAL, tools=True)
    parts = [p for ch in MISTRAL_CALLS[:MISTRAL_CALLS.index('"days"')] for p in reader.feed(ch)]
    assert parts[0].kind == "call" and parts[0].text == "get_weather"
    assert "".join(p.text for p in parts if p.kind == "arguments") == '{"city": "Oslo \\"]}", '
