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
(truncated, wrong crc, another model, a sidecar of the wrong size or types) is deleted
and reported as a miss, never used. Once the folder exceeds `max_bytes`, entries are
evicted least recently used first, of the owner holding the most.

A cache is optional, so its faults never cost an answer: open_optional() and offer() turn
a folder that cannot be made, a full disk, a read-only folder, a quota or a file size
limit into one warning and no entry (store() itself raises, having left nothing behind);
lookup() turns an unreadable folder or a bad entry into a miss. A writer killed mid-write
leaves only a hidden temporary file, removed by a later store once it is STALE seconds old.

Safe against other users: the folder is created 0700 and its files 0600 (O_EXCL, never
through a symlink); an existing folder owned by another user or writable by group or
others is refused; only regular files are read (a FIFO or a device is a miss at once),
sidecars are capped at SIDECAR_MAX bytes, and keys are checked to be what key() makes
before they name files. The snapshot's crc32 detects accidents (a torn write, a flipped
bit), not a writer who recomputes it: with `keyed=True` (or SWARMKV_PREFIX_CACHE_KEYED=1)
every entry also carries a keyed BLAKE2b MAC under a secret kept 0600 in the folder, so
a process that can write the folder but not read the secret cannot plant an entry.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _cdef
from ..errors import SnapshotError, SwarmKVError, describe
from ..snapshot import FORMAT_VERSION, Snapshot, tokens_hash
from .thresholds import TAIL

log = logging.getLogger("swarmkv_ffi.prefix_cache")

ENV_DIR = "SWARMKV_PREFIX_CACHE"
ENV_MAX = "SWARMKV_PREFIX_CACHE_MAX_BYTES"
ENV_KEYED = "SWARMKV_PREFIX_CACHE_KEYED"
SIDECAR_MAX = 4096
KEY = re.compile(r"^[0-9a-f]{40}$")        # what key() makes: blake2b, 20 bytes, hex
SECRET = ".key"
NOFOLLOW = os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class CacheFolderError(SwarmKVError):
    """The cache folder cannot be trusted (another user's, or writable by others)."""
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_BOUNDARY = 512
STALE = 600           # seconds: a temporary file this old belongs to a writer that died
TEMPORARY = re.compile(r"^\.[0-9a-f]{40}\..*")       # what store()'s writers name their files until the rename


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
    mac: str = ""
    owner: str = ""        # the signature's owner (the disk tier's per-key name); "" for the fan-out

    @classmethod
    def read(cls, path: Path) -> "Entry":
        """The sidecar at `path`, or ValueError for anything but a small regular file of
        the right fields and types, whose key is its file name."""
        data = json.loads(read_regular(path, SIDECAR_MAX))
        types = {"key": str, "model": str, "n_tokens": int, "nbytes": int, "head": str,
                 "created": (int, float), "last_used": (int, float), "mac": str, "owner": str}
        if not isinstance(data, dict) or set(data) - set(types) or not set(types) - {"mac", "owner"} <= set(data):
            raise ValueError(f"{path.name}: not a sidecar")
        if not all(isinstance(data[k], types[k]) and not isinstance(data[k], bool) for k in data):
            raise ValueError(f"{path.name}: a field of the wrong type")
        if data["key"] != path.stem or not KEY.match(data["key"]):
            raise ValueError(f"{path.name}: its key is not its name")
        return cls(**data)


def read_regular(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file, not through a symlink; never blocks on a
    FIFO or reads a device without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path.name} is {st.st_size} bytes, more than {limit}")
        return os.read(fd, limit + 1)[:limit + 1]
    finally:
        os.close(fd)


