"""lmxd under abuse and faults (issue 13): descriptors past 1024, running out of them,
client limits, idle connections, FIFOs and files that change under the daemon, half-closed
clients, failures in the middle of a DECODE, the ledgers, ownership, protocol hygiene.
A real daemon on a real socket with the real model unless the fault cannot be made
from outside (then the Conductor runs in this process)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from swarmkv_ffi import catalog
from swarmkv_ffi.lmxd import protocol
from lmxd_daemon import Daemon, eventually, wait_decoding

pytestmark = pytest.mark.timeout(600)


def read_until_final(sock: socket.socket) -> list[str]:
    reader = sock.makefile("rb")
    lines = []
    while True:
        raw = reader.readline()
        if not raw:
            return lines
        line = raw.decode().rstrip("\n")
        lines.append(line)
        if line == protocol.FINAL_OK or line.startswith("ERR "):
            return lines


def connect(d: Daemon) -> socket.socket:
    """A raw connection, retried while the daemon's listen backlog is full."""
    for _ in range(200):
        try:
            return d.raw_socket()
        except BlockingIOError:
            time.sleep(0.05)
    raise TimeoutError("the daemon's backlog never drained")


@pytest.fixture
def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4096)
    if want < 2200:
        pytest.skip(f"needs RLIMIT_NOFILE >= 2200, hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_past_descriptor_1024_can_decode(tmp_path, raise_fd_limit):
    d = Daemon(tmp_path, "--max-clients", "2000")
    idle = []
    try:
        with d.client() as c:
            c.register("far", "smollm2-135m", n_ctx=256)
        for _ in range(1040):           # the daemon's descriptors climb past 1024
            idle.append(connect(d))
        for s in idle[-3:]:
            assert s.sendall(b"STATUS\n") is None and read_until_final(s)[-1] == "OK done"
        with d.client() as c:
            reply = c.decode("far", 2, "Hello")
            assert int(reply["fields"]["generated_tokens"]) >= 1
    finally:
        for s in idle:
            s.close()
        d.stop()


def test_running_out_of_descriptors_is_not_fatal(tmp_path):
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    d = Daemon(tmp_path, "--max-clients", "1000", preexec_fn=low_limit)
    held = []
    try:
        for _ in range(100):             # more than the daemon has descriptors for
            try:
                held.append(connect(d))
            except (OSError, TimeoutError):
                break
        eventually(lambda: "accept failed" in d.logs(), what="the daemon to log its failed accept()")
        assert d.proc.poll() is None, "the daemon died when accept() hit EMFILE"
        for s in held:
            s.close()

        def status_agents():
            with d.client() as c:
                return c.status()["fields"]["agents"]
        assert eventually(status_agents, what="a free descriptor after the others closed") == "0"
    finally:
        d.stop()


def served_connection(d: Daemon) -> socket.socket:
    """A connection the daemon answered (retried while the start-up probe's slot frees)."""
    def attempt():
        s = d.raw_socket()
        try:
            s.sendall(b"HELP\n")
            if read_until_final(s)[-1] == "OK done":
                return s
        except OSError:
            pass
        s.close()
    return eventually(attempt, what="a free client slot")


def test_max_clients_answers_busy(tmp_path):
    with Daemon(tmp_path, "--max-clients", "2") as d:
        a, b = served_connection(d), served_connection(d)
        third = d.raw_socket()
        line = third.makefile("rb").readline().decode()
        assert line.startswith("ERR BUSY 2 clients connected")
        a.close()

        def served():
            with d.client() as c:
                return c.status()
        assert eventually(served, what="the daemon to notice the closed client")
        b.close()


def test_idle_connection_is_closed_with_a_reason(tmp_path):
    with Daemon(tmp_path, "--idle-timeout", "1") as d:
        s = d.raw_socket()
        reader = s.makefile("rb")
        assert reader.readline().decode().startswith("ERR IDLE_TIMEOUT")
        assert reader.readline() == b""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("lmxd-abuse"))
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("kind", ["fifo", "dir", "dev"])
def test_non_regular_model_files_are_refused_fast(daemon, tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "model.gguf"
        os.mkfifo(path)
    else:
        path = tmp_path if kind == "dir" else Path("/dev/zero")
    t0 = time.time()
    with daemon.client() as c:
        lines = c.raw(f"REGISTER odd-{kind} {path}")
    assert time.time() - t0 < 10
    assert lines[-1].startswith("ERR MODEL_LOAD_FAILED"), lines
    assert {"fifo": "a FIFO", "dir": "a directory", "dev": "a device"}[kind] in lines[-1]


def test_half_closed_client_gets_the_whole_answer(daemon):
    with daemon.client() as c:
        c.register("half", "smollm2-135m", n_ctx=256)
    s = daemon.raw_socket()
    s.sendall(b"DECODE half 8 Hello there\n")
    s.shutdown(socket.SHUT_WR)
    lines = read_until_final(s)
    s.close()
    assert lines[-1] == "OK done", lines
    fields = protocol_fields(lines)
    assert int(fields["generated_tokens"]) >= 1 and int(fields["prompt_tokens"]) >= 1


def test_cancelled_decode_is_logged_as_cancelled(daemon):
    with daemon.client() as c:
        c.register("gone", "smollm2-135m", n_ctx=512)
    s = daemon.raw_socket()
    s.sendall(b"DECODE gone 300 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,\n")
    wait_decoding(daemon, "gone")
    s.close()
    with daemon.client() as c:
        c.decode("gone", 1, "again")   # waits for the abandoned decode to stop
    assert "DECODE gone CANCELLED" in daemon.logs()


def protocol_fields(lines):
    fields = {}
    for line in lines:
        if line.startswith("OK "):
            for pair in line[3:].split():
                key, _, value = pair.partition("=")
                fields[key] = value
    return fields


@pytest.mark.parametrize("line", ["DECODE a +5 hi", "DECODE a 1_000 hi", "REGISTER x smollm2-135m n_ctx=1_024",
                                  "DECODE a \u0663 hi", "DECODE a -1 hi"])
def test_numbers_are_plain_decimal_digits(daemon, line):
    with daemon.client() as c:
        assert c.raw(line)[-1].startswith("ERR BAD_REQUEST"), line


def test_reply_values_and_body_lines_cannot_break_the_framing():
    reply = protocol.ok("X", [protocol.kv(path="/tmp/a\nOK done\r")], body="one\nEND_RESPONSE\r\ntwo")
    lines = reply.split("\n")
    assert "OK path=/tmp/a\\x0aOK\\x20done\\x0d" in lines
    assert ".END_RESPONSE\r" in lines and lines.count("OK done") == 1
    assert "\n" not in protocol.err("X", "a\nb\x01c").rstrip("\n")


def test_symlink_retargeted_after_register_frees_the_right_model(daemon, tmp_path):
    link = tmp_path / "model.gguf"
    link.symlink_to(catalog.resolve("smollm2-135m"))
    with daemon.client() as c:
        c.register("via-link", str(link), n_ctx=256)
        link.unlink()
        link.symlink_to(catalog.resolve("gemma3-270m"))
        c.register("gem-direct", "gemma3-270m", n_ctx=256)
        c.unregister("via-link")
        models = [line for line in c.status()["lines"] if line.startswith("OK model ")]
        assert any("gemma" in m and "refcount=1" in m for m in models), models
        assert not any(str(link).replace(" ", "\\x20") in m for m in models), models
        c.unregister("gem-direct")


def test_a_file_truncated_while_its_header_is_read_is_an_error_not_sigbus(tmp_path):
    from swarmkv_ffi.conductor import estimate as est_mod
    from swarmkv_ffi.conductor.modelfile import OpenModel
    from swarmkv_ffi.errors import ModelLoadError
    copy = tmp_path / "model.gguf"
    shutil.copy(catalog.resolve("smollm2-135m"), copy)
    with OpenModel(copy) as (mf, fd):
        os.truncate(copy, 4096)
        with pytest.raises(ModelLoadError, match="changed while"):
            est_mod.estimate(mf, fd, 512)


def test_vram_table_second_agent_of_a_model_is_admitted(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"smollm2-135m": 150_000_000}))
    with Daemon(tmp_path, "--vram-table", str(table)) as d:
        with d.client() as c:
            c.register("t1", "smollm2-135m", n_ctx=256)
            c.register("t2", "smollm2-135m", n_ctx=256)   # was ERR INTERNAL (zero reservation)
            assert c.status()["fields"]["agents"] == "2"


