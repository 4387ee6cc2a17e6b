"""lmxd shared by several users, tried as a hostile local user would: a real daemon run
as root and clients run as two other uids (VICTIM and MALLORY). Each test is one finding
of the multi-user review: reading what the client could not, reaching another user's
agent, killing the daemon with a crafted file, hogging its budgets or its turns, and
learning about another user's documents from replies."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from corpus import LICENCE
from lmxd_daemon import SYSTEM_PYTHON, Daemon, as_user, become, eventually, shared_tmp, wait_decoding
from swarmkv_ffi import catalog, tiny_gguf
from swarmkv_ffi.lmxd.protocol import read_reply

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                                 reason="needs root and a system python to connect as other uids")]

VICTIM, MALLORY = 4242, 65534
DOC = LICENCE[:1200]


def last(reply: list[str]) -> str:
    return reply[-1]


def fields(reply: list[str]) -> dict:
    out = {}
    for line in reply:
        if line.startswith("OK "):
            for pair in line[3:].split():
                key, eq, value = pair.partition("=")
                if eq:
                    out[key] = value
    return out


@pytest.fixture(scope="module")
def tmp():
    folder = shared_tmp("lmxd-sec-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def files(tmp):
    """The victim's private home (0700) with a world-readable secret in it, the victim's
    own 0600 model, a readable shared document, and hostile GGUFs."""
    home = tmp / "victim-home"
    home.mkdir()
    (home / ".env").write_text("DB_PASSWORD=hunter2\n")
    os.chmod(home / ".env", 0o644)
    own_model = home / "mine.gguf"
    shutil.copy(catalog.resolve("smollm2-135m"), own_model)
    os.chmod(own_model, 0o600)
    os.chown(own_model, VICTIM, VICTIM)
    os.chown(home, VICTIM, VICTIM)
    os.chmod(home, 0o700)
    doc = tmp / "shared-doc.txt"
    doc.write_text(DOC)
    bad = Path(tiny_gguf.write(str(tmp / "layers1000.gguf"), claimed_layers=1000))
    zeros = tmp / "zeros.gguf"
    with open(zeros, "wb") as f:
        f.truncate(1 << 30)                      # 1 GiB, sparse, not a model
    for path in (doc, bad, zeros):
        os.chmod(path, 0o644)
    return {"home": home, "secret": home / ".env", "own_model": own_model, "doc": doc,
            "bad": bad, "zeros": zeros}


@pytest.fixture(scope="module")
def daemon(tmp):
    d = Daemon(tmp, "--allow-uid", str(VICTIM), "--allow-uid", str(MALLORY))
    yield d
    d.stop()


def queue_behind(d: Daemon, running: bytes, queued: bytes) -> tuple[socket.socket, socket.socket]:
    """Start the DECODE `running`, then queue `queued` behind it (the daemon says so)."""
    first = d.raw_socket()
    first.sendall(running + b"\n")
    wait_decoding(d, running.split()[1].decode())
    second = d.raw_socket()
    second.sendall(queued + b"\n")
    eventually(lambda: d.client().status()["fields"]["decode_queue"] != "0", what="the DECODE to queue")
    return first, second


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# ---- 1, 4: the daemon opens nothing a client names -------------------------------------------
def test_paths_of_other_users_files_are_never_opened(daemon, files):
    secret, missing = files["secret"], files["home"] / "no-such-file"
    replies = as_user(MALLORY, daemon,
                      f"REGISTER s smollm2-135m prefix={secret}",
                      f"REGISTER s smollm2-135m prefix={missing}",
                      f"REGISTER s {files['own_model']}",
                      f"REGISTER s {files['home'] / 'missing.gguf'}",
                      ("REGISTER s smollm2-135m prefix=@fd", [secret]),
                      ("REGISTER s smollm2-135m prefix=@fd", ["/proc/self/maps"]),
                      ("REGISTER s smollm2-135m prefix=@fd", ["/proc/1/cmdline"]),
                      "LIST")
    path_secret, path_missing, model, model_missing, opened, maps, maps1, listing = replies
    assert last(path_secret).startswith("ERR FORBIDDEN prefix=PATH would be read with the daemon's")
    assert last(path_missing) == last(path_secret)                # no existence oracle
    assert last(model).startswith("ERR UNKNOWN_MODEL")
    assert last(model_missing).replace("missing.gguf", "mine.gguf") == last(model)
    assert opened == ["CLIENT_OPEN_FAILED Permission denied"]     # the kernel said no, not lmxd
    assert last(maps).startswith("ERR BAD_PREFIX") and "procfs" in last(maps)
    assert last(maps1).startswith("ERR BAD_PREFIX") and "procfs" in last(maps1)   # readable, still refused
    assert "OK invoke=LIST agents=0" in listing


def test_a_user_may_load_their_own_private_model_by_descriptor(daemon, files):
    (reply, listing) = as_user(VICTIM, daemon, ("REGISTER own @fd n_ctx=256", [files["own_model"]]),
                               "DECODE own 2 Hello")
    assert last(reply) == "OK done", reply                # the sandbox, as the victim, could read it
    assert fields(listing)["generated_tokens"] != "0"
    (gone,) = as_user(VICTIM, daemon, "UNREGISTER own")
    assert last(gone) == "OK done"


# ---- 3, 6: crafted files cost a sandboxed child, never the daemon ---------------------------
def test_crafted_ggufs_fail_in_the_sandbox_and_the_daemon_goes_on(daemon, files):
    with daemon.client() as c:
        c.register("witness", "smollm2-135m", n_ctx=256)
        rss_before = rss_kib(daemon.proc.pid)
        t0 = time.monotonic()
        assert_layers, zeros = as_user(MALLORY, daemon, ("REGISTER x @fd", [files["bad"]]),
                                       ("REGISTER y @fd", [files["zeros"]]))
        took = time.monotonic() - t0
        assert last(assert_layers).startswith("ERR MODEL_LOAD_FAILED") and "signal=SIGABRT" in last(assert_layers)
        assert "n_layer" in last(assert_layers)
        assert last(zeros).startswith("ERR MODEL_LOAD_FAILED"), zeros
        assert took < 60
        assert daemon.proc.poll() is None
        assert rss_kib(daemon.proc.pid) - rss_before < 64 * 1024     # nothing was copied or parsed here
        assert int(c.decode("witness", 2, "Still here?")["fields"]["generated_tokens"]) >= 1
        c.unregister("witness")


@pytest.mark.slow
def test_a_huge_vocabulary_is_bounded_by_the_sandbox(daemon, tmp):
    import gguf
    path = tmp / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in ((w.add_block_count, 2), (w.add_embedding_length, 64), (w.add_head_count, 2),
                       (w.add_context_length, 64), (w.add_feed_forward_length, 64),
                       (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    w.add_tokenizer_model("llama")
    w.add_token_list([""] * 300_000)             # more than Gemma 3's 262k: gguf-py took 17 s on that
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.chmod(path, 0o644)
    rss_before = rss_kib(daemon.proc.pid)
    (reply,) = as_user(MALLORY, daemon, ("REGISTER v @fd", [path]))
    assert last(reply).startswith("ERR MODEL_LOAD_FAILED"), reply
    assert rss_kib(daemon.proc.pid) - rss_before < 64 * 1024


# ---- 2: names are per user, looked up when used ---------------------------------------------
def test_agent_names_are_per_user_and_never_cross(daemon, files):
    doc = files["doc"]
    (reg,) = as_user(VICTIM, daemon, ("REGISTER x smollm2-135m n_ctx=1024 prefix=@fd", [doc]))
    assert last(reg) == "OK done", reg
    reg_m, dec_m, unknown, listing = as_user(MALLORY, daemon, "REGISTER x smollm2-135m n_ctx=512",
                                             "DECODE x 3 Hello", "DECODE nobody-has-this 3 hi", "LIST")
    assert last(reg_m) == "OK done"                              # the same name, another user
    assert fields(dec_m)["generated_tokens"] != "0"
    assert "agent_id=x" in listing[2] and "prefix=-" in listing[2]  # Mallory's own x, not the victim's
    (victim_list,) = as_user(VICTIM, daemon, "LIST")
    assert fields(victim_list)["tokens"] == "0"                  # untouched: never decoded
    (unreg,) = as_user(MALLORY, daemon, "UNREGISTER x")
    assert last(unreg) == "OK done"
    (victim_dec,) = as_user(VICTIM, daemon, "DECODE x 2 Who may use it?")
    assert last(victim_dec) == "OK done"
    (other,) = as_user(MALLORY, daemon, "DECODE x 2 hi")
    assert last(other) == last(unknown).replace("nobody-has-this", "x")   # gone for Mallory only
    as_user(VICTIM, daemon, "UNREGISTER x")


@pytest.mark.slow
def test_a_queued_decode_runs_in_its_owners_agent_only(daemon):
    """The race of finding 2: a DECODE waits in the queue while the name is re-registered
    by someone else; when its turn comes it looks up its owner's agent, not the name. (x is
    of another model than busy, so it waits for busy's batch instead of joining it.)"""
    with daemon.client() as c:
        c.register("busy", "smollm2-135m", n_ctx=512)
        c.register("x", "gemma3-270m", n_ctx=256)
    long_run, queued = queue_behind(daemon, b"DECODE busy 200 Count: 1, 2, 3,", b"DECODE x 4 Hello")
    (reg,) = as_user(MALLORY, daemon, "REGISTER x smollm2-135m n_ctx=256")
    assert last(reg) == "OK done"
    queued.settimeout(300)
    assert read_reply(queued.makefile("rb"))[-1] == "OK done"                 # it ran, in the operator's x
    (listing,) = as_user(MALLORY, daemon, "LIST")
    assert fields(listing)["tokens"] == "0"                     # Mallory's x saw nothing
    long_run.close()
    queued.close()
    with daemon.client() as c:
        assert int(next(a for a in c.list() if a["agent_id"] == "x" and a["owner"] == "0")["tokens"]) > 0
        c.unregister("busy")
        c.unregister("x")
    as_user(MALLORY, daemon, "UNREGISTER x")


