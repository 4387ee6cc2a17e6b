"""The prefix cache: a second run over a document restores instead of prefilling, an
extended document restores the longest shared start, answers equal a cold run's bit for
bit, bad entries are dropped and recomputed, LRU eviction holds the size limit, and
several processes can share one folder."""
from __future__ import annotations

import json
import multiprocessing
import os

import numpy as np
import pytest

from commands import swarmkv as run_swarmkv

from corpus import LICENCE
from fakes import fake_snapshot
from swarmkv_ffi.fanout import BranchSpec, run_fanout
from swarmkv_ffi.kvcache.files import TAIL, CacheFolderError, PrefixCache
from swarmkv_ffi.snapshot import SnapshotHeader, checksum

DOC = LICENCE[:2400]
QUESTIONS = [BranchSpec("Can I sell copies?", max_tokens=8), BranchSpec("What is a Contribution?", max_tokens=8)]


def answers(result, n: int = len(QUESTIONS)):
    """The branches' tokens, after checking all n questions came back answered."""
    assert sorted(b.index for b in result.branches) == list(range(n)), "branches went missing"
    assert all(b.token_ids for b in result.branches), "a branch answered nothing"
    return [b.token_ids for b in result.branches]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "copy"])
def test_second_run_restores_and_answers_the_same(smol, tmp_path, mode):
    cache = PrefixCache(tmp_path / "c", boundary=128)
    cold = run_fanout(smol, DOC, QUESTIONS, mode=mode, n_batch=128, cache=cache)
    assert cold.cached_tokens == 0 and cold.prefill_ms > 0
    keys = {e.n_tokens for e in cache.entries()}
    assert cold.n_prefix in keys and 256 in keys           # whole prefix and a boundary
    warm = run_fanout(smol, DOC, QUESTIONS, mode=mode, n_batch=128, cache=cache)
    assert warm.prefill_skipped and warm.cached_tokens == warm.n_prefix and warm.prefill_ms == 0
    nocache = run_fanout(smol, DOC, QUESTIONS, mode=mode, n_batch=128, cache=False)
    assert answers(warm) == answers(cold) == answers(nocache)


@pytest.mark.slow
def test_extended_document_restores_the_longest_shared_start(smol, tmp_path):
    """The restored start was chunked as the short document was, the cold run chunks the
    long one its own way: only exact mode (chunking-independent) promises equal answers."""
    cache = PrefixCache(tmp_path / "c", boundary=128)
    short = run_fanout(smol, DOC[:2000], QUESTIONS, n_batch=128, cache=cache, exact=True)
    longer = run_fanout(smol, DOC[:2000] + DOC[2000:2400], QUESTIONS, n_batch=128, cache=cache, exact=True)
    assert 0 < longer.cached_tokens < longer.n_prefix
    assert longer.cached_tokens == short.n_prefix - TAIL   # all of the old document but its tail
    cold = run_fanout(smol, DOC[:2000] + DOC[2000:2400], QUESTIONS, n_batch=128, cache=False, exact=True)
    assert answers(longer) == answers(cold)


@pytest.mark.slow
def test_settings_that_change_the_kv_bytes_miss(smol, tmp_path):
    cache = PrefixCache(tmp_path / "c", boundary=128)
    run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=128, cache=cache)
    other_kv = run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=128, kv_type="q8_0", cache=cache)
    other_chunks = run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=64, cache=cache)
    assert other_kv.cached_tokens == 0 and other_chunks.cached_tokens == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_corrupt_entry_is_dropped_and_recomputed(smol, tmp_path, damage, caplog):
    cache = PrefixCache(tmp_path / "c", boundary=128)
    cold = run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=128, cache=cache)
    for path in (tmp_path / "c").glob("*.snap"):
        raw = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(raw[: len(raw) // 2])
        elif damage == "flip":
            path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 0xFF]) + raw[-99:])
        else:
            path.write_bytes(b"not a snapshot at all")
    again = run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=128, cache=cache)
    assert again.cached_tokens == 0 and answers(again, 1) == answers(cold, 1)
    assert "dropping bad entry" in caplog.text
    third = run_fanout(smol, DOC[:1200], QUESTIONS[:1], n_batch=128, cache=cache)
    assert third.prefill_skipped                               # recomputed and stored again


