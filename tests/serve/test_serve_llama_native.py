"""llama-server's own routes on `swarmkv serve` (issue 64), as its clients call them, with
`requests` against a real server on loopback: the native /completion whole and streamed
(llama-server's fields; the stream's pieces add up to the whole answer), its fields the
engine does not act on refused by name, /tokenize with pieces and /detokenize, keys
required as on every route, and CORS only for the origins --cors-origins names."""
from __future__ import annotations

import json

import pytest
import requests

from serve_process import Serve

pytestmark = pytest.mark.slow

KEY = "key-native-0123456789"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("native")
    keys = folder / "keys"
    keys.write_text(f"{KEY} web\n")
    with Serve("--ctx-size", "2048", "--parallel", "4", "--api-key-file", str(keys),
               "--cors-origins", f"{ORIGIN},localhost", log=folder / "serve.log") as s:
        yield s


def post(server, path: str, body: dict, key: str | None = KEY, **kw):
    return requests.post(server.url + path, json=body, timeout=120,
                         headers={"Authorization": f"Bearer {key}"} if key else {}, **kw)


def events(reply) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.iter_lines(decode_unicode=True)
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_native_completion_answers_in_llama_servers_fields(server):
    reply = post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0,
                                         "return_tokens": True, "cache_prompt": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["stop"] is True and body["stop_type"] == "limit" and body["truncated"] is False
    assert body["tokens_predicted"] == 8 == len(body["tokens"]) and all(isinstance(t, int) for t in body["tokens"])
    assert body["tokens_evaluated"] == len(post(server, "/tokenize", {"content": "Once upon a time"}).json()["tokens"])
    assert body["timings"]["predicted_n"] == 8 and body["timings"]["prompt_n"] + body["timings"]["cache_n"] == \
        body["tokens_evaluated"]
    assert body["generation_settings"]["n_predict"] == 8 and body["prompt"] == "Once upon a time"
    assert isinstance(body["has_new_line"], bool) and body["content"]
    detok = post(server, "/detokenize", {"tokens": body["tokens"]}).json()["content"]
    assert detok == body["content"]


