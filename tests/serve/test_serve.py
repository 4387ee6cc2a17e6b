"""`swarmkv serve` through the official `openai` client, on loopback, as agents use it.

One exact-mode server with two API keys serves most tests (exact: answers do not depend
on what runs beside them, so they can be compared token for token); a fast-mode server
checks that requests sent at once over one document prefill it once.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from corpus import APACHE
from serve_process import MODEL, Serve, ask, chat

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"


def document(name: str) -> str:
    """A document no other test sends (the cache is per server, tests share one)."""
    return f"Document {name}.\n" + APACHE[:2400]


def logprobs(reply) -> list[float]:
    return [e.logprob for e in reply.choices[0].logprobs.content]


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    keys = folder / "keys"
    keys.write_text(f"{KEY_A} alice\n# a comment\n{KEY_B} bob\n")
    with Serve("--exact", "--ctx-size", "16384", "--parallel", "48", "--api-key-file", str(keys),
               "--max-body-bytes", "65536", log=folder / "serve.log") as server:
        yield server


@pytest.mark.fidelity
def test_sixteen_at_once_prefill_once_and_answer_as_alone(exact):
    """16 questions over one document sent at once: one request decodes the document,
    the 15 others fork its cells (cached_tokens); every answer equals the same request
    sent alone, token for token and logprob for logprob, bit for bit (another key, so
    nothing of the first round is reused)."""
    doc = document("at-once")
    questions = [f"Question {i}: what does section {i} say?" for i in range(16)]
    a, b = exact.client(KEY_A), exact.client(KEY_B)
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: ask(a, chat(doc, q), logprobs=True), questions))
    alone = [ask(b, chat(doc, q), logprobs=True) for q in questions]
    n_doc = together[0].usage.prompt_tokens - 40        # the document and template, less the question
    assert sorted(cached(r) >= n_doc for r in together) == [False] + [True] * 15
    assert cached(alone[0]) == 0                         # key B never saw key A's cells
    for t, s in zip(together, alone):
        assert t.choices[0].message.content.strip()
        assert t.usage.completion_tokens == 16 or t.choices[0].finish_reason == "stop"
        assert t.choices[0].message.content == s.choices[0].message.content
        assert logprobs(t) == logprobs(s)
    assert sum(t.choices[0].message.content == together[0].choices[0].message.content for t in together) < 16


@pytest.mark.fidelity
def test_an_answer_equals_a_plain_exact_run(exact, smol):
    """The server's answer is the one an independent exact decode loop gives (tests/plain.py:
    Context and Batch only) over the chat template's tokens: the same tokens, and each
    token's logprob from the same logits bit for bit."""
    import numpy as np
    from plain import greedy, one_token_per_decode
    from swarmkv_ffi.batch import Batch
    from swarmkv_ffi.context import Context, ContextParams
    messages = chat(document("plain"), "Can I sell copies of the work?")
    reply = ask(exact.client(KEY_A), messages, max_tokens=20, logprobs=True)
    prompt = [int(t) for t in smol.tokenize(smol.apply_chat_template(messages), parse_special=True)]
    assert reply.usage.prompt_tokens == len(prompt)
    params = ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn="on", swa_full=True,
                           batch_invariant=True, n_threads=2)
    with Context(smol, params) as ctx:
        ctx.decode_tokens(prompt[:-1], logits_last=False)
        batch = Batch(8)
        row = batch.add(prompt[-1], len(prompt) - 1, (0,), logits=True)
        ctx.decode(batch)
        seen = []

        def pick(ctx, row):
            x = ctx.logits(row).astype(np.float64)
            token = greedy(ctx, row)
            seen.append(float(x[token] - x.max() - np.log(np.exp(x - x.max()).sum())))
            return token
        tokens, _ = one_token_per_decode(ctx, batch, row, len(prompt), 20, pick)
    text = b"".join(smol.token_bytes(t) for t in tokens).decode("utf-8", "replace")
    assert text.strip() and reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == len(tokens)
    assert logprobs(reply) == seen[:len(tokens)]