def test_lru_eviction_holds_the_size_limit(tmp_path):
    cache = PrefixCache(tmp_path, max_bytes=10_000)
    keys = [cache.store(fake_snapshot(4, 2000, i), {}) for i in range(3)]
    assert cache.lookup("f" * 32, {}, list(range(1, 5))) is not None   # entry 1 is used now
    for i in (3, 4):                                            # ~2.3 kB each: the 5th is one too many
        cache.store(fake_snapshot(4, 2000, i), {})
        assert cache.total_bytes() <= 10_000
    left = {e.key for e in cache.entries()}
    assert keys[0] not in left and {keys[1], keys[2]} <= left
    cache.store(fake_snapshot(4, 2000, 5), {})
    left = {e.key for e in cache.entries()}
    assert keys[2] not in left and keys[1] in left              # 1 was used after 2 was stored


@pytest.mark.unit
def test_a_full_folder_evicts_from_the_owner_holding_the_most(tmp_path):
    """Issue 63: the disk tier evicted least recently used across all keys, so one key
    storing fast pushed every other key's prefixes out. Key B's one entry, the oldest,
    stays; key A, holding the most, loses its own oldest."""
    cache = PrefixCache(tmp_path, max_bytes=10_000)
    b = cache.store(fake_snapshot(4, 2000, 0), {"owner": "b"})
    a = [cache.store(fake_snapshot(4, 2000, i), {"owner": "a"}) for i in range(1, 5)]
    left = {e.key for e in cache.entries()}
    assert cache.total_bytes() <= 10_000
    assert b in left and a[0] not in left and set(a[1:]) <= left
    assert {e.owner for e in cache.entries()} == {"a", "b"}


LIMIT = 600_000   # ~170 of the 1,000 entries fit


def _writer(root: str, worker: int, n: int, out) -> None:
    """Store n entries of its own (1,000 distinct in all) and read its and the others'
    recent ones; count reads that return anything but the asked-for entry, intact."""
    cache = PrefixCache(root, max_bytes=LIMIT)
    bad = hits = 0
    for i in range(n):
        seed = worker * n + i
        cache.store(fake_snapshot(8, 3000 + seed % 500, seed), {})
        want = ((worker + i) % 4) * n + max(0, i - (i * 7) % 40)
        got = cache.lookup("f" * 32, {}, list(range(want, want + 8)))
        if got is not None:
            hits += 1
            if got.tokens.tolist() != list(range(want, want + 8)) or got.data.nbytes != 3000 + want % 500 \
                    or not np.all(got.data == want % 251):
                bad += 1
    out.put((bad, hits))


@pytest.mark.slow
def test_four_processes_share_one_folder_without_corrupt_reads(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 250, out)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs)
    results = [out.get(timeout=10) for _ in procs]
    assert sum(bad for bad, _ in results) == 0
    assert sum(hits for _, hits in results) > 100             # reads did find entries
    cache = PrefixCache(tmp_path, max_bytes=LIMIT)
    assert cache.total_bytes() <= LIMIT                       # eviction runs under the lock on every store
    assert 100 < len(cache.entries()) < 1000
    assert not list(tmp_path.glob(".*.snap.*"))               # no temporary files left


@pytest.mark.slow
def test_cli_cache_commands(smol, tmp_path):
    env = {**os.environ, "SWARMKV_PREFIX_CACHE": str(tmp_path / "c")}
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC[:1200])

    def swarmkv(*args):
        return run_swarmkv(*args, check=False, env=env)
    first = swarmkv("fanout", "--doc", str(doc), "--ask", "Who?", "--max-tokens", "4", "--json")
    assert first.returncode == 0, first.stderr
    second = swarmkv("fanout", "--doc", str(doc), "--ask", "Who?", "--max-tokens", "4")
    assert "prefill skipped" in second.stdout
    listing = json.loads(swarmkv("cache", "ls", "--json").stdout)
    assert listing["entries"] and "Apache" in listing["entries"][0]["head"]
    key = listing["entries"][0]["key"]
    assert swarmkv("cache", "rm", key).returncode == 0
    assert swarmkv("cache", "rm", key).returncode == 1
    assert "entries" in swarmkv("cache", "stats").stdout
    assert swarmkv("cache", "clear").returncode == 0
    assert json.loads(swarmkv("cache", "stats", "--json").stdout)["entries"] == 0
    nocache = swarmkv("fanout", "--doc", str(doc), "--ask", "Who?", "--max-tokens", "4", "--no-cache")
    assert "prefilled once" in nocache.stdout
    assert json.loads(swarmkv("cache", "stats", "--json").stdout)["entries"] == 0