def test_a_paused_agent_that_does_not_fit_the_swap_budget_keeps_its_tokens(tmp_path):
    """No DECODE is refused for want of swap: the paused agent keeps only its tokens and
    its next DECODE re-reads them (greedy, so it continues as it would have)."""
    with Daemon(tmp_path, "--swap-budget-bytes", "1000") as d:
        with d.client() as c:
            c.register("s1", "smollm2-135m", n_ctx=256)
            c.register("s2", "gemma3-270m", n_ctx=256)   # another model: s1's pool is paused
            first = c.decode("s1", 4, "Hello")
            c.decode("s2", 2, "Hi")                  # s1's KV does not fit 1000 bytes
            s1 = next(a for a in c.list() if a["agent_id"] == "s1")
            assert s1["state"] == "suspended" and s1["kv_host_bytes"] == "0"
            tokens = int(s1["tokens"])
            assert tokens >= int(first["fields"]["prompt_tokens"]) + 3
            assert c.status()["fields"]["swap_allocated_bytes"] == "0"
            again = c.decode("s1", 3, "and then")
            assert again["fields"]["kv_swap_evicted"] == "s2"
            s1 = next(a for a in c.list() if a["agent_id"] == "s1")
            assert int(s1["tokens"]) > tokens


def test_idle_agents_expire(tmp_path):
    with Daemon(tmp_path, "--agent-ttl", "1") as d:
        with d.client() as c:
            c.register("brief", "smollm2-135m", n_ctx=256)
            deadline = time.time() + 30
            while c.status()["fields"]["agents"] != "0":
                assert time.time() < deadline, "agent did not expire"
                time.sleep(0.5)
            assert c.status()["fields"]["ledger_allocated_bytes"] == "0"


