"""lmxd agents that start from one document (REGISTER prefix=@fd): the document is
prefilled once for all of them and its cells are shared in their pool, paused agents keep
no KV of their own (one host copy of the document, rebuilt conversations), a conversation
rebuilt after a pause continues exactly as one that never paused, and agents decoded
together give the tokens they give alone (exact mode)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from corpus import LICENCE
from lmxd_daemon import Daemon
from swarmkv_ffi.bench.measure import at_once
from swarmkv_ffi.lmxd.access import Access
from swarmkv_ffi.conductor.agents import ConductorError
from swarmkv_ffi.lmxd.client import LmxError
from swarmkv_ffi.errors import SwarmKVError

pytestmark = pytest.mark.timeout(900)

DOC = LICENCE[:1500]
QUESTIONS = ["Can I sell copies?", "What is a Contribution?", "Who owns the patents?", "Is there a warranty?"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "contract.txt"
    path.write_text(DOC)
    return path


def fields(status: dict, prefix: str) -> list[dict]:
    """STATUS lines that start with `prefix`, parsed into dicts."""
    out = []
    for line in status["lines"]:
        if line.startswith(f"OK {prefix} "):
            out.append(dict(kv.split("=", 1) for kv in line[len(prefix) + 4:].split()))
    return out


def ask(c, agent: str, question: str) -> dict:
    return c.decode(agent, 12, f" Question: {question} Answer:")


@pytest.mark.slow
def test_eight_agents_share_one_prefill_and_one_host_copy(tmp_path, doc):
    with Daemon(tmp_path) as d, d.client() as c:
        for i in range(8):
            r = c.register(f"a{i}", "smollm2-135m", n_ctx=1024, prefix=str(doc))["fields"]
            assert r["prefix_agents"] == str(i + 1) and int(r["prefix_tokens"]) > 200
        c.register("plain", "smollm2-135m", n_ctx=256)
        first = [ask(c, f"a{i}", QUESTIONS[i % 4]) for i in range(8)]
        # the first agent prefilled the document; the other seven share its cells
        assert all(f["fields"]["prefix_forked"] == "true" for f in first)
        assert all(f["fields"]["kv_swap_evicted"] == "-" for f in first)
        status = c.status()
        (prefix,) = fields(status, "prefix")
        assert prefix["agents"] == "8" and int(prefix["host_bytes"]) > 0
        assert int(status["fields"]["swap_allocated_bytes"]) == int(prefix["host_bytes"])
        assert all(a["state"] == "active" for a in c.list() if a["agent_id"] != "plain")
        # another pool (a plain agent) pauses all eight: none keeps KV of its own
        c.decode("plain", 2, "Hi")
        paused = [a for a in c.list() if a["state"] == "suspended"]
        assert len(paused) == 8 and all(a["kv_host_bytes"] == "0" for a in paused)
        # a second question to each: every conversation is rebuilt from the shared copy
        again = [ask(c, f"a{i}", "And in one word?") for i in range(8)]
        assert again[0]["fields"]["kv_swap_restored"] == "true"
        assert int(c.status()["fields"]["swap_allocated_bytes"]) <= 1.5 * int(prefix["host_bytes"])
        for name in [f"a{i}" for i in range(8)] + ["plain"]:
            c.unregister(name)
        status = c.status()
        assert fields(status, "prefix") == [] and int(status["fields"]["swap_allocated_bytes"]) == 0


@pytest.mark.slow
@pytest.mark.fidelity
def test_a_rebuilt_conversation_continues_like_one_that_never_paused(tmp_path, doc):
    with Daemon(tmp_path) as d, d.client() as c:
        for name in ("paused", "steady"):
            c.register(name, "smollm2-135m", n_ctx=1024, prefix=str(doc))
        c.register("plain", "smollm2-135m", n_ctx=256)
        a1 = ask(c, "paused", QUESTIONS[0])["text"]
        c.decode("plain", 2, "Hi")                         # another pool: "paused" is paused here
        a2 = ask(c, "paused", QUESTIONS[2])                # rebuilt: document + its own tokens
        assert a2["fields"]["kv_swap_restored"] == "true"
        s1 = ask(c, "steady", QUESTIONS[0])["text"]
        s2 = ask(c, "steady", QUESTIONS[2])["text"]        # never paused in between
        assert (a1, a2["text"]) == (s1, s2)
        c.reset("paused")                                  # back to the document, not to nothing
        assert ask(c, "paused", QUESTIONS[0])["text"] == a1


@pytest.mark.slow
@pytest.mark.fidelity
def test_agents_decoded_together_give_the_tokens_they_give_alone(tmp_path, doc):
    """Four agents over one document, each asked alone, then all at once with different
    answer lengths (so the batch shrinks as they finish): the same tokens, and the
    replies say they were batched."""
    lengths = [6, 12, 18, 24]
    with Daemon(tmp_path) as d, d.client() as c:
        for i in range(4):
            c.register(f"a{i}", "smollm2-135m", n_ctx=1024, prefix=str(doc))
        alone = [c.decode(f"a{i}", n, f" Question: {QUESTIONS[i]} Answer:")["text"]
                 for i, n in enumerate(lengths)]
        for i in range(4):
            c.reset(f"a{i}")
        clients = [d.client() for _ in range(4)]
        _, replies = at_once([lambda i=i: clients[i].decode(f"a{i}", lengths[i], f" Question: {QUESTIONS[i]} Answer:")
                              for i in range(4)])
        for own in clients:
            own.close()
    assert [replies[i]["text"] for i in range(4)] == alone
    assert max(int(replies[i]["fields"]["batch"]) for i in range(4)) >= 2, replies


def test_bad_prefixes_are_refused_and_leave_nothing(tmp_path, doc):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "dir").mkdir()
    with Daemon(tmp_path) as d, d.client() as c:
        before = c.status()["fields"]["ledger_allocated_bytes"]
        for path in [tmp_path / "latin1.txt", tmp_path / "dir", Path("/proc/self/maps"), doc]:
            n_ctx = 256 if path == doc else 1024            # the document does not fit 256 cells
            with pytest.raises(LmxError) as exc:
                c.register("x", "smollm2-135m", n_ctx=n_ctx, prefix=str(path))
            assert exc.value.code == "BAD_PREFIX", exc.value
        with pytest.raises(SwarmKVError, match="cannot open the prefix document"):
            c.register("x", "smollm2-135m", prefix=str(tmp_path / "missing.txt"))   # refused here
        with pytest.raises(LmxError) as exc:
            c.request("REGISTER x smollm2-135m prefix=@fd")   # no descriptor came with the line
        assert exc.value.code == "BAD_REQUEST" and "no file descriptor" in exc.value.message
        assert c.list() == [] and c.status()["fields"]["ledger_allocated_bytes"] == before
        with pytest.raises(LmxError) as exc:
            c.request("REGISTER x smollm2-135m prefix=")
        assert exc.value.code == "BAD_REQUEST"


def test_only_the_daemons_own_user_may_name_a_prefix_path(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("a document")
    access = Access(admin_uid=os.getuid())
    assert access.prefix(str(doc), os.getuid(), []) == "a document"
    with pytest.raises(ConductorError) as exc:
        access.prefix(str(doc), os.getuid() + 4242, [])      # before anything is opened
    assert exc.value.code == "FORBIDDEN" and "descriptor" in str(exc.value)
    link = tmp_path / "link.txt"
    link.symlink_to(doc)
    with pytest.raises(ConductorError) as exc:
        access.prefix(str(link), os.getuid(), [])            # a final symlink is not followed
    assert exc.value.code == "BAD_PREFIX"
    fd = os.open(doc, os.O_RDONLY)
    assert access.prefix("@fd", os.getuid() + 4242, [fd]) == "a document"   # and closed it
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.slow
@pytest.mark.fidelity
def test_eight_agents_decode_the_document_once_and_answer_as_a_plain_run(monkeypatch):
    """In process, every row handed to llama_decode counted: eight prefix agents asked one
    after another decode the document once (then only their own tokens), and each answer
    is the requested length and equals a plain exact run over document + question
    (tests/plain.py: Context and Batch only)."""
    from plain import greedy, one_token_per_decode
    from swarmkv_ffi.batch import Batch
    from swarmkv_ffi.conductor.agents import Conductor
    from swarmkv_ffi.admission.ledger import Ledger
    from swarmkv_ffi.context import Context, ContextParams
    rows, real = [0], Context.decode

    def counting(self, batch):
        rows[0] += batch.n_tokens
        return real(self, batch)
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=2)
    try:
        for i in range(8):
            c.register(f"a{i}", "smollm2-135m", n_ctx=1024, prefix=DOC)
        model = c.get("a0").loaded.model
        doc = [int(t) for t in model.tokenize(DOC)]
        monkeypatch.setattr(Context, "decode", counting)
        replies = [c.decode(f"a{i}", 12, f" Question: {QUESTIONS[i % 4]} Answer:") for i in range(8)]
        monkeypatch.setattr(Context, "decode", real)
        own = sum(r.prompt_tokens + r.generated_tokens - (not r.stopped_on_eog) for r in replies)
        assert rows[0] == len(doc) + own, (rows[0], len(doc), own)        # the document once
        for i in (0, 5):
            agent, r = c.get(f"a{i}"), replies[i]
            assert r.generated_tokens == 12 and r.text.strip()
            question = [int(t) for t in model.tokenize(f" Question: {QUESTIONS[i % 4]} Answer:", add_special=False)]
            assert agent.history[:len(doc) + len(question)] == doc + question
            params = ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn="on", swa_full=True,
                                   batch_invariant=True, n_threads=2)
            with Context(model, params) as ctx:
                ctx.decode_tokens(doc + question[:-1], logits_last=False)
                batch = Batch(8)
                row = batch.add(question[-1], len(doc) + len(question) - 1, (0,), logits=True)
                ctx.decode(batch)
                tokens, _ = one_token_per_decode(ctx, batch, row, len(doc) + len(question), 12, greedy)
            assert agent.history[len(doc) + len(question):] + [agent.pending] == tokens
    finally:
        c.close()
