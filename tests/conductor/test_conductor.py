"""lmxd end to end: a real daemon on a temporary socket, driven by the client and by raw
socket lines. Every wait is bounded (pytest-timeout plus socket timeouts)."""
from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from corpus import ROOT
from lmxd_daemon import SYSTEM_PYTHON, Daemon, become, wait_decoding
from swarmkv_ffi.lmxd import protocol
from swarmkv_ffi.lmxd.client import LmxError

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("lmxd"))
    yield d
    assert d.stop() == 0
    assert not d.path.exists(), "socket not removed on SIGTERM"


@pytest.fixture(scope="module")
def agents(daemon):
    with daemon.client() as c:
        a = c.register("smol", "smollm2-135m", n_ctx=512)["fields"]
        b = c.register("gem", "gemma3-270m", n_ctx=512)["fields"]
        s = c.register("smol2", "smollm2-135m", n_ctx=512)["fields"]
    return a, b, s


def allocated(client) -> int:
    return int(client.status()["fields"]["ledger_allocated_bytes"])


def test_register_two_models_and_share_weights(daemon, agents):
    smol, gem, smol2 = agents
    assert smol["shared_weights"] == "false" and smol2["shared_weights"] == "true"
    assert smol2["model_refcount"] == "2"
    assert int(smol["estimate_bytes"]) > int(smol["weights_bytes"]) > 0 and smol["estimate_source"] == "gguf"
    with daemon.client() as c:
        status = c.status()
        models = [line for line in status["lines"] if line.startswith("OK model path=")]
        assert len(models) == 2 and any("refcount=2" in line for line in models)
        ids = {a["agent_id"]: a for a in c.list()}
        assert set(ids) == {"smol", "gem", "smol2"}


def test_socket_is_private(daemon):
    assert stat.S_IMODE(daemon.path.stat().st_mode) == 0o600


def test_decode_reply_has_the_spec_shape(daemon, agents):
    with daemon.client() as c:
        lines = c.raw("DECODE smol 6 Once upon a time")
    assert lines[0] == "OK schema=lmx-daemon/1"
    assert lines[1] == "OK invoke=DECODE agent_id=smol"
    assert re.fullmatch(r"OK prompt_tokens=\d+ generated_tokens=\d+ stopped_on_eos=(true|false)", lines[2])
    assert re.fullmatch(r"OK elapsed_ms=\d+\.\d+", lines[3])
    assert re.fullmatch(r"OK kv_swap_evicted=\S+ kv_swap_restored=(true|false)", lines[4])
    assert re.fullmatch(r"OK queued_ms=\d+\.\d+ swap_ms=\d+\.\d+ slices=\d+ batch=\d+ prefix_forked=(true|false)",
                        lines[5])
    assert lines[6] == "BEGIN_RESPONSE" and "END_RESPONSE" in lines and lines[-1] == "OK done"


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """A daemon whose fast mode always takes patch 0003's attention kernel: by default a
    calibrated table picks ggml's or ours by the cells in use, and two agents at different
    cells could then run different kernels (the last build's table switched at 128 cells,
    between this test's two agents)."""
    d = Daemon(tmp_path_factory.mktemp("pinned"), env={"GGML_FA_SHARED": "on"})
    with d.client() as c:
        c.register("gem", "gemma3-270m", n_ctx=512)
        c.register("smol2", "smollm2-135m", n_ctx=512)
    yield d
    assert d.stop() == 0


def test_interrupted_conversation_matches_uninterrupted(pinned):
    """Swaps (evict to host RAM, restore) must not change what an agent says. Both agents
    decode alone in each step (the same batch compositions); only where their cells sit
    differs, which patch 0003's kernel ignores by construction."""
    with pinned.client() as c:
        c.register("alone", "smollm2-135m", n_ctx=512)
        c.register("busy", "smollm2-135m", n_ctx=512)
        try:
            solo = [c.decode("alone", 8, "The fox said")["text"], c.decode("alone", 8, "and then")["text"]]
            first = c.decode("busy", 8, "The fox said")
            other = c.decode("gem", 4, "Hello")  # evicts busy
            assert other["fields"]["kv_swap_evicted"] == "busy"
            c.decode("smol2", 4, "Meanwhile")
            second = c.decode("busy", 8, "and then")  # restores busy
            assert second["fields"]["kv_swap_restored"] == "true"
            assert [first["text"], second["text"]] == solo
            busy = next(a for a in c.list() if a["agent_id"] == "busy")
            assert busy["state"] == "active" and int(busy["tokens"]) > 16
            suspended = [a for a in c.list() if a["state"] == "suspended"]
            assert suspended and all(int(a["kv_host_bytes"]) > 0 for a in suspended)
        finally:
            c.unregister("alone")
            c.unregister("busy")


def test_reset_clears_the_conversation(daemon, agents):
    with daemon.client() as c:
        c.decode("smol2", 4, "Hello there")
        c.reset("smol2")
        assert next(a for a in c.list() if a["agent_id"] == "smol2")["tokens"] == "0"


