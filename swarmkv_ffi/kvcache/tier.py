"""The interface of a tier below the pool's cells: what a pool calls to keep long prefixes
it evicts, and those requests share, and to restore them.

Implemented by host.py (host RAM, over an optional tier below) and disk.py (the file
store, files.py). The pool owns only this interface, so it never imports who keeps its
prefixes, or where.
"""
from __future__ import annotations

from typing import Protocol


class PrefixTier(Protocol):
    """Long prefixes kept outside the pool's cells: host RAM (host.py), disk (disk.py), or one over the other. Every call runs on the scheduler's thread, between
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