# ---- 7: nothing in a reply tells one user about another's documents or agents -----------------
@pytest.mark.slow
def test_replies_carry_no_other_users_facts(daemon, files):
    doc = files["doc"]
    (reg_v, dec_v) = as_user(VICTIM, daemon, ("REGISTER v smollm2-135m n_ctx=1024 prefix=@fd", [doc]),
                             "DECODE v 2 Summarise.")
    assert last(dec_v) == "OK done"
    reg_m, dec_m, status = as_user(MALLORY, daemon, ("REGISTER m smollm2-135m n_ctx=1024 prefix=@fd", [doc]),
                                   "DECODE m 2 Summarise.", "STATUS")
    f = fields(reg_m)
    assert f["prefix_agents"] == "1" and f["model_refcount"] == "1" and f["shared_weights"] == "false"
    d = fields(dec_m)
    assert d["kv_swap_restored"] == "false"                     # its own prefill, not the victim's copy
    assert d["kv_swap_evicted"] in ("another-user", "-")        # never the victim's agent id
    assert not any(line.startswith("OK model ") for line in status)
    assert [line for line in status if line.startswith("OK prefix ")] and all(
        f"key={MALLORY}:" in line for line in status if line.startswith("OK prefix "))
    assert fields(status)["agents"] == "1" and fields(status)["uid"] == str(MALLORY)
    as_user(VICTIM, daemon, "UNREGISTER v")
    as_user(MALLORY, daemon, "UNREGISTER m")