def test_context_full_is_an_error_not_a_crash(daemon, agents):
    with daemon.client() as c:
        with pytest.raises(LmxError) as info:
            c.decode("smol2", 4000, "x")
        assert info.value.code == "BAD_REQUEST" or info.value.code == "CONTEXT_FULL"
        with pytest.raises(LmxError) as info:
            c.decode("smol2", 500, "word " * 100)
        assert info.value.code == "CONTEXT_FULL"


@pytest.mark.parametrize("line,code", [
    (b"\xff\xfe\x00garbage", "BAD_ENCODING"),
    (b"", "BAD_REQUEST"),
    (b"   ", "BAD_REQUEST"),
    (b"LAUNCH missiles", "UNKNOWN_VERB"),
    (b"DECODE smol many words", "BAD_REQUEST"),
    (b"DECODE smol 0 hi", "BAD_REQUEST"),
    (b"DECODE smol -5 hi", "BAD_REQUEST"),
    (b"REGISTER x", "BAD_REQUEST"),
    (b"REGISTER x smollm2-135m n_ctx=lots", "BAD_REQUEST"),
    (b"REGISTER x smollm2-135m batch=4", "BAD_REQUEST"),
    (b"REGISTER bad/id smollm2-135m", "BAD_REQUEST"),
    (b"REGISTER x /no/such/model.gguf", "UNKNOWN_MODEL"),
    (b"REGISTER smol smollm2-135m", "DUPLICATE_AGENT"),
    (b"UNREGISTER ghost", "UNKNOWN_AGENT"),
    (b"DECODE ghost 4 hi", "UNKNOWN_AGENT"),
    (b"STATUS now", "BAD_REQUEST"),
])
def test_bad_input_gets_err_and_connection_stays_usable(daemon, agents, line, code):
    with daemon.client() as c:
        reply = c.raw(line)
        assert reply[-1].startswith(f"ERR {code}"), reply
        assert c.raw("HELP")[-1] == "OK done"


def test_not_a_gguf_fails_to_load_and_unwinds(daemon, agents, tmp_path):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with daemon.client() as c:
        before = allocated(c)
        with pytest.raises(LmxError) as info:
            c.register("fake", str(bad))
        assert info.value.code == "MODEL_LOAD_FAILED"
        assert allocated(c) == before
        assert "fake" not in {a["agent_id"] for a in c.list()}


def test_line_too_long_is_skipped(daemon, agents):
    s = daemon.raw_socket()
    f = s.makefile("rb")
    s.sendall(b"DECODE smol 4 " + b"a" * (70 * 1024) + b"\nHELP\n")
    assert f.readline().startswith(b"ERR LINE_TOO_LONG")
    lines = []
    while not lines or lines[-1] != b"OK done\n":
        lines.append(f.readline())
    assert lines[1] == b"OK invoke=HELP\n"
    s.close()


def test_status_and_list_answer_during_a_decode(daemon, agents):
    """STATUS and LIST do not wait for the compute slot: both answer while the daemon
    itself says a DECODE holds it (STATUS decoding=...)."""
    def long_decode():
        with daemon.client() as c:
            c.decode("smol", 120, "Write a long story about a fox.")

    t = threading.Thread(target=long_decode)
    t.start()
    try:
        wait_decoding(daemon, "smol")
        with daemon.client() as c:
            listed = c.list()
            assert c.status()["fields"]["decoding"] == "smol", "LIST was not answered during the DECODE"
        assert {a["agent_id"] for a in listed} >= {"smol"}
    finally:
        t.join(timeout=300)
    with daemon.client() as c:
        assert c.status()["fields"]["decoding"] == "-"
        c.reset("smol")


def test_disconnect_mid_decode_leaves_conversation_unchanged(daemon, agents):
    """A client that leaves mid-DECODE: the log says CANCELLED and the conversation is as
    before."""
    with daemon.client() as c:
        c.reset("smol2")
        c.decode("smol2", 4, "Start")
        tokens_before = next(a for a in c.list() if a["agent_id"] == "smol2")["tokens"]
    cancelled_before = daemon.logs().count("DECODE smol2 CANCELLED")
    s = daemon.raw_socket()
    s.sendall(b"DECODE smol2 400 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,\n")
    wait_decoding(daemon, "smol2")
    s.close()
    with daemon.client() as c:
        reply = c.decode("smol2", 2, "again")  # waits for the abandoned decode to stop
        agent = next(a for a in c.list() if a["agent_id"] == "smol2")
    assert daemon.logs().count("DECODE smol2 CANCELLED") == cancelled_before + 1
    assert int(agent["tokens"]) == int(tokens_before) + int(reply["fields"]["prompt_tokens"]) + 2


def test_second_daemon_on_same_socket_refuses(daemon):
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.lmxd", "--socket", str(daemon.path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "already serving" in proc.stderr


