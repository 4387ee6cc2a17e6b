"""Exact mode: a sequence's logits depend only on its own tokens, bit for bit.

Why it is not free: libllama's CPU kernels pick their summation order by the shape of the
batch (tiled matmuls from 8 rows, gemm for groups of 4 repacked rows, flash attention
split across threads at boundaries that move with the number of cells, fused ops). A
branch decoded beside 15 others then rounds differently from the same branch decoded
alone, and greedy answers drift apart after a few dozen tokens.

What exact mode does, and why each piece is needed:
  - the context runs ggml's reference CPU kernels, made batch-invariant by our patches
    (kernels/ggml/0001, 0002; `llama_set_batch_invariant`): every output row is computed
    by the same instructions in the same order, whatever else is in the batch;
  - flash attention is on: its reference kernel walks the cells a row can see, in cell
    order, and skips masked ones, so other sequences' cells change nothing (without it,
    softmax and KQV sum over every cell, masked ones included, in SIMD lanes whose
    grouping moves with the cell layout);
  - sliding-window layers keep a full cache (swa_full), so cells are never reused as a
    ring and cell order stays position order;
  - shared mode keeps a finished branch's cells until the run ends (freed cells would be
    refilled by other branches' later tokens, out of position order).

Guarantee: on the CPU backend, a token's logits equal those of a plain run in exact mode
(one fresh context, the same tokens, one token per llama_decode) whatever the batch
sizes, chunking, number of branches and finishing order. Not claimed: equality with a
run in the fast default mode (other kernels, other rounding), GPU backends (refused),
builds with --amx, mixture-of-experts models (MUL_MAT_ID is not covered by the patches).
"""
from __future__ import annotations

import hashlib

import numpy as np

from . import errors, library

def check_build() -> None:
    """Refuse a libllama that cannot give the guarantee, before any context exists."""
    if library.manifest().get("amx"):
        raise errors.ExactModeError(
            "exact mode is not available on a --amx build: ggml's AMX matmul is not "
            "batch-invariant. Rebuild with ./build_llama.sh (AMX off by default).")


def enable(lib, ctx_handle) -> None:
    """Switch a fresh llama_context to the batch-invariant kernels, or raise."""
    check_build()
    try:
        setter = lib.llama_set_batch_invariant
    except AttributeError as exc:
        raise errors.ExactModeError(
            "this libllama has no llama_set_batch_invariant: it was built without "
            "kernels/ggml/0001-llama-set-batch-invariant.patch. Rebuild with ./build_llama.sh.") from exc
    if not setter(ctx_handle, True):
        raise errors.ExactModeError(
            "exact mode needs every op on the CPU backend; this context computes on another "
            "backend (CUDA, Metal, BLAS...), whose kernels are not batch-invariant")


def patch_set() -> str | None:
    """The build's patch-set id (from the manifest): part of what a snapshot is valid for."""
    return library.manifest().get("patch_set")


def digest(logits: np.ndarray) -> str:
    """A short fingerprint of a row of logits' raw float32 bytes: two rows with the same
    digest are equal bit for bit (up to a 2^-64 collision), at ~1 ms for 256k floats."""
    return hashlib.blake2b(np.ascontiguousarray(logits, dtype=np.float32).tobytes(), digest_size=8).hexdigest()