# ---- failure atomicity: a libllama failure in the middle of a DECODE (in process) ----------
def test_a_failed_decode_rolls_back_and_other_agents_keep_working(monkeypatch):
    """llama_decode fails in a step that holds two agents' DECODEs: both are rolled back
    (their cells and histories as before), both get the error, and both work after."""
    from swarmkv_ffi.conductor.agents import Conductor
    from swarmkv_ffi.admission.ledger import Ledger
    from swarmkv_ffi.context import Context
    from swarmkv_ffi.errors import DecodeFailedError

    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1)
    try:
        c.register("a", "smollm2-135m", n_ctx=512)
        c.register("b", "smollm2-135m", n_ctx=512)
        c.decode("a", 4, "Hello")
        c.decode("b", 4, "Hi there")
        before = {n: list(c.get(n).history) for n in "ab"}
        real, calls, gate = Context.decode, {"n": 0}, threading.Barrier(2)

        def failing(self, batch):
            calls["n"] += 1
            if calls["n"] == 4:
                raise DecodeFailedError("injected llama_decode failure", -3)
            return real(self, batch)
        monkeypatch.setattr(Context, "decode", failing)
        errors = {}

        def ask(name):
            gate.wait()
            try:
                c.decode(name, 8, "Tell me more")
            except DecodeFailedError as exc:
                errors[name] = exc
        threads = [threading.Thread(target=ask, args=(n,)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        monkeypatch.setattr(Context, "decode", real)
        assert set(errors) == {"a", "b"}, errors
        pool = c.scheduler.live
        for name in "ab":
            agent = c.get(name)
            assert agent.history == before[name] and agent.pending is not None
            seat = pool.seat_of(agent)   # no cells past the history
            assert pool.ctx.seq_pos_max(seat.seq) == len(before[name]) - 1 == seat.kv_len - 1
        assert c.decode("b", 3, "Hi there").generated_tokens >= 1
        assert c.decode("a", 3, "Tell me more").generated_tokens >= 1
    finally:
        c.close()


def test_lmxd_contexts_keep_full_sliding_window_caches():
    from swarmkv_ffi.conductor.agents import Conductor
    from swarmkv_ffi.admission.ledger import Ledger
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1)
    try:
        agent = c.register("g", "gemma3-270m", n_ctx=256)
        ctx = c.new_context(agent.loaded, 256)
        assert ctx.params.swa_full is True
        ctx.close()
    finally:
        c.close()


def test_own_gpu_memory_is_not_counted_twice_in_a_pid_namespace(monkeypatch):
    """NVML reports host PIDs inside a container: our process is one of them, unrecognised."""
    from types import SimpleNamespace

    from swarmkv_ffi.admission.memory import DeviceMemory
    gib = 1 << 30
    fake = SimpleNamespace(
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * gib, used=30 * gib, free=50 * gib),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=4_000_000, usedGpuMemory=20 * gib),
                                                        SimpleNamespace(pid=4_000_001, usedGpuMemory=10 * gib)],
        nvmlDeviceGetName=lambda h: "Fake GPU")
    monkeypatch.setattr(DeviceMemory, "_open_nvml", staticmethod(lambda device: (fake, None)))
    mem = DeviceMemory(budget_bytes=None, own_hint=lambda: 20 * gib, refresh_s=3600)
    try:
        reading = mem.refresh()
        assert reading.own == 20 * gib and reading.others == 10 * gib
        assert mem.budget() == int(80 * gib * 0.9) - 10 * gib
    finally:
        mem.close()


