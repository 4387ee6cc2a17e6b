"""Several models behind one endpoint (issue 46): `swarmkv serve --model A --model B`
against a real server and the `openai` client. Requests are routed by their `model`;
/v1/models lists every one; an unknown name is a 404 naming the served ones; each model
keeps its own pool open beside the other's, so requests that alternate between models
never rebuild either pool (a document asked about again is forked, not prefilled); the
host-RAM tiers split --host-cache-mib between them."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from corpus import APACHE
from serve_process import Serve
from swarmkv_ffi.bench.servers import by_label
from swarmkv_ffi.serve.settings import Settings

pytestmark = pytest.mark.slow

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    with Serve("--model", SMOL, "--model", GEMMA, "--ctx-size", "2048", "--parallel", "8",
               "--host-cache-mib", "64", log=folder / "serve.log") as s:
        yield s


def ask(client, model: str, doc: str, question: str):
    return client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": doc}, {"role": "user", "content": question}])


def test_requests_go_to_the_model_they_name_and_both_pools_stay_open(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [SMOL, GEMMA]
    doc = " ".join(APACHE.split()[:300])
    first = {m: ask(client, m, doc, "Who may use the work?") for m in (SMOL, GEMMA)}
    assert {m: r.model for m, r in first.items()} == {SMOL: SMOL, GEMMA: GEMMA}
    assert first[SMOL].usage.prompt_tokens != first[GEMMA].usage.prompt_tokens    # two tokenizers
    again = {m: ask(client, m, doc, "Is there a warranty?") for m in (SMOL, GEMMA)}
    for m in (SMOL, GEMMA):        # the other model ran in between: this one's cells are still there
        assert again[m].usage.prompt_tokens_details.cached_tokens > first[m].usage.prompt_tokens // 2, m
    assert by_label(server, "swarmkv_pool_opens_total") == {SMOL: 1, GEMMA: 1}
    halves = by_label(server, "swarmkv_host_cache_bytes", state="limit")      # --host-cache-mib split
    assert halves == {SMOL: 32 << 20, GEMMA: 32 << 20}


def test_an_unknown_model_is_a_404_naming_the_served_ones(server):
    with pytest.raises(openai.NotFoundError) as info:
        ask(server.client(), "llama-3-70b", "A document.", "Hi?")
    assert "llama-3-70b" in str(info.value) and SMOL in str(info.value) and GEMMA in str(info.value)


def test_settings_refuse_a_model_twice_and_a_name_for_several():
    with pytest.raises(ValueError, match="given twice"):
        Settings(models=(SMOL, SMOL)).check()
    with pytest.raises(ValueError, match="--name"):
        Settings(models=(SMOL, GEMMA), name="assistant").check()
    Settings(models=(SMOL,), name="assistant").check()
    with pytest.raises(ValueError, match="at least one id"):
        Settings(models=(SMOL,), name=" , ").check()


def test_name_gives_one_model_several_ids_and_tags_its_card():
    """llama-server's --alias a,b,c and --tags: one pool under three ids."""
    specs = Settings(models=(SMOL,), name="tinyllama-2,fim,code", tags="chat,small").specs()
    assert [s.name for s in specs] == ["tinyllama-2", "fim", "code"]
    assert len({s.same_pool() for s in specs}) == 1 and all(s.tags == ("chat", "small") for s in specs)
    with pytest.raises(ValueError, match="given twice"):
        Settings(models=(SMOL,), name="a,a").check()


def test_settings_take_a_pool_as_small_as_llama_servers_tests_use():
    Settings(models=(SMOL,), ctx_size=256).check()
    with pytest.raises(ValueError, match="at least 128 cells"):
        Settings(models=(SMOL,), ctx_size=100).check()
    with pytest.raises(ValueError, match="--chat-template-file"):
        Settings(models=(SMOL, GEMMA), chat_template_file=Path("t.jinja")).check()
