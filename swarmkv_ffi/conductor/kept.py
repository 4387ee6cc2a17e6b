"""Cells a finished request left in its pool, kept as cache: the server's radix cache.

Every request of the OpenAI-compatible server (serve/) is a short-lived agent in its
model's pool. When it finishes, its sequence is not freed: its cells stay, with the
tokens they hold, until the pool needs the room (least recently used first). A new
request whose prompt starts with the same tokens as a kept sequence, or as a request
still running, forks that many cells into its own sequence (`llama_memory_seq_cp`:
the cells are shared, nothing is copied) and decodes only the rest. Sequences that
share a prefix share its cells, so the pool holds a tree of prompts, as SGLang's
RadixAttention does, with llama.cpp's cells as the tree's storage.

A kept sequence is matched only by requests of the owner that made it (unless the
operator allows sharing): a prefix served from cache is faster, and that speed would
tell one user what another has asked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Kept:
    owner: int
    tokens: list[int]                   # what the sequence's cells hold, position by position
    last_used: float = field(default_factory=time.monotonic)


def longest_common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (slices compare in C: a binary search over
    them beats a Python loop on documents of thousands of tokens)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:                      # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
