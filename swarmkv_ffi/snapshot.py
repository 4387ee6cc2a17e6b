"""KV snapshots: one sequence's KV state plus a header that says what it is valid for.

    capture(ctx, seq, tokens) --> Snapshot(header, data) --> restore(ctx, seq)
                                      |  copy() duplicates the bytes (copy mode's forks)
                                      |  save(path) / load(path)   (atomic, checked)

The bytes come from llama_state_seq_get_data, sized by llama_state_seq_get_size (never by
a formula). restore() checks the header against the target context and the checksum
*before* handing anything to libllama, so a bad snapshot never touches the context; then it
checks that libllama consumed every byte.

File layout: b"SWKVSNP1" | u32 little-endian header length | header JSON | zero padding
to a 64-byte boundary | payload.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import _cdef, exact
from .arena import host_buffer
from .context import Context
from .errors import SnapshotCorruptError, SnapshotMismatchError

MAGIC = b"SWKVSNP1"
FORMAT_VERSION = 1
PAYLOAD_ALIGN = 64
MAX_HEADER_BYTES = 1 << 20   # a header is JSON of a few hundred bytes


def tokens_hash(tokens) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int32).tobytes(), digest_size=16).hexdigest()


def checksum(data: np.ndarray) -> str:
    """crc32 of the payload: catches corruption at ~4 GB/s (a cryptographic hash would
    cost more than restoring the state)."""
    return f"{zlib.crc32(data):08x}"


def context_signature(ctx: Context) -> dict:
    """The context settings that decide the layout of a sequence's KV state."""
    return params_signature(ctx.params, ctx.model)


def params_signature(p, model) -> dict:
    """context_signature for a context not created yet (ContextParams + its model)."""
    return {
        "type_k": p.type_k,
        "type_v": p.type_v,
        "flash_attn": p.flash_attn,
        "n_stream": 1 if (p.kv_unified or p.n_seq_max == 1) else p.n_seq_max,
        "swa_full": p.swa_full if model.n_swa > 0 else None,  # only SWA models care
        # KV bytes computed by the batch-invariant kernels round differently, and a patch
        # set may change either mode's kernels: neither is silently mixed with the other.
        "exact": bool(p.batch_invariant),
        "patch_set": exact.patch_set(),
    }


@dataclass
class SnapshotHeader:
    model_fingerprint: str
    model_name: str
    llama_cpp_commit: str
    context: dict
    n_tokens: int
    tokens_hash: str
    tokens: list[int]
    payload_nbytes: int
    checksum: str
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "SnapshotHeader":
        try:
            fields = json.loads(raw)
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise SnapshotCorruptError(f"snapshot header is not valid: {exc}") from exc