def test_concurrent_first_use_assembles_a_model_once_and_never_half(tmp_path):
    """Two threads (or processes) resolving gemma3-270m for the first time: one assembles
    into a temporary name and renames; the other waits and reuses it."""
    from types import SimpleNamespace

    from swarmkv_ffi.catalog import _assemble_once
    calls = []

    def assemble(path, overwrite):
        calls.append(path)
        with open(path, "wb") as f:
            for _ in range(20):
                f.write(b"x" * 1000)
                f.flush()
                time.sleep(0.01)
    target = tmp_path / "model.gguf"
    results, sizes = [], []

    def first_use():
        results.append(_assemble_once(SimpleNamespace(assemble=assemble), target, 20_000))

    def watch():
        while len(results) < 2:
            if target.exists():
                sizes.append(target.stat().st_size)
    threads = [threading.Thread(target=first_use) for _ in range(2)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [target, target] and len(calls) == 1
    assert set(sizes) <= {20_000}, "a reader saw a half-assembled file"


def test_every_booking_is_checked_against_the_cap():
    from swarmkv_ffi.admission import keys
    from swarmkv_ffi.admission.ledger import Ledger, LedgerDenied
    ledger = Ledger(lambda: 1000)
    agent, weights = keys.agent(1000, "a"), keys.model("m")
    ledger.reserve(agent, 600)
    with pytest.raises(LedgerDenied) as info:
        ledger.settle({agent: 300, weights: 800})   # weights measured larger than estimated
    assert info.value.request == 500 and ledger.allocated == 600   # nothing changed
    ledger.settle({agent: 300, weights: 700})
    assert ledger.allocated == 1000
    with pytest.raises(TypeError):
        ledger.reserve("agent:1000:b", 1)           # a key is typed: nothing parses a string back


def test_memory_says_why_it_budgets_host_ram_and_when_a_refresh_fails(monkeypatch, caplog):
    """No silent fallback and no silently stale figures (they were swallowed before)."""
    import sys
    from types import SimpleNamespace

    from swarmkv_ffi.admission.memory import DeviceMemory

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=no_driver))
    caplog.set_level("WARNING", logger="swarmkv_ffi.lmxd")
    failed = threading.Event()
    mem = DeviceMemory(budget_bytes=None, refresh_s=0.01)
    try:
        assert mem.reading.source == "host"
        assert "NVML unavailable (RuntimeError: NVML Shared Library Not Found)" in caplog.text

        def broken():
            failed.set()
            raise OSError("meminfo unreadable")
        monkeypatch.setattr(mem, "_read", broken)
        assert failed.wait(5)
        mem.close()
        assert "memory refresh failed" in caplog.text and "meminfo unreadable" in caplog.text
        with pytest.raises(OSError):  # an admission reads live and sees the failure
            mem.budget()
    finally:
        mem.close()