def test_a_conversation_reuses_its_earlier_turns(exact):
    client, doc = exact.client(KEY_A), document("turns")
    messages = chat(doc, "What is a Contribution?")
    first = ask(client, messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And who is a Contributor?"}]
    second = ask(client, messages)
    assert cached(first) < 20
    assert cached(second) >= first.usage.prompt_tokens


def test_keys_never_reuse_each_others_cells_and_a_key_is_required(exact):
    doc = document("keys")
    a1 = ask(exact.client(KEY_A), chat(doc, "Who may use the work?"))
    b1 = ask(exact.client(KEY_B), chat(doc, "Who may use the work?"))
    a2 = ask(exact.client(KEY_A), chat(doc, "Is there a warranty?"))
    assert cached(a1) < 20 and cached(b1) < 20      # (at most the template's opening tokens)
    assert cached(a2) > 400
    assert a1.choices[0].message.content == b1.choices[0].message.content
    for key in ("none", KEY_A[:-1] + "x"):
        with pytest.raises(openai.AuthenticationError) as err:
            ask(exact.client(key), chat(doc, "Hi"))
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"


def test_stream_sends_the_same_text_and_a_final_usage_chunk(exact):
    client, messages = exact.client(KEY_A), chat(document("stream"), "What must be kept in copies?")
    whole = ask(client, messages, max_tokens=24)
    chunks = list(ask(client, messages, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_seeds_and_stop_strings(exact):
    client, messages = exact.client(KEY_A), chat(document("sampling"), "Tell me about the license.")
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0.9, seed=5, n=3)
    one, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in one.choices]
    assert [c.index for c in one.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]          # a seed reproduces them
    assert len(set(texts)) > 1                                           # each choice its own draw
    greedy = ask(client, messages, max_tokens=24).choices[0].message.content
    words = greedy.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = ask(client, messages, max_tokens=24, stop=[stop, "zzzz"]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content
    assert greedy.startswith(cut.message.content) and greedy[len(cut.message.content):].startswith(stop)


def test_logprobs_rank_the_greedy_token_first(exact):
    reply = ask(exact.client(KEY_A), chat(document("logprobs"), "Is there a warranty?"), max_tokens=8,
                logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.top_logprobs[0].token == e.token and e.logprob == tops[0]     # greedy: the likeliest


def test_streamed_logprobs_are_every_token_once_as_in_the_whole_answer(exact):
    """Each streamed chunk carries the entries of the tokens since the last one: together
    they are the whole answer's entries, none lost or sent twice (they are formatted off
    the decode thread, as the stream reads them)."""
    client, messages = exact.client(KEY_A), chat(document("streamed logprobs"), "Who grants the license?")
    whole = ask(client, messages, max_tokens=24, logprobs=True, top_logprobs=2)
    chunks = list(ask(client, messages, max_tokens=24, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole.choices[0].logprobs.content]


def test_completions_endpoint(exact):
    reply = exact.client(KEY_A).completions.create(model=MODEL, prompt="The Apache License is", max_tokens=8,
                                                   temperature=0, logprobs=2)
    choice = reply.choices[0]
    assert choice.text.strip() and len(choice.logprobs.tokens) == reply.usage.completion_tokens
    assert [m.id for m in exact.client(KEY_A).models.list().data] == [MODEL]


def raw_post(server, path: str, body: bytes, key: str = KEY_A) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bad_requests_get_openai_errors_and_disturb_nothing(exact):
    good = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    cases = [
        (b'{"model": "smollm2-135m", "messages": [', 400, "not valid JSON"),
        (b'\xff\xfe', 400, "not valid JSON"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 17}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}).encode(),
         400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]}).encode(), 400, "role"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 3}).encode(),
         400, "temperature"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 100000}).encode(), 400, "maximum context length is 8191 tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 40000}]}).encode(), 413,
         "65536"),
    ]
    for body, status, said in cases:
        code, reply = raw_post(exact, "/v1/chat/completions", body)
        assert code == status and said in reply["error"]["message"], (body[:60], code, reply)
        assert {"message", "type", "param", "code"} <= set(reply["error"]) <= \
            {"message", "type", "param", "code", "n_prompt_tokens", "n_ctx"}     # llama-server's, on a long prompt
    assert raw_post(exact, "/v1/nowhere", good)[0] == 404
    assert raw_post(exact, "/v1/chat/completions", good, key="wrong-key-000")[0] == 401
    code, reply = raw_post(exact, "/v1/chat/completions", good)
    assert code == 200 and reply["choices"][0]["message"]["content"]


def test_a_client_that_leaves_mid_stream_leaves_the_others_alone(exact):
    """A stream closed after three chunks is cancelled and rolled back: the same prompt
    sent next finds only the document's cells, not the cells of its own question (which
    it would fork were the stream still running or kept whole). A request running beside
    it answers as it does alone, and the server goes on."""
    client, doc = exact.client(KEY_A), document("leave")
    alone = ask(client, chat(doc, "What is excluded?"), max_tokens=32).choices[0].message.content
    story = chat(doc, "Write a very long story about this license, its history, its authors and its users.")
    with cf.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(ask, exact.client(KEY_A), chat(doc, "What is excluded?"), 32)
        stream = ask(client, story, max_tokens=2000, stream=True)
        for _, _ in zip(range(3), stream):
            pass
        stream.close()
        assert beside.result().choices[0].message.content == alone
    time.sleep(1)
    after = ask(client, story, max_tokens=4)
    assert after.choices[0].message.content
    assert cached(after) < after.usage.prompt_tokens - 10, (cached(after), after.usage.prompt_tokens)