# ---- 5: per-user quotas and fair turns ---------------------------------------------------------
def own_tmp(tmp: Path, name: str) -> Path:
    folder = tmp / name
    folder.mkdir()
    os.chmod(folder, 0o755)
    return folder


def test_connection_and_ledger_share_quotas(tmp):
    with Daemon(own_tmp(tmp, "q"), "--allow-uid", str(MALLORY), "--max-clients-per-uid", "3",
                "--uid-ledger-percent", "0.1") as d:
        hold = r"""
import socket, sys, time
socks = []
for i in range(4):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); socks.append(s)
s = socks[-1]; s.settimeout(10)
print(s.recv(200).decode().strip(), flush=True)
"""
        import subprocess
        out = subprocess.run([SYSTEM_PYTHON, "-c", hold, str(d.path)], capture_output=True, text=True,
                             timeout=60, preexec_fn=become(MALLORY)).stdout
        assert out.startswith(f"ERR BUSY uid {MALLORY} has 3 connections"), out
        (share,) = as_user(MALLORY, d, "REGISTER a smollm2-135m n_ctx=256")
        assert last(share).startswith("ERR VRAM_LEDGER_DENY code=USER_SHARE"), share
        with d.client() as c:                                    # the operator is not limited
            for i in range(3):
                c.register(f"op{i}", "smollm2-135m", n_ctx=256)


