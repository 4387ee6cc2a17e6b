"""A fault in a store never costs an answer (issue 33), with real faults (filesystems.py):
a full tmpfs, a read-only mount, a file size limit, a writer killed mid-write, corrupt
entries. The prefix cache is optional: its faults are one warning and the run goes on
with the same answers; a requested output (--snapshot-out, stdout) that cannot be
written is one error line and exit code 2 after the answers, with nothing at its path."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import swarmkv
from corpus import DOC, LICENCE
from filesystems import file_size_limit, fill, read_only, tmpfs
from swarmkv_ffi.fanout import BranchSpec, run_fanout
from swarmkv_ffi.kvcache.files import KEY, STALE, TEMPORARY, PrefixCache
from swarmkv_ffi.snapshot import Snapshot

QUESTION = [BranchSpec("Can I sell copies?", max_tokens=8)]


def answers(result) -> list[list[int]]:
    assert [b.index for b in result.branches] == [0] and result.branches[0].token_ids
    return [b.token_ids for b in result.branches]


def cache_files(folder: Path) -> list[str]:
    """What a cache folder holds besides its lock: entries and temporary files."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


@pytest.fixture(scope="module")
def cold(smol):
    """The answers of a run without a cache: what every faulty run must still give."""
    return answers(run_fanout(smol, DOC, QUESTION, cache=None))


# ---- the Python API --------------------------------------------------------------------------
def test_a_full_disk_costs_no_answer_and_a_later_run_stores(smol, cold, tmp_path, caplog):
    with tmpfs(tmp_path / "fs", "24m") as fs:
        filler = fill(fs, 1 << 20)                        # a 6 MiB snapshot does not fit
        cache = PrefixCache(fs / "cache")
        full = run_fanout(smol, DOC, QUESTION, cache=cache)
        assert answers(full) == cold
        assert "ENOSPC" in full.cache_warning and "answers are unaffected" in full.cache_warning
        assert caplog.text.count("prefix cache: not stored") == 1
        assert cache_files(fs / "cache") == []            # no entry, no half file
        filler.unlink()                                   # space again: the next run stores
        stored = run_fanout(smol, DOC, QUESTION, cache=cache)
        assert stored.cache_warning is None and answers(stored) == cold
        warm = run_fanout(smol, DOC, QUESTION, cache=cache)
        assert warm.prefill_skipped and answers(warm) == cold


def test_a_read_only_cache_still_restores_and_stores_nothing(smol, cold, tmp_path):
    cache = PrefixCache(tmp_path / "cache")
    run_fanout(smol, DOC, QUESTION, cache=cache)
    before = cache_files(cache.root)
    other_doc = LICENCE[2000:3400]
    with read_only(cache.root):
        warm = run_fanout(smol, DOC, QUESTION, cache=cache)
        assert warm.prefill_skipped and warm.cache_warning is None and answers(warm) == cold
        other = run_fanout(smol, other_doc, QUESTION, cache=cache)
        assert other.cache_warning and ("EROFS" in other.cache_warning or "EACCES" in other.cache_warning)
        assert answers(other) == answers(run_fanout(smol, other_doc, QUESTION, cache=None))
        assert cache_files(cache.root) == before


def test_a_cache_folder_that_cannot_be_made_turns_the_cache_off(smol, cold, tmp_path, monkeypatch, caplog):
    (tmp_path / "home").mkdir()
    with read_only(tmp_path / "home"):
        monkeypatch.setenv("SWARMKV_PREFIX_CACHE", str(tmp_path / "home" / "cache"))
        result = run_fanout(smol, DOC, QUESTION)            # cache=True: the default folder
    assert answers(result) == cold and result.cached_tokens == 0
    assert "prefix cache off: cannot use" in caplog.text
    assert not (tmp_path / "home" / "cache").exists()


WRITER = """
import sys, numpy as np
from swarmkv_ffi.kvcache.files import PrefixCache
from swarmkv_ffi.snapshot import Snapshot, SnapshotHeader, checksum, tokens_hash
cache = PrefixCache(sys.argv[1])
for seed in range(1000):
    tokens = list(range(seed, seed + 8))
    data = np.full(48 << 20, seed % 251, dtype=np.uint8)
    header = SnapshotHeader("f" * 32, "fake.gguf", "x", {}, 8, tokens_hash(tokens), tokens,
                            data.nbytes, checksum(data))
    cache.store(Snapshot(header, data), {})
"""


