"""The compute slot: one DECODE step at a time, shared fairly between users.

Fair by time held, not by turns: the next turn goes to the waiting uid that has held the
slot for the least time (ties: the one served longest ago), in arrival order within one
uid. A user whose turns are expensive (long slices, contexts to rebuild) gets fewer of
them, and a user who queues fifty DECODEs waits behind their own, not in front of
everyone else's. A uid that was idle re-enters IDLE_CREDIT seconds below the level of the
last uid served (as Linux's CFS credits a waking task): an occasional short request runs
ahead of a busy user's stream, yet idleness banks no more credit than that. A DECODE
yields after a slice (agents.SLICE_TOKENS tokens or SLICE_SECONDS) once a waiting user
has used less time than it, and queues again for the next.
`close()` (daemon shutdown) wakes every waiter with CANCELLED.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager


IDLE_CREDIT = 1.0


class SlotClosed(Exception):
    """The daemon is stopping: this turn will never be granted."""


class FairSlot:
    def __init__(self):
        self._cv = threading.Condition()
        self._queues: OrderedDict[int, deque] = OrderedDict()   # uid -> its tickets, in arrival order
        self._used: dict[int, float] = {}        # seconds each uid has held the slot
        self._served: dict[int, int] = {}        # when each uid was last granted (a counter)
        self._clock = itertools.count()
        self._floor = 0.0                        # the time used by the uid served last
        self._busy = False
        self._closed = False
        self._holder: tuple[int, float] | None = None

    @contextmanager
    def turn(self, uid: int):
        """`with slot.turn(uid):` holds the slot; raises SlotClosed once closed."""
        self._acquire(uid)
        try:
            yield self
        finally:
            self._release()

    def _acquire(self, uid: int) -> None:
        ticket = object()
        with self._cv:
            if self._closed:
                raise SlotClosed()
            if uid not in self._queues and self._holder_uid() != uid:   # (re)entering after idleness
                self._used[uid] = max(self._used.get(uid, 0.0), self._floor - IDLE_CREDIT)
            self._queues.setdefault(uid, deque()).append(ticket)
            while self._busy or self._head() is not ticket:
                if self._closed:
                    self._drop(uid, ticket)
                    self._cv.notify_all()
                    raise SlotClosed()
                self._cv.wait()
            self._drop(uid, ticket)
            self._floor = self._used[uid]
            self._served[uid] = next(self._clock)
            self._busy, self._holder = True, (uid, time.monotonic())

    def _release(self) -> None:
        with self._cv:
            uid, since = self._holder
            self._used[uid] += time.monotonic() - since
            self._busy, self._holder = False, None
            self._cv.notify_all()

    def _head(self):
        """The ticket to serve next: the first of the waiting uid with the least time used."""
        if not self._queues:
            return None
        uid = min(self._queues, key=lambda u: (self._used.get(u, 0.0), self._served.get(u, -1)))
        return self._queues[uid][0]

    def held_for(self) -> float:
        """Seconds the current turn has lasted."""
        with self._cv:
            return time.monotonic() - self._holder[1] if self._holder else 0.0

    def _drop(self, uid: int, ticket) -> None:
        queue = self._queues[uid]
        queue.remove(ticket)
        if not queue:
            del self._queues[uid]

    def _holder_uid(self) -> int | None:
        return self._holder[0] if self._holder else None

    def others_waiting(self, uid: int) -> bool:
        """Another user waits who has used less time than `uid` has, this turn included
        (so this turn should end after its slice)."""
        with self._cv:
            mine = self._used.get(uid, 0.0) + (time.monotonic() - self._holder[1] if self._holder else 0.0)
            return any(u != uid and self._used.get(u, 0.0) < mine for u in self._queues)

    def waiting(self, uid: int | None = None) -> int:
        """Turns queued: all of them, or one user's."""
        with self._cv:
            if uid is None:
                return sum(len(q) for q in self._queues.values())
            return len(self._queues.get(uid, ()))

    def close(self) -> None:
        """Refuse new turns and cancel the queued ones; the running one finishes."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
