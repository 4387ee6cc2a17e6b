"""Admission ledgers: bytes reserved per key, never more than the budget in total.

lmxd keeps two: device memory (VRAM, or host RAM on a CPU-only machine) for weights,
contexts and compute buffers, and host RAM for paused agents' KV snapshots (SWAP).
Every booking in either goes through one check-and-add under one lock.

Keys are typed (keys.py): each names its owner, or none for a shared booking such as a
model's weights. A booking may also be held to a per-user cap (quotas.py), checked under
the same lock."""
from __future__ import annotations

import threading

from ..errors import SwarmKVError
from .keys import Key

MAX_BYTES = 1 << 62  # anything larger is a malformed request, not a real model


class LedgerDenied(SwarmKVError):
    """The request does not fit; carries the three numbers the protocol reports. On the wire
    the request's bytes are `request_table_bytes=` whatever was asked for (an agent's context,
    a model's weights, a swapped KV state): the field name is fixed by the protocol, which
    clients parse."""

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
        self._held: dict[Key, int] = {}

    @property
    def allocated(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def held(self, key: Key) -> int:
        with self._lock:
            return self._held.get(key, 0)

    def limit(self) -> int:
        return self._limit()

    def held_by(self, uid: int) -> int:
        """Bytes booked under keys that name `uid` as their owner."""
        with self._lock:
            return self._owned(uid)

    def _owned(self, uid: int) -> int:
        return sum(n for key, n in self._held.items() if key.owner == uid)

    def reserve(self, key: Key, nbytes: int, cap: int | None = None, base: int = 0) -> None:
        """Hold `nbytes` under a new `key`, or raise LedgerDenied with the numbers."""
        self.settle({key: nbytes}, new=True, cap=cap, base=base)

    def settle(self, bookings: dict[Key, int], new: bool = False, cap: int | None = None,
               base: int = 0) -> None:
        """Set several keys at once if the total stays within the budget, else change
        nothing and raise LedgerDenied. A key already held keeps its booking unless
        listed; `new=True` refuses keys that are already held. cap: the most the owner of
        the first key may hold, counting `base` bytes charged to it from elsewhere (the
        weights its agents use); exceeding it is denied with code=USER_SHARE."""
        for key, nbytes in bookings.items():
            if not isinstance(key, Key):
                raise TypeError(f"a ledger key is a keys.Key, got {key!r}")
            if not isinstance(nbytes, int) or nbytes <= 0 or nbytes > MAX_BYTES:
                raise ValueError(f"reservation must be a positive byte count below 2**62, got {nbytes!r}")
        limit = self._limit()
        with self._lock:
            if new and any(key in self._held for key in bookings):
                raise ValueError(f"{sorted(map(str, bookings))}: already holds a reservation")
            allocated = sum(self._held.values())
            after = allocated + sum(n - self._held.get(k, 0) for k, n in bookings.items())
            if after > limit:
                raise LedgerDenied(limit, allocated, after - allocated, name=self.name)
            if cap is not None:
                uid = next(iter(bookings)).owner
                own = base + self._owned(uid)
                more = sum(n - self._held.get(k, 0) for k, n in bookings.items() if k.owner == uid)
                if own + more > cap:
                    raise LedgerDenied(cap, own, more, reason="USER_SHARE", name=self.name)
            self._held.update(bookings)

    def release(self, key: Key) -> int:
        with self._lock:
            return self._held.pop(key, 0)