def test_a_writer_killed_mid_write_leaves_no_half_entry(tmp_path):
    """SIGKILL while a temporary file is being written (seen in the folder): every entry
    the cache shows loads whole; the dead writer's temporary file is swept by a later
    store once it is STALE seconds old."""
    folder = tmp_path / "cache"
    PrefixCache(folder)
    killed_mid_write = 0
    def temporary() -> set[str]:
        return {p.name for p in folder.iterdir() if TEMPORARY.match(p.name)}
    for _ in range(3):
        left = temporary()
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)])
        deadline = time.monotonic() + 60
        while not temporary() - left and time.monotonic() < deadline:
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        killed_mid_write += bool(temporary() - left)
    assert killed_mid_write, "no kill landed while a temporary file was being written"
    cache = PrefixCache(folder)
    for entry in cache.entries():
        assert Snapshot.load(folder / f"{entry.key}.snap").header.n_tokens == entry.n_tokens
    for snap in folder.glob("*.snap"):                     # a renamed file is complete, sidecar or not
        assert KEY.match(snap.stem) and Snapshot.load(snap)
    old = time.time() - STALE - 1
    for p in folder.iterdir():
        if TEMPORARY.match(p.name):
            os.utime(p, (old, old))
    from fakes import fake_snapshot
    cache.store(fake_snapshot(4, 2000, 9999), {})
    assert not [p for p in folder.iterdir() if TEMPORARY.match(p.name)]


# ---- the command line ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(DOC)
    return path


FANOUT = ("fanout", "--ask", "Can I sell copies?", "--max-tokens", "8")


def run_cli(*args: str, preexec_fn=None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn, timeout=600)


def answer_lines(stdout: str) -> list[str]:
    lines = [line for line in stdout.splitlines() if line.strip().startswith("A:")]
    assert lines, f"no answers printed:\n{stdout}"
    return lines


@pytest.fixture(scope="module")
def cli_cold(doc_file):
    return answer_lines(swarmkv(*FANOUT, "--doc", str(doc_file), "--no-cache").stdout)


@pytest.mark.slow
def test_cli_a_cache_write_past_a_file_size_limit_is_one_warning(doc_file, cli_cold, tmp_path):
    cache = tmp_path / "cache"
    proc = run_cli(*FANOUT, "--doc", str(doc_file), "--cache-dir", str(cache),
                   preexec_fn=file_size_limit(1 << 20))
    assert proc.returncode == 0, proc.stderr
    assert answer_lines(proc.stdout) == cli_cold
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("swarmkv: warning:")]
    assert len(warnings) == 1 and "EFBIG" in warnings[0] and "answers are unaffected" in warnings[0], proc.stderr
    assert cache_files(cache) == []


@pytest.mark.slow
def test_cli_snapshot_out_past_a_file_size_limit_prints_the_answers_then_one_error(doc_file, cli_cold, tmp_path):
    out = tmp_path / "out" / "doc.snap"
    proc = run_cli(*FANOUT, "--doc", str(doc_file), "--no-cache", "--snapshot-out", str(out),
                   preexec_fn=file_size_limit(1 << 20))
    assert proc.returncode == 2
    assert answer_lines(proc.stdout) == cli_cold
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("swarmkv: error: --snapshot-out not written: "), proc.stderr
    assert str(out) in error[0] and "EFBIG" in error[0]
    assert list(out.parent.iterdir()) == []                # nothing at the path, no temporary file


def test_cli_snapshot_out_to_a_read_only_folder_fails_before_any_work(doc_file, tmp_path):
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        proc = run_cli(*FANOUT, "--doc", str(doc_file), "--no-cache", "--snapshot-out", str(tmp_path / "ro" / "s"))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ("EROFS" in lines[0] or "EACCES" in lines[0]), proc.stderr
    assert list((tmp_path / "ro").iterdir()) == []


@pytest.mark.slow
def test_cli_snapshot_out_to_a_full_disk_says_so_when_the_size_is_known(doc_file, cli_cold, tmp_path):
    with tmpfs(tmp_path / "fs", "8m") as fs:
        fill(fs, 1 << 20)
        proc = run_cli(*FANOUT, "--doc", str(doc_file), "--no-cache", "--snapshot-out", str(fs / "s.snap"))
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]
    assert proc.returncode == 2 and answer_lines(proc.stdout) == cli_cold
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("swarmkv: warning: --snapshot-out will not fit:") and "ENOSPC" in lines[0]
    assert lines[1].startswith("swarmkv: error: --snapshot-out not written:") and "ENOSPC" in lines[1]
    assert "MiB to write" in lines[1]                   # refused before writing, not found full midway


