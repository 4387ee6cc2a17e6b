"""Context: a llama_context (KV cache + compute buffers) over a Model.

Thin on purpose: decode a Batch, read logits as NumPy views, move KV cells between
sequences, and get/set whole or per-sequence state. Every libllama return code is checked
and turned into an exception that names the call and the sizes involved.

A Context is not thread-safe: use it from one thread at a time.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np

from . import errors, exact, library
from ._owned import Owned
from .batch import Batch
from .library import ffi
from .model import Model

# Values come from the cdef's enums (checked against llama.h by tests/binding/test_cdef_layout.py).
KV_TYPES = {name: library.enum("ggml_type")[f"GGML_TYPE_{name.upper()}"]
            for name in ("f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16")}
FLASH_ATTN = {name: library.enum("llama_flash_attn_type")[f"LLAMA_FLASH_ATTN_TYPE_{c}"]
              for name, c in (("auto", "AUTO"), ("off", "DISABLED"), ("on", "ENABLED"))}
POOLING = {name: library.enum("llama_pooling_type")[f"LLAMA_POOLING_TYPE_{name.upper()}"]
           for name in ("unspecified", "none", "mean", "cls", "last", "rank")}


@dataclass
class ContextParams:
    """The knobs of llama_context_params we expose, with libllama's meaning.

    kv_unified: one KV buffer shared by all sequences (needed for seq_cp forks to share
    cells). swa_full: keep a full-size cache for sliding-window layers (needed when forked
    sequences must see the whole shared prefix, e.g. Gemma 3). batch_invariant: compute
    each token's row with kernels whose result does not depend on what else shares its
    llama_decode (exact mode, see swarmkv_ffi/exact.py).
    """
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_threads_batch: int | None = None
    batch_invariant: bool = False
    embeddings: bool = False          # decode for embeddings (pooled per sequence) instead of logits
    pooling: str = "unspecified"      # how a sequence's rows become one embedding: the model's, or mean

    def validate(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"ContextParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {sorted(POOLING)}, got {self.pooling!r}")
        if self.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise ValueError(f"{name} must be one of {sorted(KV_TYPES)}, got {getattr(self, name)!r}")

    def to_c(self, lib):
        self.validate()
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = self.n_ctx, self.n_batch, self.n_ubatch, self.n_seq_max
        # libllama sizes its output buffer for the batch's rows but asserts room for one
        # row per sequence: with fewer rows than sequences (serve --batch-size) it aborted.
        p.n_outputs_max = max(self.n_batch, self.n_seq_max)
        p.kv_unified, p.swa_full = self.kv_unified, self.swa_full
        p.flash_attn_type = FLASH_ATTN[self.flash_attn]
        p.type_k, p.type_v = KV_TYPES[self.type_k], KV_TYPES[self.type_v]
        p.n_threads = self.n_threads
        p.n_threads_batch = self.n_threads_batch or self.n_threads
        p.embeddings, p.pooling_type = self.embeddings, POOLING[self.pooling]
        p.no_perf = True
        return p

    def as_dict(self) -> dict:
        return asdict(self)


_DECODE_ERRORS = {
    1: (errors.NoKVSlotError, "no KV slot for the batch (reduce the batch or raise n_ctx)"),
    2: (errors.DecodeAbortedError, "aborted by the abort callback"),
    -1: (errors.InvalidBatchError, "invalid input batch"),
}


class Context(Owned):
    """A llama_context. Create with `Context(model, ContextParams(...))` or keywords."""

    def __init__(self, model: Model, params: ContextParams | None = None, *, eval_callback=None,
                 **overrides):
        """eval_callback(tensor, ask) -> bool: libllama's cb_eval, for tools that read graph
        nodes (swarmkv_ffi.probe): asked (ask=True) whether a node is wanted, then called
        (ask=False) with its computed data. It must not raise."""
        params = params or ContextParams()
        if overrides:
            params = ContextParams(**{**params.as_dict(), **overrides})
        lib = self._lib = library.backend()
        library.recent_errors()
        c_params = params.to_c(lib)
        self._eval_callback = None
        if eval_callback is not None:  # kept on self: libllama calls it for the context's life
            self._eval_callback = ffi.callback("ggml_backend_sched_eval_callback",
                                               lambda t, ask, _: bool(eval_callback(t, ask)))
            c_params.cb_eval = self._eval_callback
        handle = lib.llama_init_from_model(model.handle, c_params)
        if handle == ffi.NULL:
            said = library.take_error_text("no message from libllama")
            raise errors.ContextError(
                f"llama_init_from_model({model.path.name}, n_ctx={params.n_ctx}, "
                f"n_seq_max={params.n_seq_max}, n_batch={params.n_batch}) failed: {said}")
        self.model, self.params, self._handle = model, params, handle
        self._mem = lib.llama_get_memory(handle)
        self._n_vocab = model.n_vocab
        model._contexts.add(self)
        self._closed = False
        if params.batch_invariant:
            try:
                exact.enable(lib, handle)
            except BaseException:
                self.close()
                raise

    def _release(self) -> None:
        self._lib.llama_free(self._handle)
        self._handle = ffi.NULL

    @property
    def handle(self):
        self._check_open()
        return self._handle

    # ---- sizes --------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._lib.llama_n_ctx(self.handle)

    @property
    def n_ctx_seq(self) -> int:
        """Cells one sequence may use (n_ctx / n_seq_max unless the cache is unified)."""
        return self._lib.llama_n_ctx_seq(self.handle)

    @property
    def n_batch(self) -> int:
        return self._lib.llama_n_batch(self.handle)

    @property
    def n_ubatch(self) -> int:
        return self._lib.llama_n_ubatch(self.handle)

    @property
    def n_seq_max(self) -> int:
        return self._lib.llama_n_seq_max(self.handle)

    def memory_bytes(self) -> tuple[int, int]:
        """(KV cache and other per-context state, compute buffers) in bytes, as libllama
        accounts this context alone (patch 0004); the model's weights are not in it."""
        context, compute = ffi.new("size_t *"), ffi.new("size_t *")
        self._lib.llama_context_memory_bytes(self.handle, context, compute)
        return int(context[0]), int(compute[0])

    # ---- decode and logits ----------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """llama_decode, with its return code turned into a named exception."""
        if batch.n_tokens == 0:
            raise errors.InvalidBatchError("llama_decode called with an empty batch", -1)
        rc = self._lib.llama_decode(self.handle, batch.struct())
        if rc == 0:
            return
        cls, meaning = _DECODE_ERRORS.get(
            rc, (errors.DecodeFailedError, "fatal error" if rc < 0 else "warning"))
        said = library.take_error_text()
        raise cls(f"llama_decode returned {rc}: {meaning}. Batch {batch.describe()}, "
                  f"n_ctx={self.n_ctx}, n_batch={self.n_batch}, n_seq_max={self.n_seq_max}"
                  + (f". libllama: {said}" if said else ""), rc)

    def decode_tokens(self, tokens, pos0: int = 0, seq_id: int = 0, *, batch: Batch | None = None,
                      logits_last: bool = True, progress=None) -> int:
        """Decode a run of tokens of one sequence in n_batch chunks at absolute positions
        pos0…; only the very last token asks for logits (if logits_last). Returns the
        batch row whose logits are ready (-1 when none). `progress(done)` is called after
        each chunk with the number of tokens done so far."""
        tokens = np.asarray(tokens, dtype=np.int32)
        step = min(self.n_batch, batch.capacity) if batch else self.n_batch
        batch = batch or Batch(min(step, max(1, len(tokens))))
        row = -1
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            last = start + len(chunk) == len(tokens)
            batch.clear()
            row = batch.add_sequence(chunk, pos0 + start, seq_id, logits_last=logits_last and last)
            self.decode(batch)
            if progress is not None:
                progress(start + len(chunk))
        return row if logits_last else -1

    def logits(self, row: int) -> np.ndarray:
        """A float32 view of the logits of batch row `row` of the last decode (negative
        rows count from the end). The view is overwritten by the next decode: copy it to
        keep it."""
        ptr = self._lib.llama_get_logits_ith(self.handle, row)
        if ptr == ffi.NULL:
            said = library.take_error_text()
            raise errors.DecodeError(
                f"llama_get_logits_ith({row}) returned NULL: that row did not ask for logits "
                f"in the last decode. {said}", 0)
        return np.frombuffer(ffi.buffer(ptr, self._n_vocab * 4), dtype=np.float32)

    @property
    def pooling(self) -> str:
        """How this context pools a sequence's rows into its embedding (embeddings mode)."""
        value = self._lib.llama_pooling_type(self.handle)
        return next((name for name, v in POOLING.items() if v == value), f"type {value}")

    def embedding(self, seq: int) -> np.ndarray:
        """Sequence `seq`'s pooled embedding from the last decode (a copy), in a context
        made with embeddings=True and a pooling other than none; under rank pooling, its
        classifier's outputs (a reranker's one score; libllama gives n_cls_out floats)."""
        ptr = self._lib.llama_get_embeddings_seq(self.handle, seq)
        if ptr == ffi.NULL:
            raise errors.DecodeError(f"llama_get_embeddings_seq({seq}) returned NULL: the context is not in "
                                     f"embeddings mode with pooling (it pools: {self.pooling}), or the sequence "
                                     "was not in the last decode", 0)
        n = (self._lib.llama_model_n_cls_out if self.pooling == "rank" else self._lib.llama_model_n_embd)(
            self.model.handle)
        return np.frombuffer(ffi.buffer(ptr, n * 4), dtype=np.float32).copy()

    # ---- memory (KV cells) --------------------------------------------------------------
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make seq `dst` see the cells of seq `src` in [p0, p1). With a unified cache this
        shares cells (no bytes move)."""
        self._lib.llama_memory_seq_cp(self._memory(), src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not self._lib.llama_memory_seq_rm(self._memory(), seq, p0, p1):
            raise errors.StateError(f"llama_memory_seq_rm(seq={seq}, p0={p0}, p1={p1}) refused "
                                    "(a partial range cannot be removed from this cache)")

    def seq_keep(self, seq: int) -> None:
        self._lib.llama_memory_seq_keep(self._memory(), seq)

    def seq_pos_min(self, seq: int) -> int:
        return self._lib.llama_memory_seq_pos_min(self._memory(), seq)

    def seq_pos_max(self, seq: int) -> int:
        """Largest position held for `seq`, -1 when it is empty."""
        return self._lib.llama_memory_seq_pos_max(self._memory(), seq)

    def clear(self, data: bool = True) -> None:
        self._lib.llama_memory_clear(self._memory(), data)

    def _memory(self):
        self._check_open()
        return self._mem

    # ---- state ---------------------------------------------------------------------------
    def state_size(self) -> int:
        return int(self._lib.llama_state_get_size(self.handle))

    def state_get(self) -> np.ndarray:
        """The whole context state (logits + every sequence's KV) as uint8."""
        out = np.empty(self.state_size(), dtype=np.uint8)
        n = self._lib.llama_state_get_data(self.handle, ffi.from_buffer("uint8_t[]", out), out.nbytes)
        if n != out.nbytes:
            raise errors.StateError(f"llama_state_get_data wrote {n} bytes, expected {out.nbytes}")
        return out

    def state_set(self, data) -> None:
        buf = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        n = self._lib.llama_state_set_data(self.handle, ffi.from_buffer("uint8_t[]", buf), buf.nbytes)
        if n != buf.nbytes:
            raise errors.StateError(
                f"llama_state_set_data read {n} of {buf.nbytes} bytes; the state does not "
                f"fit this context. {library.take_error_text()}")

    def seq_state_size(self, seq: int) -> int:
        """Bytes llama_state_seq_get_data needs for `seq`: always ask, never compute."""
        return int(self._lib.llama_state_seq_get_size(self.handle, seq))

    def seq_state_get(self, seq: int, out: np.ndarray | None = None) -> np.ndarray:
        """Copy `seq`'s KV state into `out` (uint8, at least seq_state_size bytes; a new
        array when None). Returns the filled prefix of `out`."""
        size = self.seq_state_size(seq)
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
            raise ValueError("seq_state_get needs a 1-D contiguous uint8 buffer")
        if out.nbytes < size:
            raise errors.StateError(f"buffer of {out.nbytes} bytes < {size} needed for seq {seq}")
        n = self._lib.llama_state_seq_get_data(self.handle, ffi.from_buffer("uint8_t[]", out), size, seq)
        if n != size:
            raise errors.StateError(f"llama_state_seq_get_data(seq={seq}) wrote {n} bytes, expected {size}")
        return out[:size]

    def seq_state_set(self, data, seq: int) -> int:
        """Load KV state into sequence `seq`; raises unless every byte was consumed."""
        buf = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        n = int(self._lib.llama_state_seq_set_data(self.handle, ffi.from_buffer("uint8_t[]", buf),
                                                   buf.nbytes, seq))
        if n != buf.nbytes:
            said = library.take_error_text()
            raise errors.StateError(
                f"llama_state_seq_set_data(seq={seq}) consumed {n} of {buf.nbytes} bytes"
                + (f": {said}" if said else "; the state does not match this context"))
        return n

    def __repr__(self):
        if self._closed:
            return "<Context closed>"
        return f"<Context n_ctx={self.n_ctx} n_seq_max={self.n_seq_max} model={self.model.path.name}>"