def test_stale_socket_is_reclaimed(tmp_path):
    path = tmp_path / "lmx.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens
    d = Daemon(tmp_path)
    try:
        with d.client() as c:
            assert c.raw("HELP")[-1] == "OK done"
    finally:
        assert d.stop() == 0


def test_budget_denial_is_exact_and_changes_nothing(tmp_path):
    with Daemon(tmp_path, "--budget-bytes", "250000000") as d:
        with d.client() as c:
            c.register("one", "smollm2-135m", n_ctx=512)
            before = c.status()["fields"]
            lines = c.raw("REGISTER two gemma3-270m n_ctx=512")
            after = c.status()["fields"]
    assert re.fullmatch(r"ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=250000000 "
                        rf"ledger_allocated_bytes={before['ledger_allocated_bytes']} "
                        r"request_table_bytes=\d+", lines[-1]), lines
    assert after["ledger_allocated_bytes"] == before["ledger_allocated_bytes"]
    assert after["agents"] == "1"


def test_concurrent_clients_never_overshoot_and_end_at_zero(tmp_path):
    cap = 400_000_000  # room for a few SmolLM2 agents, not for sixteen
    d = Daemon(tmp_path, "--budget-bytes", str(cap))
    errors, seen_max = [], []

    def worker(k: int):
        try:
            with d.client() as c:
                for i in range(3):
                    try:
                        c.register(f"w{k}-{i}", "smollm2-135m", n_ctx=256)
                        registered = True
                    except LmxError as exc:
                        assert exc.code == "VRAM_LEDGER_DENY", exc
                        registered = False
                    f = c.status()["fields"]
                    seen_max.append(int(f["ledger_allocated_bytes"]))
                    assert int(f["ledger_allocated_bytes"]) <= cap
                    if registered:
                        c.unregister(f"w{k}-{i}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=500)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:3]
        with d.client() as c:
            f = c.status()["fields"]
            assert f["ledger_allocated_bytes"] == "0" and f["agents"] == "0"
            assert not [line for line in c.status()["lines"] if line.startswith("OK model path=")]
    finally:
        d.stop()
    assert max(seen_max) <= cap




@pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and a system python to connect as another uid")
def test_other_users_are_refused_unless_allowed():
    import shutil
    import tempfile
    tmp_path = Path(tempfile.mkdtemp(prefix="lmxd-uid-", dir="/tmp"))  # pytest's tmp is 0700
    os.chmod(tmp_path, 0o755)
    d = Daemon(tmp_path, "--allow-uid", "12345")
    # A refused client is answered and closed at once: its HELP may meet a closed socket
    # (EPIPE under load), but the refusal is still there to read.
    code = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "try: s.sendall(b'HELP\\n')\nexcept OSError: pass\n"
            "print(s.makefile().readline().strip())")

    def as_uid(uid):
        return subprocess.run([SYSTEM_PYTHON, "-c", code, str(d.path)], capture_output=True, text=True,
                              timeout=60, preexec_fn=become(uid)).stdout.strip()
    try:
        assert as_uid(65534).startswith("ERR FORBIDDEN")
        assert as_uid(12345) == "OK schema=lmx-daemon/1"
        assert stat.S_IMODE(d.path.stat().st_mode) == 0o666
    finally:
        d.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_swap_after_end_of_generation(daemon, agents):
    """After an end-of-generation stop every generated token is in the KV; the snapshot
    taken at eviction must agree with the agent's token count."""
    with daemon.client() as c:
        c.reset("smol2")
        # SmolLM2 answers this prompt greedily in 18 tokens, then ends the generation.
        first = c.decode("smol2", 64, "Say only OK.")
        assert first["fields"]["stopped_on_eos"] == "true"
        generated = int(first["fields"]["generated_tokens"])
        assert generated < 64
        tokens = int(next(a for a in c.list() if a["agent_id"] == "smol2")["tokens"])
        assert tokens == int(first["fields"]["prompt_tokens"]) + generated  # every generated token counted
        c.decode("gem", 2, "Hi")  # evicts smol2
        again = c.decode("smol2", 4, " Once upon a time, there was a")  # goes on: " king who had a"
        assert again["fields"]["kv_swap_restored"] == "true"
        assert again["fields"]["stopped_on_eos"] == "false"  # max_tokens stopped it
        assert int(again["fields"]["generated_tokens"]) == 4


def test_the_protocol_reference_lists_every_verb_and_error_code_the_daemon_has():
    """docs/lmxd.md's tables are what HELP says (a code added to one is added to both)."""
    doc = (ROOT / "docs" / "lmxd.md").read_text()
    verbs = {line.split()[0] for line in protocol.HELP if line[:1].isupper() and " " in line}
    verbs &= {"HELP", "STATUS", "LIST", "REGISTER", "UNREGISTER", "DECODE", "RESET"}
    assert len(verbs) == 7
    for verb in verbs:
        assert f"| `{verb}" in doc, verb
    documented = set(re.findall(r"^\| ([A-Z_]+) \|", doc, re.M))
    assert documented == set(protocol.ERROR_CODES), documented ^ set(protocol.ERROR_CODES)
