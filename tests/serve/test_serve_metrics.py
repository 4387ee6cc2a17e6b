"""/metrics (issue 45) against a real `swarmkv serve` with two keys and a metrics key:
the counters move as requests run, sixteen choices over one document decode together
(their prompt booked once), and a key's scrape shows its own counters only."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from corpus import APACHE
from serve_process import MODEL, Serve, scrape

pytestmark = pytest.mark.slow

KEY_A, KEY_B, OPERATOR = "key-a-0123456789", "key-b-0123456789", "metrics-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("metrics")
    keys = folder / "keys"
    keys.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")
    with Serve("--ctx-size", "8192", "--parallel", "40", "--api-key-file", str(keys),
               "--metrics-key", OPERATOR, log=folder / "serve.log") as s:
        yield s


def steps_over(figures: dict, rows: int) -> float:
    """Steps that carried more than `rows` decode rows (`rows` a bucket bound; none before
    the pool's first step)."""
    bucket = figures.get(("swarmkv_step_decode_rows_bucket", (("le", f"{rows}.0"),)), 0)
    return figures.get(("swarmkv_step_decode_rows_bucket", (("le", "+Inf"),)), 0) - bucket


def test_counters_move_and_sixteen_choices_decode_together(server):
    """n=16 over a 1,500-token document with max_tokens 48: each choice books its own
    tokens, not the document again, so all 16 fit 8,192 cells and decode in one step
    (booked whole, 3 would); the operator's counters say so, and count what ran."""
    doc = " ".join(APACHE.split()[:1100])
    before = scrape(server, OPERATOR)
    reply = server.client(KEY_A).chat.completions.create(
        model=MODEL, n=16, max_tokens=48, temperature=0.8, seed=1,
        messages=[{"role": "system", "content": doc}, {"role": "user", "content": "Summarise it."}])
    after = scrape(server, OPERATOR)
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew[("swarmkv_requests_total", ())] == 16
    assert grew[("swarmkv_prompt_tokens_total", ())] == reply.usage.prompt_tokens
    assert grew[("swarmkv_generation_tokens_total", ())] == reply.usage.completion_tokens
    assert steps_over(after, 8) - steps_over(before, 8) >= 1, "no step carried the 16 choices together"
    assert after[("swarmkv_kv_cells", (("state", "total"),))] == 8192
    assert after[("swarmkv_requests_running", ())] == 0
    assert after[("swarmkv_sequences", (("kind", "kept"),))] >= 1
    again = server.client(KEY_A).chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": doc}, {"role": "user", "content": "Who wrote it?"}])
    last = scrape(server, OPERATOR)
    assert last[("swarmkv_prompt_tokens_cached_total", (("tier", "pool"),))] - \
        after[("swarmkv_prompt_tokens_cached_total", (("tier", "pool"),))] == again.usage.prompt_tokens_details.cached_tokens > 1000
    assert last[("swarmkv_prefills_avoided_total", ())] == after[("swarmkv_prefills_avoided_total", ())] + 1


def test_a_key_sees_its_own_counters_and_nothing_of_the_pool(server):
    """Key B's scrape: its requests only (key A's are not in it), no cells, no steps."""
    mine = scrape(server, KEY_B)
    assert not any(name.startswith(("swarmkv_kv_cells", "swarmkv_step", "swarmkv_sequences"))
                   for name, _ in mine)
    server.client(KEY_B).chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}])
    later = scrape(server, KEY_B)
    assert later[("swarmkv_requests_total", ())] == mine[("swarmkv_requests_total", ())] + 1
    assert scrape(server, OPERATOR)[("swarmkv_requests_total", ())] > later[("swarmkv_requests_total", ())]


def test_a_models_state_is_the_operators_to_see(server):
    """Issue 63: /v1/models showed every key each model's unloaded -> loading -> loaded
    within 56 ms of another key's request. A key sees the ids; the metrics key, the state."""
    def cards(key: str) -> list[dict]:
        request = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["data"]
    mine, operator = cards(KEY_B), cards(OPERATOR)
    assert [c["id"] for c in mine] == [c["id"] for c in operator] == [MODEL]
    assert "status" not in mine[0] and operator[0]["status"]["value"] == "loaded"
    with pytest.raises(urllib.error.HTTPError) as info:
        cards("key-wrong-0123456789")
    assert info.value.code == 401