# ---- a folder other users or processes may touch (issue 22, finding 8) ------------------------
FP, TOKENS = "f" * 32, list(range(1, 5))


def stored(tmp_path, **kw):
    cache = PrefixCache(tmp_path / "c", **kw)
    key = cache.store(fake_snapshot(4, 2000, 1), {}, head="the document's first words")
    return cache, key


def test_the_folder_is_private_and_its_files_are_too(tmp_path):
    cache, key = stored(tmp_path)
    assert oct(os.stat(cache.root).st_mode & 0o777) == "0o700"
    for path in cache.root.iterdir():
        assert path.stat().st_mode & 0o077 == 0, path      # the sidecar holds the document's head


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand the folder to another uid")
def test_a_folder_owned_by_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(CacheFolderError, match="belongs to uid 65534"):
        PrefixCache(folder)


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(CacheFolderError, match="writable by others"):
        PrefixCache(folder)


def test_a_planted_lock_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cache, _ = stored(tmp_path)
    (cache.root / ".lock").unlink()
    (cache.root / ".lock").symlink_to(victim)
    with pytest.raises(CacheFolderError, match="never followed"):
        cache.store(fake_snapshot(4, 2000, 2), {})
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("sidecar", ["types", "key-is-a-path", "huge", "fifo", "dev-zero"])
def test_bad_sidecars_are_misses_that_delete_only_their_entry(tmp_path, sidecar):
    outside = tmp_path / "outside.snap"
    outside.write_text("not the cache's")
    cache, key = stored(tmp_path)
    meta = cache.root / f"{key}.json"
    good = json.loads(meta.read_text())
    meta.unlink()
    if sidecar == "types":
        meta.write_text(json.dumps({**good, "n_tokens": "4"}))
    elif sidecar == "key-is-a-path":
        meta.write_text(json.dumps({**good, "key": "../outside"}))
    elif sidecar == "huge":
        meta.write_text(json.dumps({**good, "head": "x" * 10_000}))
    elif sidecar == "fifo":
        os.mkfifo(meta)
    else:
        meta.symlink_to("/dev/zero")
    assert cache.lookup(FP, {}, TOKENS) is None             # at once: nothing blocks or reads forever
    assert cache.entries() == [] and not (cache.root / f"{key}.snap").exists()
    assert outside.read_text() == "not the cache's"


def test_a_fifo_snapshot_is_a_miss_without_blocking(tmp_path):
    cache, key = stored(tmp_path)
    snap = cache.root / f"{key}.snap"
    snap.unlink()
    os.mkfifo(snap)
    assert cache.lookup(FP, {}, TOKENS) is None and not snap.exists()


def rewrite_payload(path) -> None:
    """What a writer without the key can do: change the KV bytes and fix the crc32."""
    from swarmkv_ffi.snapshot import Snapshot as S
    snap = S.load(path)
    snap.data[:] = 7
    snap.header = SnapshotHeader(**{**snap.header.__dict__, "checksum": checksum(snap.data)})
    snap.save(path)


def test_crc32_does_not_stop_a_writer_but_the_keyed_mac_does(tmp_path):
    cache, key = stored(tmp_path)
    rewrite_payload(cache.root / f"{key}.snap")
    assert cache.lookup(FP, {}, TOKENS).data[0] == 7         # unkeyed: crc32 only catches accidents
    keyed = PrefixCache(tmp_path / "k", keyed=True)
    key = keyed.store(fake_snapshot(4, 2000, 1), {})
    assert keyed.lookup(FP, {}, TOKENS) is not None
    assert oct(os.stat(keyed.root / ".key").st_mode & 0o777) == "0o600"
    rewrite_payload(keyed.root / f"{key}.snap")
    assert keyed.lookup(FP, {}, TOKENS) is None              # the MAC caught it; the entry is gone
    assert not (keyed.root / f"{key}.snap").exists()