@pytest.mark.slow
def test_cli_json_to_a_full_stdout_goes_to_stderr_with_one_error(doc_file, cli_cold):
    with open("/dev/full", "w") as full:
        proc = run_cli(*FANOUT, "--doc", str(doc_file), "--no-cache", "--json", stdout=full)
    assert proc.returncode == 2
    *document, error = proc.stderr.strip().splitlines()
    assert error == ("swarmkv: error: cannot write standard output: No space left on device (ENOSPC); "
                     "the output went to standard error instead")
    result = json.loads("\n".join(document))
    assert f"A: {result['branches'][0]['text'].strip()}" == cli_cold[0].strip()


@pytest.mark.slow
def test_cli_corrupt_cache_entries_are_dropped_with_one_notice_each(doc_file, cli_cold, tmp_path):
    cache = tmp_path / "cache"
    swarmkv(*FANOUT, "--doc", str(doc_file), "--cache-dir", str(cache))
    snaps = sorted(cache.glob("*.snap"))
    assert len(snaps) == 2
    raw = snaps[0].read_bytes()                           # one snapshot with a bit flipped,
    snaps[0].write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    sidecar = snaps[1].with_suffix(".json")               # the other's sidecar truncated
    sidecar.write_bytes(sidecar.read_bytes()[:40])
    proc = run_cli(*FANOUT, "--doc", str(doc_file), "--cache-dir", str(cache))
    assert proc.returncode == 0 and answer_lines(proc.stdout) == cli_cold
    notices = proc.stderr.strip().splitlines()
    assert len(notices) == 2, proc.stderr
    assert any(snaps[0].stem in n and "checksum" in n for n in notices)
    assert any(sidecar.name in n and "dropping bad sidecar" in n for n in notices)
    assert "prefilled once" in proc.stdout                # neither was used
    assert "prefill skipped" in run_cli(*FANOUT, "--doc", str(doc_file), "--cache-dir",
                                        str(cache)).stdout                       # stored again


def test_cli_errors_are_one_line_and_a_traceback_only_with_v(tmp_path):
    quiet = run_cli("cache", "stats", "--cache-dir", "/dev/null/cache")
    assert quiet.returncode == 2
    assert quiet.stderr == "swarmkv: error: /dev/null/cache: Not a directory (ENOTDIR)\n"
    loud = run_cli("-v", "cache", "stats", "--cache-dir", "/dev/null/cache")
    assert loud.returncode == 2 and "Traceback" in loud.stderr
    assert loud.stderr.endswith("swarmkv: error: /dev/null/cache: Not a directory (ENOTDIR)\n")


# ---- the server and lmxd's HTTP front --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("front", ["serve", "lmxd"])
def test_a_full_cache_disk_never_fails_a_request(front, tmp_path):
    """--cache-dir / --http-cache-dir on a full disk: the prefix two requests share is not
    stored (one warning in the log), every request is answered as it is with space, and
    once there is space the next shared prefix is stored."""
    from openai import OpenAI

    from corpus import APACHE
    from lmxd_daemon import Daemon
    from serve_process import Serve, ask, chat
    from swarmkv_ffi.bench.peer import free_port
    with tmpfs(tmp_path / "fs", "48m") as fs:
        cache = fs / "cache"
        filler = fill(fs, 1 << 20)
        if front == "serve":
            server = Serve("--exact", "--ctx-size", "4096", "--parallel", "8", "--cache-dir", str(cache),
                           log=tmp_path / "serve.log")
            url, logs = server.url, lambda: (tmp_path / "serve.log").read_text()
        else:
            port = free_port()
            server = Daemon(tmp_path, "--http", f"127.0.0.1:{port}", "--http-ctx-size", "4096",
                            "--http-exact", "--http-cache-dir", str(cache))
            url, logs = f"http://127.0.0.1:{port}", server.logs
        with server:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            full_doc = "Full disk.\n" + APACHE[:2400]
            ask(client, chat(full_doc, "Who may use the work?"))
            shared = ask(client, chat(full_doc, "Is there a warranty?"))     # forks the document
            assert shared.usage.prompt_tokens_details.cached_tokens > 400
            wait_for(lambda: "prefix cache: not stored" in logs(), logs)
            assert logs().count("prefix cache: not stored") == 1 and "ENOSPC" in logs()
            assert not list(cache.glob("*.snap"))
            filler.unlink()
            again = ask(client, chat(full_doc, "Is there a warranty?"))
            assert again.choices[0].message.content == shared.choices[0].message.content
            spare_doc = "Spare disk.\n" + APACHE[:2400]
            ask(client, chat(spare_doc, "Who may use the work?"))
            ask(client, chat(spare_doc, "Is there a warranty?"))
            wait_for(lambda: list(cache.glob("*.snap")), logs)
        assert "Traceback" not in logs()


def wait_for(check, logs, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, logs()
        time.sleep(0.05)