def native(server, key: str, prompt: str, n_predict: int) -> dict:
    """llama-server's POST /completion, greedy; its `timings`."""
    request = urllib.request.Request(server.url + "/completion", method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["timings"]


def test_llama_servers_figures_add_up_to_what_the_answers_said(server):
    """llama-server's `llamacpp:` figures, under its names and types: prompt tokens read and
    cached, tokens predicted, their seconds, as the answers' timings report them; a key's
    scrape has its own, the operator's also the decode calls. The scrape carries the
    process's start time as llama-server's does."""
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    before, mine_before = scrape(server, OPERATOR), scrape(server, KEY_B)
    spent = [native(server, KEY_B, prompt, n) for n in (4, 16)]
    after, mine = scrape(server, OPERATOR), scrape(server, KEY_B)
    assert spent[1]["cache_n"] > 0, "the second request did not reuse the first's prompt"
    for view, was in ((after, before), (mine, mine_before)):
        grew = {name: view[(f"llamacpp:{name}", ())] - was[(f"llamacpp:{name}", ())] for name in (
            "prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total",
            "prompt_seconds_total", "tokens_predicted_seconds_total")}
        assert grew["prompt_tokens_total"] == sum(t["prompt_n"] for t in spent)
        assert grew["prompt_tokens_cached_total"] == sum(t["cache_n"] for t in spent)
        assert grew["tokens_predicted_total"] == sum(t["predicted_n"] for t in spent) > 0
        assert grew["prompt_seconds_total"] == pytest.approx(sum(t["prompt_ms"] for t in spent) / 1e3, rel=0.05)
        assert grew["tokens_predicted_seconds_total"] > 0
        # prometheus-client's parser names every counter's sample ..._total; the text has it bare
        assert view[("llamacpp:n_tokens_max_total", ())] >= spent[1]["cache_n"] + spent[1]["prompt_n"] + spent[1]["predicted_n"]
    assert after[("llamacpp:n_decode_total", ())] > before[("llamacpp:n_decode_total", ())]
    assert ("llamacpp:n_decode_total", ()) not in mine and ("llamacpp:requests_deferred", ()) not in mine
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        text = reply.read().decode()
        assert 0 < time.time() - int(reply.headers["Process-Start-Time-Unix"]) < 3600
    assert "# TYPE llamacpp:n_tokens_max counter\nllamacpp:n_tokens_max " in text
    assert "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached" in text


def test_timings_rate_generation_over_the_steps_after_the_first_token(server):
    """The first token comes with the prompt's last step: one token has no generation rate,
    sixteen have fifteen steps' (llama-server's timings)."""
    one, sixteen = (native(server, KEY_A, "I believe", n) for n in (1, 16))
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == one["predicted_per_token_ms"] == 0.0
    assert sixteen["predicted_n"] == 16
    assert sixteen["predicted_per_second"] == pytest.approx(1e3 * 15 / sixteen["predicted_ms"])


def test_no_metrics_turns_the_route_off_as_llama_server_is_without_metrics(tmp_path):
    with Serve("--ctx-size", "1024", "--no-metrics", log=tmp_path / "serve.log") as off:
        with pytest.raises(urllib.error.HTTPError) as info:
            scrape(off, None)
    assert info.value.code == 501 and json.loads(info.value.read())["error"]["type"] == "not_supported_error"


@pytest.mark.parametrize("key", [None, "metrics-wrong-0123"])
def test_a_scrape_without_a_valid_key_is_refused(server, key):
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(server, key)
    assert info.value.code == 401


def test_sixteen_agents_without_max_tokens_start_together(server):
    """16 agents at once over the whole license (about 2,500 tokens), sending no max_tokens
    (as LangChain does: 1,024 each by default): each books its question and a few dozen
    cells more, growing as it goes, so all 16 decode in one step in 8,192 cells (booking
    max_tokens whole, 4 would) and none is refused."""
    import threading
    before = scrape(server, OPERATOR)
    client = server.client(KEY_A)
    replies, errors = [], []

    def agent(i: int) -> None:
        try:
            replies.append(client.chat.completions.create(model=MODEL, temperature=0, stop=["\n"], messages=[
                {"role": "system", "content": APACHE},
                {"role": "user", "content": f"In one line: what does section {i + 1} say?"}]))
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(replies) == 16
    after = scrape(server, OPERATOR)
    assert steps_over(after, 8) - steps_over(before, 8) >= 1, "no step carried the 16 agents together"


def test_an_evicted_document_comes_back_from_host_ram(tmp_path):
    """--ctx-size 1536: a request over another 1,000-token text evicts a 600-token
    document's cells, which go to host RAM; the next question over the document restores
    them instead of prefilling (its cached_tokens, the host tier's counter) and host RAM
    stays within --host-cache-mib."""
    words = APACHE.split()
    doc, other = " ".join(words[:420]), " ".join(words[420:1200])
    with Serve("--ctx-size", "1536", "--host-cache-mib", "64", log=tmp_path / "serve.log") as server:
        client = server.client()

        def ask(text: str, question: str):
            return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": text}, {"role": "user", "content": question}])
        first = ask(doc, "Who wrote it?")
        assert 500 < first.usage.prompt_tokens < 700
        assert 1000 < ask(other, "Summarise it.").usage.prompt_tokens < 1400
        again = ask(doc, "What is a Contribution?")
        figures = scrape(server, None)
    assert again.usage.prompt_tokens_details.cached_tokens > 500
    assert figures[("swarmkv_prompt_tokens_cached_total", (("tier", "host"),))] == \
        again.usage.prompt_tokens_details.cached_tokens
    used = figures[("swarmkv_host_cache_bytes", (("state", "used"),))]
    assert 0 < used <= figures[("swarmkv_host_cache_bytes", (("state", "limit"),))] == 64 << 20
