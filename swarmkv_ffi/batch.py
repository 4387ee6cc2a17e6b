"""Batch: a llama_batch whose arrays are NumPy arrays we own.

llama_batch is a struct of pointers (token, pos, n_seq_id, seq_id, logits). Pointing them
at NumPy arrays lets a caller fill a whole prompt with slice assignments instead of a
Python loop per token and per field.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .library import ffi


class Batch:
    """Up to `capacity` tokens, each in up to `n_seq_max` sequences.

    The views `token`, `pos`, `n_seq_id`, `seq_id` (capacity × n_seq_max) and `logits`
    are what libllama reads; `n_tokens` says how many rows are in use.
    """

    def __init__(self, capacity: int, n_seq_max: int = 1):
        if capacity < 1 or n_seq_max < 1:
            raise ValueError(f"Batch needs capacity >= 1 and n_seq_max >= 1, got {capacity}, {n_seq_max}")
        self.capacity, self.n_seq_max = capacity, n_seq_max
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.zeros(capacity, dtype=np.int32)
        self.seq_id = np.zeros((capacity, n_seq_max), dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # llama_batch.seq_id is an array of row pointers into self.seq_id.
        row_bytes = self.seq_id.strides[0]
        base = int(ffi.cast("uintptr_t", ffi.from_buffer(self.seq_id)))
        self._rows = base + row_bytes * np.arange(capacity, dtype=np.uint64)
        self._struct = ffi.new("llama_batch *")
        s = self._struct
        s.token = ffi.from_buffer("llama_token[]", self.token)
        s.embd = ffi.NULL
        s.pos = ffi.from_buffer("llama_pos[]", self.pos)
        s.n_seq_id = ffi.from_buffer("int32_t[]", self.n_seq_id)
        s.seq_id = ffi.cast("llama_seq_id **", ffi.from_buffer(self._rows))
        s.logits = ffi.from_buffer("int8_t[]", self.logits)
        self.n_tokens = 0

    def clear(self) -> "Batch":
        self.n_tokens = 0
        return self

    def add(self, token: int, pos: int, seq_ids: Iterable[int] = (0,), logits: bool = False) -> int:
        """Append one token; returns its row (the index to ask logits for)."""
        seqs = list(seq_ids)
        self._reserve(1, len(seqs))
        i = self.n_tokens
        self.token[i], self.pos[i] = token, pos
        self.n_seq_id[i] = len(seqs)
        self.seq_id[i, :len(seqs)] = seqs
        self.logits[i] = logits
        self.n_tokens += 1
        return i

    def add_sequence(self, tokens, pos0: int, seq_id: int = 0, logits_last: bool = True) -> int:
        """Append `tokens` at positions pos0, pos0+1, … in one sequence (vectorised).
        Returns the row of the last token."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        if n == 0:
            raise ValueError("add_sequence needs at least one token")
        self._reserve(n, 1)
        a, b = self.n_tokens, self.n_tokens + n
        self.token[a:b] = tokens
        self.pos[a:b] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.n_seq_id[a:b] = 1
        self.seq_id[a:b, 0] = seq_id
        self.logits[a:b] = 0
        self.logits[b - 1] = logits_last
        self.n_tokens = b
        return b - 1

    def _reserve(self, n: int, n_seqs: int) -> None:
        if self.n_tokens + n > self.capacity:
            raise ValueError(f"batch full: {self.n_tokens} + {n} tokens > capacity {self.capacity}")
        if n_seqs > self.n_seq_max:
            raise ValueError(f"token in {n_seqs} sequences > batch n_seq_max {self.n_seq_max}")

    def struct(self):
        """The llama_batch value to pass to llama_decode."""
        self._struct.n_tokens = self.n_tokens
        return self._struct[0]

    def describe(self) -> str:
        """One line for error messages: size, positions and sequences in use."""
        n = self.n_tokens
        if n == 0:
            return "n_tokens=0"
        seqs = sorted({int(s) for i in range(n) for s in self.seq_id[i, :self.n_seq_id[i]]})
        return (f"n_tokens={n} pos=[{int(self.pos[:n].min())}..{int(self.pos[:n].max())}] "
                f"seq_ids={seqs[:8]}{'…' if len(seqs) > 8 else ''} outputs={int(self.logits[:n].sum())}")
