"""A content-addressed store of document snapshots: a document is prefilled once, ever.

Key = blake2b of (model fingerprint, llama.cpp commit, snapshot format, the context
settings that decide the KV layout, the hash of the prefix tokens). Value = the snapshot
file (snapshot.py's format, header and crc32 included) plus a small JSON sidecar for
`swarmkv cache ls` (document head, tokens, model, bytes, last use).

Longest cached prefix: a document's state is stored at its whole prefix, TAIL tokens
before its end, at the last boundary before its end (boundaries are multiples of
`boundary` tokens) and at `boundary` x 1, 2, 4, 8 ... (so storage grows with the log of
the length). A document that extends a cached one (a growing log) restores all of the old
one but its last TAIL tokens; one that shares only a preamble restores the largest
power-of-two boundary inside it; either way only the rest is prefilled. Lookups try every
length some entry was stored at (the sidecars say), longest first.

Safe with several processes: files are written to a temporary name and renamed; writes
and eviction hold an exclusive flock on the folder's lock file, reads a shared one; a
reader that loses an entry to eviction just misses. An entry that fails its checks
(truncated, wrong crc, another model) is deleted and reported as a miss, never used.
Least-recently-used entries are evicted once the folder exceeds `max_bytes`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _cdef
from .errors import SnapshotError
from .snapshot import FORMAT_VERSION, Snapshot, tokens_hash

log = logging.getLogger("swarmkv_ffi.prefix_cache")

ENV_DIR = "SWARMKV_PREFIX_CACHE"
ENV_MAX = "SWARMKV_PREFIX_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_BOUNDARY = 512
TAIL = 16   # also store a document just short of its end: a tokenizer merge with appended text stays behind it


def default_dir() -> Path:
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swarmkv-ffi" / "prefix"


@dataclass
class Entry:
    key: str
    model: str
    n_tokens: int
    nbytes: int
    head: str
    created: float
    last_used: float

    @classmethod
    def read(cls, path: Path) -> "Entry":
        return cls(**json.loads(path.read_text()))


class PrefixCache:
    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None,
                 boundary: int = DEFAULT_BOUNDARY):
        self.root = Path(root) if root is not None else default_dir()
        env_max = os.environ.get(ENV_MAX)
        self.max_bytes = max_bytes if max_bytes is not None else int(env_max) if env_max else DEFAULT_MAX_BYTES
        if self.max_bytes < 0 or boundary < 1:
            raise ValueError(f"max_bytes must be >= 0 and boundary >= 1, got {self.max_bytes}, {boundary}")
        self.boundary = boundary
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- keys ------------------------------------------------------------------------------
    @staticmethod
    def key(model_fingerprint: str, signature: dict, tokens) -> str:
        parts = {"model": model_fingerprint, "llama": _cdef.LLAMA_CPP_COMMIT, "format": FORMAT_VERSION,
                 "context": signature, "tokens": tokens_hash(tokens), "n": len(tokens)}
        return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=20).hexdigest()

    def store_points(self, n_tokens: int, step: int | None = None) -> list[int]:
        """Prefix lengths to store a document at: the whole prefix, TAIL tokens short of
        it, the last boundary before it, and step x 1, 2, 4, ... below it."""
        step = step or self.boundary
        points = {n_tokens}
        if n_tokens > 2 * TAIL:
            points.add(n_tokens - TAIL)
        if n_tokens > step:
            points.add((n_tokens - 1) // step * step)
        k = step
        while k < n_tokens:
            points.add(k)
            k *= 2
        return sorted(points, reverse=True)

    def _snap(self, key: str) -> Path:
        return self.root / f"{key}.snap"

    def _meta(self, key: str) -> Path:
        return self.root / f"{key}.json"

    @contextmanager
    def _locked(self, exclusive: bool):
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- lookup and store --------------------------------------------------------------------
    def lookup(self, model_fingerprint: str, signature: dict, tokens) -> Snapshot | None:
        """The snapshot of the longest cached prefix of `tokens`, or None. Only lengths
        some entry was stored at can match, and every entry's sidecar names its length."""
        tokens = np.asarray(tokens, dtype=np.int32)
        stored = {e.n_tokens for e in self.entries() if e.n_tokens <= len(tokens)}
        for k in sorted(stored, reverse=True):
            key = self.key(model_fingerprint, signature, tokens[:k])
            snap = self._load(key, model_fingerprint, tokens[:k])
            if snap is not None:
                return snap
        return None

    def _load(self, key: str, model_fingerprint: str, tokens: np.ndarray) -> Snapshot | None:
        path = self._snap(key)
        with self._locked(exclusive=False):
            if not path.exists():
                return None
            try:
                snap = Snapshot.load(path)
                h = snap.header
                if h.model_fingerprint != model_fingerprint or not np.array_equal(snap.tokens, tokens):
                    raise SnapshotError("entry holds another model's or another document's state")
            except (SnapshotError, OSError, ValueError) as exc:
                bad = exc
            else:
                bad = None
        if bad is not None:
            log.warning("prefix cache: dropping bad entry %s: %s", key, bad)
            self.remove(key)
            return None
        self._touch(key)
        return snap

    def store(self, snapshot: Snapshot, signature: dict, head: str = "") -> str:
        """Add a snapshot (its header's tokens are the prefix); returns its key."""
        h = snapshot.header
        key = self.key(h.model_fingerprint, signature, snapshot.tokens)
        now = time.time()
        entry = Entry(key, h.model_name, h.n_tokens, snapshot.nbytes, head[:120], now, now)
        with self._locked(exclusive=True):
            if not self._snap(key).exists():
                snapshot.save(self._snap(key))
            self._write_meta(entry)
            self._evict()
        return key

    def _write_meta(self, entry: Entry) -> None:
        tmp = self._meta(entry.key).with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry.__dict__))
        os.replace(tmp, self._meta(entry.key))

    def _touch(self, key: str) -> None:
        """Record a use in the sidecar (file mtimes are too coarse to order quick uses)."""
        with self._locked(exclusive=True):
            try:
                entry = Entry.read(self._meta(key))
            except (OSError, ValueError, TypeError):
                return
            entry.last_used = time.time()
            self._write_meta(entry)

    # ---- listing and eviction ----------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry, most recently used first."""
        out = []
        for meta in self.root.glob("*.json"):
            try:
                e = Entry.read(meta)
                e.nbytes = self._snap(e.key).stat().st_size
            except (OSError, ValueError, TypeError):
                continue
            out.append(e)
        return sorted(out, key=lambda e: e.last_used, reverse=True)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*.snap") if p.exists())

    def _evict(self) -> None:
        """Remove least-recently-used entries until the folder fits max_bytes (lock held)."""
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        for e in reversed(entries):
            if total <= self.max_bytes:
                break
            self._unlink(e.key)
            total -= e.nbytes
        for orphan in self.root.glob("*.snap"):       # a file whose sidecar never got written
            if not self._meta(orphan.stem).exists() and time.time() - orphan.stat().st_mtime > 60:
                orphan.unlink(missing_ok=True)

    def _unlink(self, key: str) -> None:
        self._snap(key).unlink(missing_ok=True)
        self._meta(key).unlink(missing_ok=True)

    def remove(self, key: str) -> bool:
        with self._locked(exclusive=True):
            existed = self._snap(key).exists() or self._meta(key).exists()
            self._unlink(key)
        return existed

    def clear(self) -> int:
        with self._locked(exclusive=True):
            keys = {p.stem for p in self.root.glob("*.snap")} | {p.stem for p in self.root.glob("*.json")}
            for key in keys:
                self._unlink(key)
        return len(keys)
