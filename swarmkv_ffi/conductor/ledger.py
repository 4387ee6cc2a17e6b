"""Admission ledgers: bytes reserved per key, never more than the budget in total.

lmxd keeps two: device memory (VRAM, or host RAM on a CPU-only machine) for weights,
contexts and compute buffers, and host RAM for paused agents' KV snapshots (SWAP).
Every booking in either goes through one check-and-add under one lock."""
from __future__ import annotations

import threading

from ..errors import SwarmKVError

MAX_BYTES = 1 << 62  # anything larger is a malformed request, not a real model


class LedgerDenied(SwarmKVError):
    """The request does not fit; carries the three numbers the protocol reports."""

    def __init__(self, ledger_max: int, allocated: int, request: int, reason: str = "CAP",
                 name: str = "VRAM"):
        self.ledger_max, self.allocated, self.request, self.reason = ledger_max, allocated, request, reason
        self.code = "VRAM_LEDGER_DENY" if name == "VRAM" else f"{name}_BUDGET_DENY"
        super().__init__(f"{self.code} code={reason} ledger_max_bytes={ledger_max} "
                         f"ledger_allocated_bytes={allocated} request_table_bytes={request}")


class Ledger:
    """`limit()` gives the current budget (it may shrink when other processes take memory);
    reserve() checks and adds under one lock, so concurrent admissions cannot overshoot."""

    def __init__(self, limit, name: str = "VRAM"):
        self._limit, self.name = limit, name
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
        """Hold `nbytes` under a new `key`, or raise LedgerDenied with the numbers."""
        self.settle({key: nbytes}, new=True)

    def settle(self, bookings: dict[str, int], new: bool = False) -> None:
        """Set several keys at once if the total stays within the budget, else change
        nothing and raise LedgerDenied. A key already held keeps its booking unless
        listed; `new=True` refuses keys that are already held."""
        for nbytes in bookings.values():
            if not isinstance(nbytes, int) or nbytes <= 0 or nbytes > MAX_BYTES:
                raise ValueError(f"reservation must be a positive byte count below 2**62, got {nbytes!r}")
        limit = self._limit()
        with self._lock:
            if new and any(key in self._held for key in bookings):
                raise ValueError(f"{sorted(bookings)!r}: already holds a reservation")
            allocated = sum(self._held.values())
            after = allocated + sum(n - self._held.get(k, 0) for k, n in bookings.items())
            if after > limit:
                raise LedgerDenied(limit, allocated, after - allocated, name=self.name)
            self._held.update(bookings)

    def release(self, key: str) -> int:
        with self._lock:
            return self._held.pop(key, 0)