def check_room(folder: Path, nbytes: int) -> None:
    """Raise ENOSPC, before writing, when `folder`'s file system has less than `nbytes`
    free for this user (a file system that cannot say is not checked)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {nbytes / 2**20:.1f} MiB to write, "
                                    f"{free / 2**20:.1f} MiB free", str(folder))


class Snapshot:
    """A sequence's KV state in a host arena, with its header."""

    def __init__(self, header: SnapshotHeader, data: np.ndarray):
        self.header, self.data = header, data

    @property
    def nbytes(self) -> int:
        return self.header.payload_nbytes

    @property
    def file_nbytes(self) -> int:
        """The size of the file save() writes."""
        return len(self._prelude()) + self.data.nbytes

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.header.tokens, dtype=np.int32)

    # ---- capture and restore -------------------------------------------------------------
    @classmethod
    def capture(cls, ctx: Context, seq: int, tokens, pinned: bool | None = None) -> "Snapshot":
        """Snapshot sequence `seq` of `ctx`, which holds exactly `tokens` at 0..n-1."""
        tokens = np.asarray(tokens, dtype=np.int32)
        held = ctx.seq_pos_max(seq) + 1
        if held != len(tokens):
            raise SnapshotMismatchError(
                f"sequence {seq} holds {held} positions but {len(tokens)} tokens were given")
        data = ctx.seq_state_get(seq, host_buffer(ctx.seq_state_size(seq), pinned))
        header = SnapshotHeader(
            model_fingerprint=ctx.model.fingerprint, model_name=ctx.model.path.name,
            llama_cpp_commit=_cdef.LLAMA_CPP_COMMIT, context=context_signature(ctx),
            n_tokens=len(tokens), tokens_hash=tokens_hash(tokens), tokens=tokens.tolist(),
            payload_nbytes=data.nbytes, checksum=checksum(data))
        return cls(header, data)

    def verify(self) -> None:
        """Raise SnapshotCorruptError unless the payload matches the header."""
        h = self.header
        if self.data.nbytes != h.payload_nbytes:
            raise SnapshotCorruptError(
                f"snapshot payload is {self.data.nbytes} bytes, header says {h.payload_nbytes}")
        got = checksum(self.data)
        if got != h.checksum:
            raise SnapshotCorruptError(f"snapshot checksum mismatch: payload {got}, header {h.checksum}")
        if len(h.tokens) != h.n_tokens or tokens_hash(h.tokens) != h.tokens_hash:
            raise SnapshotCorruptError("snapshot token list does not match its hash")

    def check_compatible(self, ctx: Context) -> None:
        """Raise SnapshotMismatchError naming the first field that differs from `ctx`."""
        h = self.header
        if h.format_version != FORMAT_VERSION:
            raise SnapshotMismatchError(
                f"snapshot format_version={h.format_version}, this build reads {FORMAT_VERSION}")
        if h.llama_cpp_commit != _cdef.LLAMA_CPP_COMMIT:
            raise SnapshotMismatchError(
                f"snapshot made by llama.cpp {h.llama_cpp_commit}, this build is {_cdef.LLAMA_CPP_COMMIT}")
        if h.model_fingerprint != ctx.model.fingerprint:
            raise SnapshotMismatchError(
                f"snapshot made with model {h.model_name} (fingerprint {h.model_fingerprint}), "
                f"target is {ctx.model.path.name} ({ctx.model.fingerprint})")
        want = context_signature(ctx)
        for key in {**h.context, **want}:
            if want.get(key) != h.context.get(key):
                raise SnapshotMismatchError(
                    f"snapshot context {key}={h.context.get(key)!r}, target context {key}={want.get(key)!r}")
        if h.n_tokens > ctx.n_ctx_seq:
            raise SnapshotMismatchError(
                f"snapshot holds {h.n_tokens} tokens, target context has n_ctx_seq={ctx.n_ctx_seq}")

    def restore(self, ctx: Context, seq: int = 0) -> None:
        """Load into sequence `seq` of `ctx` (which should be empty there). All checks
        run first; a failure leaves `ctx` as it was."""
        self.check_compatible(ctx)
        self.verify()
        if ctx.seq_pos_max(seq) >= 0:
            raise SnapshotMismatchError(f"target sequence {seq} is not empty; clear it first")
        ctx.seq_state_set(self.data, seq)
        got = ctx.seq_pos_max(seq) + 1
        if got != self.header.n_tokens:
            ctx.seq_rm(seq)
            raise SnapshotCorruptError(
                f"restored sequence holds {got} positions, header says {self.header.n_tokens}")

    def copy(self, pinned: bool | None = None) -> "Snapshot":
        """An independent copy of the bytes, for a branch that may outlive or travel away
        from this snapshot (copy mode forks a branch this way)."""
        data = host_buffer(self.data.nbytes, pinned)
        data[:] = self.data
        return Snapshot(self.header, data)

    # ---- bytes and files -----------------------------------------------------------------
    def _prelude(self) -> bytes:
        head = self.header.to_json()
        prelude = MAGIC + struct.pack("<I", len(head)) + head
        return prelude + b"\0" * ((-len(prelude)) % PAYLOAD_ALIGN)

    def to_bytes(self) -> bytes:
        return self._prelude() + self.data.tobytes()

    @classmethod
    def from_bytes(cls, raw, pinned: bool | None = None, verify: bool = True) -> "Snapshot":
        """Parse the file layout from a bytes-like object (checks structure and checksum)."""
        view = memoryview(raw).cast("B")
        cursor = 0

        def read(n: int) -> bytes:
            nonlocal cursor
            chunk = bytes(view[cursor:cursor + n])
            cursor += n
            return chunk

        header, offset = cls._read_prelude(read)
        payload = view[offset:]
        if len(payload) != header.payload_nbytes:
            raise SnapshotCorruptError(
                f"snapshot payload is {len(payload)} bytes, header says {header.payload_nbytes} (truncated?)")
        data = host_buffer(header.payload_nbytes, pinned)
        data[:] = np.frombuffer(payload, dtype=np.uint8)
        snap = cls(header, data)
        if verify:
            snap.verify()
        return snap

    @staticmethod
    def _read_prelude(read) -> tuple[SnapshotHeader, int]:
        """Parse magic, length and header with `read(n) -> bytes`; return the header and
        the payload's offset."""
        fixed = read(len(MAGIC) + 4)
        if len(fixed) < len(MAGIC) + 4 or fixed[:len(MAGIC)] != MAGIC:
            raise SnapshotCorruptError("not a swarmkv snapshot (bad magic)")
        (n,) = struct.unpack("<I", fixed[len(MAGIC):])
        if n > MAX_HEADER_BYTES:
            raise SnapshotCorruptError(f"snapshot header claims {n} bytes; headers are at most {MAX_HEADER_BYTES}")
        raw = read(n)
        if len(raw) != n:
            raise SnapshotCorruptError("snapshot header is truncated")
        header = SnapshotHeader.from_json(raw)
        prelude = len(MAGIC) + 4 + n
        return header, prelude + (-prelude) % PAYLOAD_ALIGN

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same folder, fsync, rename. A folder
        with too little free space is refused before a byte is written; a write that
        fails anyway (a quota, a file size limit, an I/O error) leaves nothing behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        check_room(path.parent, self.file_nbytes)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._prelude())
                f.write(memoryview(self.data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.filename is None:   # a write's error names no file
                raise OSError(exc.errno, exc.strerror, str(path)) from exc
            raise
        return path

    @classmethod
    def load(cls, path: str | Path, pinned: bool | None = None) -> "Snapshot":
        """Read and check a file written by save()."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"snapshot file not found: {path}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)   # a FIFO cannot hang it
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SnapshotCorruptError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            header, offset = cls._read_prelude(f.read)
            size = os.fstat(f.fileno()).st_size
            if header.payload_nbytes != size - offset:   # before allocating what the file claims
                raise SnapshotCorruptError(
                    f"{path}: header says the payload is {header.payload_nbytes} bytes, the file holds "
                    f"{size - offset} after the header (truncated, appended to, or crafted?)")
            f.seek(offset)
            data = host_buffer(header.payload_nbytes, pinned)
            got = f.readinto(memoryview(data))
            extra = f.read(1)
        if got != header.payload_nbytes or extra:
            raise SnapshotCorruptError(
                f"{path}: payload is {got}{'+' if extra else ''} bytes, header says "
                f"{header.payload_nbytes} (truncated or appended to?)")
        snap = cls(header, data)
        snap.verify()
        return snap

    def __repr__(self):
        h = self.header
        return f"<Snapshot {h.model_name} tokens={h.n_tokens} bytes={h.payload_nbytes} crc={h.checksum}>"