def _age(path: Path) -> float:
    """Seconds since `path` was last written; 0 for one that just went (renamed, removed)."""
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def _open_or_none(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return None


def check_folder(root: Path) -> None:
    """Create `root` 0700, or refuse an existing one another user could write into."""
    try:
        root.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheFolderError(f"prefix cache {root} is not a folder (a symlink?)")
    if st.st_uid != os.getuid():
        raise CacheFolderError(f"prefix cache {root} belongs to uid {st.st_uid}, not to this user "
                               f"({os.getuid()}); use a folder of your own (--cache-dir, {ENV_DIR})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheFolderError(f"prefix cache {root} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                               f"chmod 700 it")


class PrefixCache:
    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None,
                 boundary: int = DEFAULT_BOUNDARY, keyed: bool | None = None):
        self.root = Path(root) if root is not None else default_dir()
        env_max = os.environ.get(ENV_MAX)
        self.max_bytes = max_bytes if max_bytes is not None else int(env_max) if env_max else DEFAULT_MAX_BYTES
        if self.max_bytes < 0 or boundary < 1:
            raise ValueError(f"max_bytes must be >= 0 and boundary >= 1, got {self.max_bytes}, {boundary}")
        self.boundary = boundary
        check_folder(self.root)
        if keyed is None:
            keyed = os.environ.get(ENV_KEYED, "") not in ("", "0")
        self._secret = self._load_secret() if keyed else None
        self._naming: bytes | None = self._secret

    @classmethod
    def open_optional(cls, root: str | Path | None = None, max_bytes: int | None = None,
                      **kwargs) -> "PrefixCache | None":
        """The cache, or None with one warning when its folder cannot be made or trusted
        (a read-only home, a full disk, another user's folder): the run goes on without it."""
        try:
            return cls(root, max_bytes, **kwargs)
        except (OSError, SwarmKVError) as exc:
            where = root if root is not None else default_dir()
            log.warning("prefix cache off: cannot use %s: %s; answers are unaffected", where, describe(exc))
            return None

    def _load_secret(self) -> bytes:
        """The folder's MAC key: made once (0600, O_EXCL), read by every keyed process."""
        path = self.root / SECRET
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise CacheFolderError(f"{path} must be a regular file of this user's, mode 600")
        secret = read_regular(path, 64)
        if len(secret) != 32:
            raise CacheFolderError(f"{path} is not a 32-byte key")
        return secret

    def name_for(self, secret: bytes) -> str:
        """A stable name for `secret` (an API key) that entries may carry: BLAKE2b keyed
        with the folder's secret (made on first use), so the same key gets the same name
        in every process over this folder, whatever its place in a key file, and the name
        tells nothing of the key to anyone without the folder's secret."""
        if self._naming is None:       # (not self._secret: that one turns on entries' MACs)
            self._naming = self._load_secret()
        return hashlib.blake2b(secret, key=self._naming, digest_size=16, person=b"swarmkv-owner").hexdigest()

    def _mac(self, path: Path) -> str:
        mac = hashlib.blake2b(key=self._secret, digest_size=32)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                mac.update(chunk)
        return mac.hexdigest()

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
        """The folder's flock. A reader of a folder it cannot write (a read-only mount)
        opens the lock read-only, or reads unlocked when there is none: with no writer
        there, nothing can change under it, and a torn read is a miss anyway."""
        lock = self.root / ".lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as exc:
            if exclusive and exc.errno == errno.ELOOP:
                raise CacheFolderError(f"the prefix cache's lock {lock} is a symlink; it is never followed") from None
            if exclusive:
                raise OSError(exc.errno, exc.strerror, str(lock)) from None
            fd = _open_or_none(lock)
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)              # releases the lock

    # ---- lookup and store --------------------------------------------------------------------
    def lookup(self, model_fingerprint: str, signature: dict, tokens) -> Snapshot | None:
        """The snapshot of the longest cached prefix of `tokens`, or None. Only lengths
        some entry was stored at can match, and every entry's sidecar names its length."""
        tokens = np.asarray(tokens, dtype=np.int32)
        try:
            stored = {e.n_tokens for e in self.entries() if e.n_tokens <= len(tokens)}
        except OSError as exc:
            log.warning("prefix cache: cannot read %s: %s; prefilling instead", self.root, describe(exc))
            return None
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
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    raise SnapshotError("the entry is not a regular file")
                if self._secret is not None:
                    entry = Entry.read(self._meta(key))
                    if not hmac.compare_digest(entry.mac, self._mac(path)):
                        raise SnapshotError("its MAC does not match (written without this folder's key)")
                snap = Snapshot.load(path)
                h = snap.header
                if h.model_fingerprint != model_fingerprint or not np.array_equal(snap.tokens, tokens):
                    raise SnapshotError("entry holds another model's or another document's state")
            except (SnapshotError, OSError, ValueError) as exc:
                bad = exc
            else:
                bad = None
        if bad is not None:
            log.warning("prefix cache: dropping bad entry %s: %s", key, describe(bad))
            try:
                self.remove(key)
            except (OSError, SwarmKVError) as exc:
                log.warning("prefix cache: could not delete entry %s: %s; it is skipped", key, describe(exc))
            return None
        self._touch(key)
        return snap

    def store(self, snapshot: Snapshot, signature: dict, head: str = "") -> str:
        """Add a snapshot (its header's tokens are the prefix); returns its key."""
        h = snapshot.header
        key = self.key(h.model_fingerprint, signature, snapshot.tokens)
        now = time.time()
        entry = Entry(key, h.model_name, h.n_tokens, snapshot.nbytes, head[:120], now, now,
                      owner=str(signature.get("owner", ""))[:64])
        with self._locked(exclusive=True):
            self._sweep()
            path = self._snap(key)
            new = not path.exists()
            try:
                if new:
                    snapshot.save(path)                # mkstemp: O_EXCL, 0600, then rename
                if self._secret is not None:
                    entry.mac = self._mac(path)
                self._write_meta(entry)
            except BaseException:
                if new:
                    path.unlink(missing_ok=True)       # no entry without its sidecar
                raise
            self._evict()
        return key

    def offer(self, snapshots, signature: dict, head: str = "") -> str | None:
        """Store snapshots as an optional cache does: the first that fails (ENOSPC,
        EDQUOT, EROFS, EACCES, EIO, a file size limit...) is left out with one warning
        and ends the offer (the rest would fail alike). Returns that warning, or None."""
        for snapshot in snapshots:
            try:
                self.store(snapshot, signature, head)
            except (OSError, SwarmKVError) as exc:
                where = "" if getattr(exc, "filename", None) else f"{self.root}: "
                warning = f"prefix cache: not stored: {where}{describe(exc)}; answers are unaffected"
                log.warning(warning)
                return warning
        return None

    def _write_meta(self, entry: Entry) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.key}.", suffix=".tmp", dir=self.root)   # O_EXCL, 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(entry.__dict__))
            os.replace(tmp, self._meta(entry.key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _touch(self, key: str) -> None:
        """Record a use in the sidecar (file mtimes are too coarse to order quick uses)."""
        try:
            with self._locked(exclusive=True):
                entry = Entry.read(self._meta(key))
                entry.last_used = time.time()
                self._write_meta(entry)
        except (OSError, ValueError, TypeError, SwarmKVError):
            return                                    # a read-only folder keeps its old order

    # ---- listing and eviction ----------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry, most recently used first. A sidecar that is not one (wrong size,
        types, key, not a regular file) is deleted with its entry."""
        out = []
        for meta in self.root.glob("*.json"):
            if not KEY.match(meta.stem):
                continue                              # not a name this cache makes: not ours to touch
            try:
                e = Entry.read(meta)
                e.nbytes = os.lstat(self._snap(e.key)).st_size
            except FileNotFoundError:
                continue
            except (OSError, ValueError, TypeError) as exc:
                log.warning("prefix cache: dropping bad sidecar %s: %s", meta.name, exc)
                self._unlink(meta.stem)
                continue
            out.append(e)
        return sorted(out, key=lambda e: e.last_used, reverse=True)

    def total_bytes(self) -> int:
        return sum(os.lstat(p).st_size for p in self.root.glob("*.snap") if KEY.match(p.stem))

    def _evict(self) -> None:
        """Remove entries until the folder fits max_bytes (lock held): the least recently
        used of the owner holding the most bytes, so that one API key storing fast cannot
        push every other key's prefixes off the disk (the host tier takes alike). Entries
        without an owner (the fan-out's) are one owner between them: plain LRU."""
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        held: dict[str, int] = {}
        for e in entries:
            held[e.owner] = held.get(e.owner, 0) + e.nbytes
        oldest_first = list(reversed(entries))
        while total > self.max_bytes and oldest_first:
            heaviest = max(held, key=held.get)
            e = next(e for e in oldest_first if e.owner == heaviest)
            oldest_first.remove(e)
            self._unlink(e.key)
            total -= e.nbytes
            held[heaviest] -= e.nbytes

    def _sweep(self) -> None:
        """Remove what dead writers left (lock held): before a store, so that their bytes
        do not fill the disk the store needs."""
        for orphan in self.root.glob("*.snap"):       # a file whose sidecar never got written
            if KEY.match(orphan.stem) and not self._meta(orphan.stem).exists() and _age(orphan) > 60:
                orphan.unlink(missing_ok=True)
        for tmp in self.root.glob(".*"):              # a writer killed before its rename
            if TEMPORARY.match(tmp.name) and _age(tmp) > STALE:
                tmp.unlink(missing_ok=True)

    def _unlink(self, key: str) -> None:
        if not KEY.match(key):
            raise ValueError(f"not a prefix cache key: {key[:60]!r}")
        self._snap(key).unlink(missing_ok=True)
        self._meta(key).unlink(missing_ok=True)

    def remove(self, key: str) -> bool:
        if not KEY.match(key):
            return False
        with self._locked(exclusive=True):
            existed = self._snap(key).exists() or self._meta(key).exists()
            self._unlink(key)
        return existed

    def clear(self) -> int:
        with self._locked(exclusive=True):
            keys = {p.stem for p in [*self.root.glob("*.snap"), *self.root.glob("*.json")] if KEY.match(p.stem)}
            for key in keys:
                self._unlink(key)
        return len(keys)
