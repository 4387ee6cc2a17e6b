"""What a request pool keeps of finished requests: their cells (the radix cache) and, below
them, a store of shared prefixes that outlives the process.

Every request submitted to a RequestPool (requests.py) is a short-lived agent in its
model's request pool. When it finishes, its sequence is not freed: its cells stay, with
the tokens they hold, until the pool needs the room (least recently used first; the
bookkeeping of seats and kept sequences is Pool's, pool.py). A new
request whose prompt starts with the same tokens as a kept sequence, or as a request
still running, forks that many cells into its own sequence (`llama_memory_seq_cp`:
the cells are shared, nothing is copied) and decodes only the rest. Sequences that
share a prefix share its cells, so the pool holds a tree of prompts, as SGLang's
RadixAttention does, with llama.cpp's cells as the tree's storage.

A kept sequence is matched only by requests of the owner that made it (unless the
operator allows sharing): a prefix served from cache is faster, and that speed would
tell one user what another has asked.

`PrefixStore` is the interface a pool calls to keep long prefixes below its cells: those
it evicts, and those requests share (tiers.py keeps them in host RAM over an optional
store below; serve/persist.py on disk, in the prefix cache): the conductor owns the
interface, so it never imports who implements it on disk.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Kept:
    owner: int
    tokens: list[int]                   # what the sequence's cells hold, position by position
    cells: int = 0                      # the cells it books: those no sequence it forked from books
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


class PrefixStore(Protocol):
    """Long prefixes kept outside the pool's cells: host RAM (tiers.py), disk (serve's
    persist.py), or one over the other. Every call runs on the scheduler's thread, between
    two steps, and must never fail a request: a store that cannot work answers (0, None)
    or does nothing."""
    min_tokens: int      # prefixes shorter than this are neither stored nor looked up

    def recall(self, owner: int, tokens: list[int], ctx, seq: int, more_than: int, spare: int = 0,
               prefill_s: float | None = None) -> tuple[int, str | None]:
        """Restore into the empty `seq` the longest kept prefix of `tokens` (all but the
        last) of `owner`'s, if longer than `more_than` and cheaper to restore than to
        prefill at prefill_s seconds a token (None: unmeasured). Returns how many of
        `tokens` the sequence now holds and the tier it came from ("host", "disk"), or (0,
        None). It may restore up to `spare` cells more than that: the caller trims them."""

    def remember(self, owner: int, tokens: list[int], ctx, seq: int, n: int) -> None:
        """`seq` holds exactly tokens[:n], a prefix another request shared: keep it."""

    def evicted(self, owner: int, tokens: list[int], ctx, seq: int) -> None:
        """The pool is dropping `seq`, which holds `tokens`: keep it if worth it."""

    def keep(self, owner: int, snapshot, ctx) -> None:
        """A tier above lets this snapshot (of `ctx`'s layout) go: keep it if worth it."""

    def flush(self) -> None:
        """Wait until what was handed over is kept."""