def test_agent_count_quota(tmp):
    with Daemon(own_tmp(tmp, "n"), "--allow-uid", str(MALLORY), "--max-agents-per-uid", "2") as d:
        replies = as_user(MALLORY, d, *[f"REGISTER a{i} smollm2-135m n_ctx=256" for i in range(3)])
        assert [last(r) for r in replies[:2]] == ["OK done", "OK done"]
        assert last(replies[2]).startswith(f"ERR QUOTA uid {MALLORY} has 2 agents")


def test_a_swap_hog_cannot_block_another_users_decode(tmp):
    with Daemon(own_tmp(tmp, "s"), "--allow-uid", str(MALLORY), "--allow-uid", str(VICTIM),
                "--uid-swap-percent", "0.000001") as d:    # no user's share holds one snapshot
        m = as_user(MALLORY, d, "REGISTER h1 smollm2-135m n_ctx=256", "REGISTER h2 smollm2-135m n_ctx=256",
                    "DECODE h1 4 Once upon a time", "DECODE h2 4 Hello")
        assert last(m[2]) == last(m[3]) == "OK done"         # a full share slows, never refuses
        tokens_before = int(fields([line for line in as_user(MALLORY, d, "LIST")[0]
                                    if "agent_id=h1" in line])["tokens"])
        v = as_user(VICTIM, d, "REGISTER v smollm2-135m n_ctx=256", "DECODE v 4 Hi there")
        assert last(v[1]) == "OK done", v[1]          # in a context of its own: nobody was paused
        (listing,) = as_user(MALLORY, d, "LIST")
        assert "state=active" in next(line for line in listing if "agent_id=h1" in line)
        (h3,) = as_user(MALLORY, d, "REGISTER h3 smollm2-135m n_ctx=256", "DECODE h3 4 More")[1:]
        assert last(h3) == "OK done", h3              # her pool reopened for h3: her agents paused
        (listing,) = as_user(MALLORY, d, "LIST")      # with no room in her swap share
        h1 = next(line for line in listing if "agent_id=h1" in line)
        assert "state=suspended" in h1 and "kv_host_bytes=0" in h1
        (again,) = as_user(MALLORY, d, "DECODE h1 3 and then")
        assert last(again) == "OK done"                      # its tokens were kept and re-read
        (after,) = as_user(MALLORY, d, "LIST")
        h1 = fields([line for line in after if "agent_id=h1" in line])
        assert int(h1["tokens"]) > tokens_before