def test_sixteen_at_once_share_one_prefill_in_fast_mode(tmp_path):
    """(And a key over its quota of choices in flight gets 429, before any work; a request
    over the quota whatever runs beside it gets 400: retrying could never help.)"""
    with Serve("--ctx-size", "16384", "--parallel", "40", "--max-requests-per-key", "16",
               log=tmp_path / "serve.log") as server:
        client, doc = server.client(), document("fast")
        with cf.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: ask(client, chat(doc, f"Question {i}: what is section {i}?")),
                                    range(16)))
        with pytest.raises(openai.BadRequestError, match="at most 16 at once"):
            client.completions.create(model=MODEL, prompt=["a", "b"], n=9, max_tokens=2)
        running = client.completions.create(model=MODEL, prompt="Once upon a time", n=10, max_tokens=200,
                                            stream=True)
        next(iter(running))                                   # admitted: its 10 choices are in flight
        with pytest.raises(openai.RateLimitError, match="the limit per key is 16"):
            client.completions.create(model=MODEL, prompt="a", n=8, max_tokens=2)
        running.close()
    n_doc = replies[0].usage.prompt_tokens - 40
    assert sorted(cached(r) >= n_doc for r in replies) == [False] + [True] * 15
    assert all(r.choices[0].message.content.strip() for r in replies)


def test_a_restarted_server_restores_a_shared_document_from_the_cache(tmp_path):
    """--cache-dir: the document two requests shared is written once; a new server over the
    same folder restores it for that key (same tokens and logprobs as computed, exact
    mode) and not for another key, whatever the keys' order in the key file."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    cache = tmp_path / "cache"
    flags = ("--exact", "--ctx-size", "8192", "--parallel", "16", "--cache-dir", str(cache),
             "--api-key-file", str(keys))
    doc = document("persist")
    with Serve(*flags, log=tmp_path / "first.log") as server:
        client = server.client(KEY_A)
        ask(client, chat(doc, "Who may use the work?"))
        first = ask(client, chat(doc, "Is there a warranty?"), logprobs=True)     # forks the document
    assert cached(first) > 400
    assert len(list(cache.glob("*.snap"))) == 1
    with Serve(*flags, log=tmp_path / "second.log") as server:
        again = ask(server.client(KEY_A), chat(doc, "Is there a warranty?"), logprobs=True)
        other = ask(server.client(KEY_B), chat(doc, "Is there a warranty?"))
    assert cached(again) == cached(first)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert logprobs(again) == logprobs(first)
    assert cached(other) == 0
    # Entries are the key's, not its line's: with the lines swapped, key B (now on key A's
    # line) still gets nothing, and key A (moved) still restores its document.
    keys.write_text(f"{KEY_B}\n{KEY_A}\n")
    with Serve(*flags, log=tmp_path / "third.log") as server:
        swapped = ask(server.client(KEY_B), chat(doc, "Is there a warranty?"))
        moved = ask(server.client(KEY_A), chat(doc, "Is there a warranty?"))
    assert cached(swapped) == 0
    assert cached(moved) == cached(first)


@pytest.mark.fidelity
def test_lmxd_http_serves_beside_the_socket_on_one_engine(tmp_path):
    """lmxd --http: the OpenAI front and the line protocol on one conductor. An HTTP
    request that runs while a socket agent of the same model decodes (the two pools take
    turns, the request paused and restored between them) answers as it does alone (exact
    mode); the agent that books the front's pool cannot be unregistered from the socket;
    the daemon stops cleanly."""
    import urllib.request as request

    from lmxd_daemon import Daemon
    from swarmkv_ffi.bench.peer import free_port
    from swarmkv_ffi.lmxd.client import LmxError
    port = free_port()
    with Daemon(tmp_path, "--http", f"127.0.0.1:{port}", "--http-ctx-size", "4096", "--http-exact") as d:
        with request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        messages = chat(document("lmxd"), "What is a Contribution?")
        alone = ask(client, messages, max_tokens=24, logprobs=True)
        with d.client() as c:
            c.register("agent", MODEL, n_ctx=512)
            with cf.ThreadPoolExecutor(2) as pool:
                socket_side = pool.submit(c.decode, "agent", 48, "Once upon a time")
                beside = ask(client, chat(document("lmxd-2"), "What is a Contribution?"), max_tokens=24)
                again = ask(client, messages, max_tokens=24, logprobs=True)
                assert int(socket_side.result()["fields"]["generated_tokens"]) > 0
            assert beside.choices[0].message.content
            assert again.choices[0].message.content == alone.choices[0].message.content
            assert logprobs(again) == logprobs(alone)
            booking = [a["agent_id"] for a in c.list() if a["agent_id"].startswith("#requests-")]
            assert len(booking) == 1
            with pytest.raises(LmxError, match="books a request pool"):
                c.unregister(booking[0])
        assert d.stop() == 0
    assert "Traceback" not in d.logs()
