"""lmxd agents that start from one document (REGISTER prefix=@fd): the document is
prefilled once for all of them, paused agents keep no KV of their own (one host copy of
the document, rebuilt conversations), and a conversation rebuilt after a pause continues
exactly as one that never paused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from corpus import LICENCE
from lmxd_daemon import Daemon
from swarmkv_ffi.conductor.access import Access
from swarmkv_ffi.conductor.agents import ConductorError
from swarmkv_ffi.conductor.client import LmxError
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
        first = [ask(c, f"a{i}", QUESTIONS[i % 4]) for i in range(8)]
        # the first agent prefilled the document; the other seven restored it
        assert [f["fields"]["kv_swap_restored"] for f in first] == ["false"] + ["true"] * 7
        status = c.status()
        (prefix,) = fields(status, "prefix")
        assert prefix["agents"] == "8" and int(prefix["host_bytes"]) > 0
        # 7 agents are paused with a conversation, and hold no KV of their own
        swapped = int(status["fields"]["swap_allocated_bytes"])
        assert swapped == int(prefix["host_bytes"])
        paused = [a for a in c.list() if a["state"] == "suspended"]
        assert len(paused) == 7 and all(a["kv_host_bytes"] == "0" for a in paused)
        # a second question to each: every conversation is rebuilt from the shared copy
        for i in range(8):
            ask(c, f"a{i}", "And in one word?")
        assert int(c.status()["fields"]["swap_allocated_bytes"]) <= 1.5 * int(prefix["host_bytes"])
        for i in range(8):
            c.unregister(f"a{i}")
        status = c.status()
        assert fields(status, "prefix") == [] and int(status["fields"]["swap_allocated_bytes"]) == 0


@pytest.mark.slow
@pytest.mark.fidelity
def test_a_rebuilt_conversation_continues_like_one_that_never_paused(tmp_path, doc):
    with Daemon(tmp_path) as d, d.client() as c:
        for name in ("paused", "other", "steady"):
            c.register(name, "smollm2-135m", n_ctx=1024, prefix=str(doc))
        a1 = ask(c, "paused", QUESTIONS[0])["text"]
        ask(c, "other", QUESTIONS[1])                      # "paused" is swapped out here
        a2 = ask(c, "paused", QUESTIONS[2])                # rebuilt: document + its own tokens
        assert a2["fields"]["kv_swap_restored"] == "true"
        s1 = ask(c, "steady", QUESTIONS[0])["text"]
        s2 = ask(c, "steady", QUESTIONS[2])["text"]        # never paused in between
        assert (a1, a2["text"]) == (s1, s2)
        c.reset("paused")                                  # back to the document, not to nothing
        assert ask(c, "paused", QUESTIONS[0])["text"] == a1


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