def test_one_byte_at_a_time_does_not_defeat_the_idle_timeout(tmp):
    """One deadline for the whole line: a byte every 0.3 s for 6 s is cut off about 1 s
    after the line began, while the bytes still come. (A timeout re-armed at every byte
    would wait for the sender to stop, and answer only after the loop.)"""
    import select
    with Daemon(own_tmp(tmp, "i"), "--idle-timeout", "1") as d:
        s = d.raw_socket()
        t0, answered_at, reply = time.monotonic(), None, b""
        try:
            for ch in b"STATUS" * 4:
                s.sendall(bytes([ch]))
                if select.select([s], [], [], 0.3)[0]:
                    answered_at, reply = time.monotonic() - t0, s.recv(200)
                    break
        except OSError:
            answered_at = time.monotonic() - t0
        if not reply:
            s.settimeout(10)
            reply = s.recv(200)
        assert reply.startswith(b"ERR IDLE_TIMEOUT no complete request line within 1 s"), reply
        assert answered_at is not None and answered_at < 3.0, answered_at    # the bytes had 3 s more to go


@pytest.mark.slow
def test_turns_go_round_robin_and_a_long_decode_yields(tmp, files):
    """Mallory runs two long DECODEs in one batch; the victim's short one (another pool),
    sent after them, finishes while both are still running (Mallory's batch gives the
    device up after a slice), and a DECODE that gave way, batched, gives the tokens it
    gives alone (exact mode: prefix agents)."""
    doc = files["doc"]
    with Daemon(own_tmp(tmp, "r"), "--allow-uid", str(MALLORY), "--allow-uid", str(VICTIM)) as d:
        setup = [("REGISTER solo smollm2-135m n_ctx=1024 prefix=@fd", [doc]), "DECODE solo 96 List every right:"]
        for i in range(2):
            setup.append((f"REGISTER m{i} smollm2-135m n_ctx=1024 prefix=@fd", [doc]))
        alone = as_user(MALLORY, d, *setup)[1]
        assert last(alone) == "OK done"
        done: dict[str, float] = {}
        texts: dict[str, list[str]] = {}

        def mallory(i):
            texts[f"m{i}"] = as_user(MALLORY, d, f"DECODE m{i} 96 List every right:")[0]
            done[f"m{i}"] = time.monotonic()
        threads = [threading.Thread(target=mallory, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        eventually(lambda: len(d.client().status()["fields"]["decoding"].split(",")) == 2,
                   what="Mallory's two DECODEs in one batch")
        v = as_user(VICTIM, d, "REGISTER v smollm2-135m n_ctx=256", "DECODE v 8 Hello")
        done["victim"] = time.monotonic()
        for t in threads:
            t.join(timeout=400)
        assert last(v[1]) == "OK done"
        assert done["victim"] < min(done[f"m{i}"] for i in range(2)), done
        body = lambda r: r[r.index("BEGIN_RESPONSE"):]    # noqa: E731
        for i in range(2):
            assert body(texts[f"m{i}"]) == body(alone), i


# ---- 10: stopping ------------------------------------------------------------------------------
def test_sigterm_cancels_the_queue_and_bounds_the_running_decode(tmp):
    d = Daemon(own_tmp(tmp, "t"), "--shutdown-grace", "1")
    with d.client() as c:
        c.register("a", "smollm2-135m", n_ctx=4200)
        c.register("b", "gemma3-270m", n_ctx=256)      # another model: it waits for a's batch
    running, queued = queue_behind(d, b"DECODE a 4000 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", b"DECODE b 10 Hello")
    t0 = time.monotonic()
    d.proc.terminate()
    queued.settimeout(30)
    running.settimeout(30)
    assert queued.makefile("rb").read().decode().startswith("ERR CANCELLED")
    assert running.makefile("rb").read().decode().startswith("ERR CANCELLED agent a: the daemon is stopping")
    assert d.proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 15
    assert not d.path.exists()


def test_stop_leaves_a_socket_path_another_daemon_took(tmp):
    d = Daemon(own_tmp(tmp, "u"))
    d.path.unlink()                                  # someone else's socket now lives there
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(d.path))
    try:
        assert d.stop() == 0
        assert d.path.exists() and "no longer ours" in d.logs()
    finally:
        other.close()


def nobody_can_run_the_daemon() -> bool:
    import subprocess
    import sys
    try:
        probe = subprocess.run([sys.executable, "-c", "import swarmkv_ffi.library as l; l.backend()"],
                               capture_output=True, preexec_fn=become(MALLORY))
    except OSError:                      # e.g. a python under a 0700 /root
        return False
    return probe.returncode == 0


def test_a_descriptor_this_process_may_not_reopen_is_loaded_from_a_sealed_copy(files):
    """What a daemon that is not root meets (the next test, where this machine allows):
    a client's 0600 file, readable through the descriptor, refused through its path."""
    from swarmkv_ffi.conductor.modelfile import LoadableCopy, OpenModel, fd_path, reopenable
    src = files["own_model"]
    with OpenModel(src) as (mf, fd):
        pid = os.fork()
        if pid == 0:                                  # a process of another uid holding the descriptor
            code = 1
            try:
                become(MALLORY)()
                assert not reopenable(fd)
                with LoadableCopy(mf, fd) as copy:
                    assert copy != fd and reopenable(copy)
                    with open(fd_path(copy), "rb") as f:
                        assert f.read(1 << 20) == os.pread(fd, 1 << 20, 0)
                    assert os.fstat(copy).st_size == mf.identity[2]
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0


def test_a_daemon_that_is_not_root_loads_a_users_private_model_it_cannot_open(tmp, files):
    """The recommended set-up: the daemon runs as its own user. A client's 0600 model
    arrives as a descriptor the daemon may read but not reopen by path (libllama's way):
    it is loaded from a sealed in-memory copy."""
    if not nobody_can_run_the_daemon():
        if os.environ.get("SWARMKV_REQUIRE_NONROOT"):      # .ci/run sets it with a readable install
            pytest.fail("SWARMKV_REQUIRE_NONROOT is set, yet uid 65534 cannot import this install")
        pytest.skip("this package's install is not readable by uid 65534 (.ci/run runs it from one that is)")
    folder = own_tmp(tmp, "nonroot")
    os.chown(folder, MALLORY, MALLORY)
    d = Daemon(folder, "--allow-uid", str(VICTIM), preexec_fn=become(MALLORY))
    try:
        reg, dec = as_user(VICTIM, d, ("REGISTER own @fd n_ctx=256", [files["own_model"]]), "DECODE own 3 Hello")
        assert last(reg) == "OK done", reg
        assert int(fields(dec)["generated_tokens"]) >= 1
    finally:
        d.stop()


def test_models_dir_names_are_files_inside_it_only(tmp, files):
    models = own_tmp(tmp, "models")
    shutil.copy(catalog.resolve("smollm2-135m"), models / "smol.gguf")
    os.chmod(models / "smol.gguf", 0o644)
    with Daemon(own_tmp(tmp, "md"), "--allow-uid", str(MALLORY), "--models-dir", str(models)) as d:
        ok, escape, absolute = as_user(MALLORY, d, "REGISTER m smol.gguf n_ctx=256",
                                       "REGISTER e ../victim-home/mine.gguf n_ctx=256",
                                       f"REGISTER a {files['own_model']} n_ctx=256")
        assert last(ok) == "OK done", ok
        assert last(escape).startswith("ERR UNKNOWN_MODEL") and last(absolute).startswith("ERR UNKNOWN_MODEL")
    os.chmod(models, 0o777)
    import subprocess
    import sys
    bad = subprocess.run([sys.executable, "-m", "swarmkv_ffi.lmxd", "--socket", str(tmp / "x.sock"),
                          "--models-dir", str(models)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "writable by others" in bad.stderr