def test_the_stream_adds_up_to_the_whole_answer_and_ends_with_the_final_object(server):
    asked = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
    whole = post(server, "/completions", asked).json()
    streamed = events(post(server, "/completion", {**asked, "stream": True}, stream=True))
    assert all(e["stop"] is False for e in streamed[:-1]) and streamed[-1]["stop"] is True
    assert "".join(e["content"] for e in streamed) == whole["content"]
    assert streamed[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_a_stop_word_ends_the_answer_and_is_named(server):
    body = post(server, "/completion", {"prompt": "Count: 1, 2, 3,", "n_predict": 32, "temperature": 0,
                                        "stop": [","]}).json()
    assert body["stop_type"] == "word" and body["stopping_word"] == "," and "," not in body["content"]


def test_fields_the_engine_does_not_act_on_are_refused_by_name(server):
    reply = post(server, "/completion", {"prompt": "Hi", "n_predict": 4, "mirostat": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "mirostat"
    reply = post(server, "/completion", {"prompt": "Hi", "n_predict": 0})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n_predict"


def test_tokenize_with_pieces_and_detokenize_round_trip(server):
    text = "A test with unicode 媽 and emoji 🤗"
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)       # an emoji's bytes split over tokens
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == text
    bad = post(server, "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token"


@pytest.mark.parametrize("path", ["/completion", "/completions", "/tokenize", "/detokenize"])
def test_llama_servers_routes_need_the_key_too(server, path):
    reply = post(server, path, {"prompt": "Hi", "content": "Hi", "tokens": [1]}, key=None)
    assert reply.status_code == 401


@pytest.mark.parametrize("origin,allowed", [(ORIGIN, True), ("http://localhost:5173", True),
                                            ("http://127.0.0.1", True), ("https://evil.example", False),
                                            ("http://localhost.evil.example", False)])
def test_a_browser_preflight_is_answered_for_the_origins_named(server, origin, allowed):
    """A refused preflight is a 200 without the allow headers, as llama-server answers it."""
    reply = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization, Content-Type"})
    assert reply.status_code == 200
    assert (reply.headers.get("access-control-allow-origin") == origin) is allowed
    assert ("access-control-allow-methods" in reply.headers) is allowed


def test_header_names_come_in_their_usual_case(server):
    """Scripts (llama.cpp's tests among them) copy headers into a plain dict and read them by
    the names llama-server writes."""
    reply = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert dict(reply.headers)["Access-Control-Allow-Origin"] == ORIGIN
    assert dict(requests.get(server.url + "/health", timeout=30).headers)["Content-Type"] == "application/json"


def test_no_origin_is_allowed_unless_named(tmp_path):
    with Serve("--ctx-size", "1024", "--parallel", "2", log=tmp_path / "serve.log") as server:
        reply = requests.options(server.url + "/v1/chat/completions", timeout=30, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in reply.headers


def test_response_fields_pick_what_comes_back(server):
    body = post(server, "/completion", {"prompt": "Hello", "n_predict": 4, "response_fields": [
        "content", "generation_settings/n_predict", "no_such_field"]}).json()
    assert set(body) == {"content", "generation_settings/n_predict"} and body["generation_settings/n_predict"] == 4


@pytest.mark.parametrize("form", ["pairs", "object"])
def test_logit_bias_bans_tokens_given_as_text_or_ids(server, form):
    asked = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    first = post(server, "/completion", {**asked, "return_tokens": True}).json()["tokens"][0]
    text = post(server, "/detokenize", {"tokens": [first]}).json()["content"]
    for banned in (first, text):
        bias = [[banned, False]] if form == "pairs" else {str(banned): -100}
        body = post(server, "/completion", {**asked, "logit_bias": bias, "return_tokens": True}).json()
        assert first not in body["tokens"], (banned, body)


def test_openai_answers_carry_a_system_fingerprint_and_models_their_aliases(server):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    done = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
    assert done.system_fingerprint.startswith("b")
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2)
    assert chat.system_fingerprint == done.system_fingerprint
    card = requests.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert card["data"][0]["aliases"] == ["smollm2-135m"] and card["data"][0]["tags"] == []
    wrong = requests.post(server.url + "/completion", json={"prompt": "Hi"}, timeout=30,
                          headers={"Authorization": "Bearer wrong-key-0000"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


# ---- llama-server's extras on chat completions ----------------------------------------------

def chat_body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, **extra}


def test_a_chat_stream_opens_with_null_content_and_carries_timings_when_asked(server):
    chunks = [c for c in events(post(server, "/v1/chat/completions", chat_body(
        stream=True, timings_per_token=True, stream_options={"include_usage": True}), stream=True))]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in chunks[0]
    assert all("timings" in c for c in chunks[1:])
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["timings"]["predicted_n"] <= 6
    plain = events(post(server, "/v1/chat/completions", chat_body(stream=True), stream=True))
    assert not any("timings" in c for c in plain)


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """A server whose steps carry at most 32 tokens (--batch-size), fewer than its
    sequences: a longer prompt is read in several steps."""
    folder = tmp_path_factory.mktemp("batched")
    with Serve("--ctx-size", "2048", "--batch-size", "32", log=folder / "serve.log") as s:
        yield s


def progress_of(chunks: list[dict]) -> list[dict]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def test_return_progress_reports_the_cache_then_every_step_of_the_prompt(batched):
    """llama-server's return_progress: first what came from the cache (nothing read yet),
    then the prompt's tokens read after each step (at most --batch-size more each), the
    last all of them; all before the answer's first words. Asked again, the prompt comes
    from the cache but its last token. Without return_progress, no report."""
    body = chat_body(messages=[{"role": "user", "content": "Count the words: " + "one two three " * 20}],
                     stream=True, return_progress=True, stream_options={"include_usage": True})
    for again in (False, True):
        chunks = events(post(batched, "/v1/chat/completions", body, key=None, stream=True))
        shown = progress_of(chunks)
        total, cache = chunks[-1]["usage"]["prompt_tokens"], shown[0]["cache"]
        assert shown[0]["processed"] == cache and (cache == total - 1 if again else cache < total - 64)
        assert [p["processed"] for p in shown] == sorted({p["processed"] for p in shown})
        assert all(0 < b["processed"] - a["processed"] <= 32 for a, b in zip(shown, shown[1:]))
        assert len(shown) == 1 + -(-(total - cache) // 32) and shown[-1]["processed"] == total
        assert {p["total"] for p in shown} == {total} and {p["cache"] for p in shown} == {cache}
        first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
        assert max(i for i, c in enumerate(chunks) if "prompt_progress" in c) < first_text
    plain = dict(body, return_progress=False)
    assert not progress_of(events(post(batched, "/v1/chat/completions", plain, key=None, stream=True)))


def test_a_native_completions_progress_carries_timings_that_never_go_back(batched):
    """As llama-server's test_metrics reads them: the first report before any prompt token
    is read (prompt_n and prompt_ms 0, nothing predicted), none negative or going back."""
    chunks = events(post(batched, "/completion", {
        "prompt": "the quick brown fox jumps over the lazy dog " * 8, "n_predict": 4, "stream": True,
        "timings_per_token": True, "return_progress": True}, key=None, stream=True))
    timed = [c["timings"] for c in chunks if "prompt_progress" in c]
    assert len(timed) > 2
    assert (timed[0]["prompt_n"], timed[0]["prompt_ms"], timed[0]["predicted_n"], timed[0]["predicted_ms"]) == \
        (0, 0.0, 0, 0.0)
    assert all(v is not None and v >= 0 for t in timed for v in t.values())
    assert [t["prompt_ms"] for t in timed] == sorted(t["prompt_ms"] for t in timed) and timed[-1]["prompt_ms"] > 0
    assert all("timings" in c for c in chunks)


def test_more_choices_than_a_step_has_rows_all_finish(batched):
    """Three prompts, 16 choices each, at --batch-size 32: each step carries 32 of the 48
    choices' tokens and the others wait a step (libllama asserted, and aborted the server,
    when a batch had fewer rows than the context's sequences)."""
    reply = post(batched, "/v1/completions", {"prompt": ["Red,", "Green,", "Blue,"], "n": 16, "max_tokens": 4,
                                              "temperature": 1.0, "seed": 3}, key=None)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == 48 and all(c["text"] or c["finish_reason"] == "stop" for c in choices)


def test_a_batch_size_under_one_is_refused_at_start():
    from swarmkv_ffi.serve.cli import build_parser
    assert build_parser().parse_args(["-b", "1"]).batch_size == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--batch-size", "0"])


@pytest.mark.parametrize("form", [{"json_schema": {"const": "42"}},
                                  {"response_format": {"type": "json_object", "schema": {"const": "42"}}},
                                  {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}}}])
def test_llama_servers_ways_of_giving_a_schema(server, form):
    reply = post(server, "/v1/chat/completions", chat_body(**form))
    assert reply.status_code == 200, reply.text
    assert json.loads(reply.json()["choices"][0]["message"]["content"]) == "42"


def test_a_schema_given_twice_is_refused(server):
    reply = post(server, "/v1/chat/completions", chat_body(json_schema={"const": "1"},
                                                           response_format={"type": "json_object"}))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "json_schema"


def test_a_prompt_over_the_context_says_how_long_it_is(server):
    reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["type"] == "exceed_context_size_error" and error["n_prompt_tokens"] > error["n_ctx"] > 2000
    assert f"maximum context length is {error['n_ctx']} tokens" in error["message"]


def test_id_slot_is_accepted_and_input_tokens_counts_the_prompt(server):
    reply = post(server, "/chat/completions", chat_body(n=2, id_slot=0))
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2
    counted = post(server, "/chat/completions/input_tokens", chat_body()).json()["input_tokens"]
    assert counted == reply.json()["usage"]["prompt_tokens"]


def test_n_probs_whole_and_one_token_per_streamed_event(server, smol):
    asked = {"prompt": "I believe the meaning of life is", "n_predict": 5, "temperature": 0, "n_probs": 3,
             "return_tokens": True}
    whole = post(server, "/completion", asked).json()
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"]
    for p in probs:
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["id"] == p["id"]                     # greedy: the likeliest was taken
        assert bytes(p["bytes"]) == smol.token_bytes(p["id"])
        assert [t["logprob"] for t in p["top_logprobs"]] == sorted((t["logprob"] for t in p["top_logprobs"]),
                                                                    reverse=True)
    streamed = events(post(server, "/completion", {**asked, "stream": True}, stream=True))
    per_event = [e["completion_probabilities"] for e in streamed if not e["stop"]]
    assert all(len(p) == 1 for p in per_event) and [p[0] for p in per_event] == probs


def get(server, path: str, key: str | None = KEY):
    return requests.get(server.url + path, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_props_report_the_models_settings_as_llama_server_does(server, smol):
    """What llama-server's clients read first: the context one request may take, the
    slots, the template, the default sampling (seed random); the file named, not its folder."""
    props = get(server, "/props")
    assert props.status_code == 200
    body = props.json()
    assert body["total_slots"] == 4 and body["default_generation_settings"]["n_ctx"] == 2047
    assert body["model_path"].endswith(".gguf") and "/" not in body["model_path"]
    assert body["chat_template"] == smol.meta("tokenizer.chat_template") and "im_start" in body["chat_template"]
    assert body["eos_token"] == smol.token_bytes(smol.eos, special=True).decode()
    params = body["default_generation_settings"]["params"]
    assert params["seed"] == 4294967295 and params["temperature"] == 0.8 and params["n_predict"] == -1
    assert body["modalities"] == {"vision": False, "video": False, "audio": False}
    named = get(server, f"/props?model={body['model_alias']}").json()
    assert named == body


@pytest.mark.parametrize("method,path", [("GET", "/slots"), ("POST", "/props")])
def test_slots_and_setting_props_are_refused_as_not_supported(server, method, path):
    reply = requests.request(method, server.url + path, json={}, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 501 and reply.json()["error"]["type"] == "not_supported_error"
    assert "pool" in reply.json()["error"]["message"]


@pytest.mark.parametrize("method,path", [("GET", "/props"), ("GET", "/slots")])
def test_props_and_slots_need_the_key(server, method, path):
    assert requests.request(method, server.url + path, timeout=60).status_code == 401


def test_the_assistants_last_words_are_continued_and_two_at_the_end_refused(server):
    """A prefill, as llama-server serves it: the prompt ends with the assistant's words, not
    with its closed turn; the answer goes on from them. Two assistant messages at the end are
    a 400, as there."""
    said = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    prompt = post(server, "/apply-template", {"messages": said}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe fruit is")
    parts = [said[0], {"role": "assistant", "content": [{"type": "text", "text": "The"},
                                                        {"type": "text", "text": "fruit is"}]}]
    prompt = post(server, "/apply-template", {"messages": parts}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe\n\nfruit is")       # parts a blank line apart, as there
    answer = post(server, "/v1/chat/completions", {"messages": said, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    twice = post(server, "/v1/chat/completions", {"messages": said + [{"role": "assistant", "content": "x"}]})
    assert twice.status_code == 400 and "2 or more assistant messages" in twice.json()["error"]["message"]


def test_post_sampling_probs_are_what_the_chain_drew_from(server):
    """llama-server's post_sampling_probs: each token's probability after top_k/top_p/min_p
    and the temperature, the candidates most likely first; three left by top_k sum to 1,
    and greedy leaves one, of probability 1."""
    def probs(**asked) -> list[dict]:
        body = {"prompt": "Today was the day. Today I would finally become a", "n_predict": 4, "n_probs": 10,
                "post_sampling_probs": True, "seed": 7, **asked}
        got = post(server, "/completion", body)
        assert got.status_code == 200, got.text
        return got.json()["completion_probabilities"]
    for tok in probs(temperature=1.0, top_k=3):
        tops = [p["prob"] for p in tok["top_probs"]]
        assert 1 <= len(tops) <= 3 and tops == sorted(tops, reverse=True) and all(0 < p <= 1 for p in tops)
        assert sum(tops) == pytest.approx(1.0, abs=1e-5) and "logprob" not in tok
        assert tok["prob"] in tops and tok["id"] in {p["id"] for p in tok["top_probs"]}
    wide = probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert len(wide[0]["top_probs"]) == 10 and sum(p["prob"] for p in wide[0]["top_probs"]) < 1
    for tok in probs(temperature=0):
        assert tok["prob"] == 1.0 and [(p["id"], p["prob"]) for p in tok["top_probs"]] == [(tok["id"], 1.0)]


def test_ignore_eos_bans_every_end_token_and_says_so_in_the_settings(server, smol):
    """An end-of-generation token pushed to the top ends the answer at once; with
    ignore_eos it is banned (-inf, null in the settings as llama-server writes it) and the
    answer runs to n_predict."""
    push = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0, "logit_bias": [[smol.eos, 100]]}
    ended = post(server, "/completion", push).json()
    assert ended["stop_type"] == "eos" and ended["content"] == ""
    assert ended["generation_settings"]["logit_bias"] == [{"token": smol.eos, "bias": 100.0}]
    ran = post(server, "/completion", {**push, "ignore_eos": True}).json()
    assert ran["stop_type"] == "limit" and ran["tokens_predicted"] == 12
    banned = ran["generation_settings"]["logit_bias"]
    assert smol.eos in {b["token"] for b in banned} and all(b["bias"] is None for b in banned)
    plain = post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 2}).json()
    assert plain["generation_settings"]["logit_bias"] == []


def test_prompts_may_mix_text_and_tokens_or_come_as_prompt_objects(server, smol):
    """llama-server takes several prompts of both kinds at once, and a prompt as an object
    (`prompt_string`); media in it (`multimodal_data`) is refused, as no served model reads it."""
    text = "I believe the meaning of life is"
    tokens = [int(t) for t in smol.tokenize(text, add_special=True)]
    greedy = {"n_predict": 6, "temperature": 0}
    mixed = post(server, "/completion", {"prompt": [tokens, text, {"prompt_string": text}], **greedy}).json()
    # the same prompt each time (the answers may round apart: they share one batch; one
    # seated a step after another forks its cells, so tokens_cached differs by timing)
    assert len(mixed) == 3 and len({(m["prompt"], m["tokens_evaluated"]) for m in mixed}) == 1
    alone = post(server, "/completion", {"prompt": {"prompt_string": text}, **greedy}).json()
    assert alone["prompt"] == mixed[0]["prompt"] and alone["content"]
    media = post(server, "/completion", {"prompt": {"prompt_string": text, "multimodal_data": "AAAA"}})
    assert media.status_code == 400
    # one prompt in pieces: ids and texts side by side, the first text with BOS as at a prompt's start
    split = post(server, "/completion", {"prompt": [tokens[0], " believe", *tokens[3:]], **greedy}).json()
    believe = [int(t) for t in smol.tokenize(" believe", add_special=False)]
    joined = post(server, "/completion", {"prompt": [*tokens[:1], *believe, *tokens[3:]], **greedy}).json()
    assert split["prompt"] == joined["prompt"] and split["tokens_evaluated"] + split["tokens_cached"] == \
        joined["tokens_evaluated"] + joined["tokens_cached"]
    huge = post(server, "/completion", {"prompt": [1, "word " * 400_000]})
    assert huge.status_code == 400 and "cannot fit" in huge.json()["error"]["message"]


def test_temp_and_seed_are_every_requests_defaults(tmp_path):
    """llama-server's --temp and --seed: a request that gives no temperature or seed gets
    them (so it draws the same answer each time), one that gives its own keeps it."""
    # exact: the repeated request may start from the first one's cached cells, and only exact mode
    # makes an answer independent of that
    with Serve("--ctx-size", "1024", "--exact", "--temp", "1.5", "--seed", "7", log=tmp_path / "serve.log") as s:
        def said(path: str, **given) -> str:
            body = {"prompt": "Once upon a time", "n_predict": 12, **given} if path == "/completion" else \
                {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, **given}
            reply = post(s, path, body, key=None).json()
            return reply["content"] if path == "/completion" else reply["choices"][0]["message"]["content"]
        for path in ("/completion", "/v1/chat/completions"):
            assert said(path) == said(path) == said(path, temperature=1.5, seed=7)
            assert said(path, temperature=0) == said(path, temperature=0, seed=99)


def test_n_predict_is_max_tokens_on_openais_routes_too(server):
    """llama-server reads n_predict on its OpenAI routes as well."""
    text = post(server, "/v1/completions", {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0}).json()
    assert text["usage"]["completion_tokens"] == 5 and text["choices"][0]["finish_reason"] == "length"
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                                                 "n_predict": 3, "temperature": 0}).json()
    assert chat["usage"]["completion_tokens"] == 3


def test_default_max_tokens_minus_one_runs_to_the_context(tmp_path):
    """--default-max-tokens -1 (llama-server's --n-predict -1): an answer that sets no limit
    goes on until the context is full."""
    with Serve("--ctx-size", "256", "--default-max-tokens", "-1", log=tmp_path / "serve.log") as s:
        ran = post(s, "/completion", {"prompt": "Hi", "ignore_eos": True, "temperature": 0}, key=None).json()
        most = requests.get(s.url + "/props", timeout=30).json()["default_generation_settings"]["n_ctx"]
    assert ran["tokens_predicted"] + ran["tokens_evaluated"] == most > 250 and ran["stop_type"] == "limit"


def test_verbose_adds_what_was_read_and_written(server):
    """llama-server's `verbose`: a whole answer carries `__verbose`, the prompt as the model
    read it (its template's special tokens written out) and what it wrote; not without it."""
    said = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
            "max_tokens": 2}
    shown = post(server, "/chat/completions", {**said, "verbose": True}).json()
    assert shown["__verbose"]["prompt"].startswith("<|im_start|>system\nBook<|im_end|>")
    assert shown["__verbose"]["content"] == shown["choices"][0]["message"]["content"]
    assert shown["__verbose"]["tokens_predicted"] == shown["usage"]["completion_tokens"]
    assert "__verbose" not in post(server, "/chat/completions", said).json()


def test_several_addresses_in_one_host(tmp_path):
    """--host 127.0.0.1,::1 (llama-server's form) listens on both."""
    import socket
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with Serve("--ctx-size", "1024", "--host", "127.0.0.1,::1", log=tmp_path / "serve.log") as s:
        for url in (s.url, f"http://[::1]:{s.port}"):
            assert requests.get(url + "/health", timeout=30).json() == {"status": "ok"}


def test_verbose_answers_for_every_request_unless_one_says_otherwise(tmp_path):
    """--verbose-answers (and serve's -v, as llama-server's --verbose): every whole answer
    carries __verbose; a request's own verbose false leaves it out."""
    said = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with Serve("--ctx-size", "1024", "--verbose-answers", log=tmp_path / "serve.log") as s:
        assert "<|im_start|>user\nHi" in post(s, "/v1/chat/completions", said, key=None).json()["__verbose"]["prompt"]
        assert "__verbose" not in post(s, "/v1/chat/completions", {**said, "verbose": False}, key=None).json()
