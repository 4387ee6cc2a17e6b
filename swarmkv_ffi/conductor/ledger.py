"""The admission ledger: bytes reserved per agent, never more than the budget in total."""
from __future__ import annotations

import threading

from ..errors import SwarmKVError

MAX_BYTES = 1 << 62  # anything larger is a malformed request, not a real model


class LedgerDenied(SwarmKVError):
    """The request does not fit; carries the three numbers the protocol reports."""

    def __init__(self, ledger_max: int, allocated: int, request: int, reason: str = "CAP"):
        self.ledger_max, self.allocated, self.request, self.reason = ledger_max, allocated, request, reason
        super().__init__(f"VRAM_LEDGER_DENY code={reason} ledger_max_bytes={ledger_max} "
                         f"ledger_allocated_bytes={allocated} request_table_bytes={request}")


class Ledger:
    """`limit()` gives the current budget (it may shrink when other processes take memory);
    reserve() checks and adds under one lock, so concurrent admissions cannot overshoot."""

    def __init__(self, limit):
        self._limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @property
    def allocated(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def held(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)

    def limit(self) -> int:
        return self._limit()

    def reserve(self, key: str, nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes > MAX_BYTES:
            raise ValueError(f"reservation must be a positive byte count below 2**62, got {nbytes!r}")
        limit = self._limit()
        with self._lock:
            if key in self._held:
                raise ValueError(f"{key!r} already holds a reservation")
            allocated = sum(self._held.values())
            if allocated + nbytes > limit:
                raise LedgerDenied(limit, allocated, nbytes)
            self._held[key] = nbytes

    def adjust(self, key: str, nbytes: int) -> None:
        """Replace an estimate with a measurement (allowed to exceed the cap: the memory is
        already in use; later admissions see it)."""
        if nbytes <= 0 or nbytes > MAX_BYTES:
            raise ValueError(f"bad byte count {nbytes!r}")
        with self._lock:
            if key not in self._held:
                raise KeyError(key)
            self._held[key] = nbytes

    def book_once(self, key: str, nbytes: int) -> None:
        """Record memory already in use (a loaded model's weights) unless `key` holds some."""
        with self._lock:
            self._held.setdefault(key, nbytes)

    def release(self, key: str) -> int:
        with self._lock:
            return self._held.pop(key, 0)
