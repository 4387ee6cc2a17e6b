"""The compute slot: one DECODE step at a time, shared fairly between users.

Turns are granted round-robin across uids and in arrival order within one uid, so a
user who queues fifty DECODEs waits behind their own, not in front of everyone else's.
A DECODE takes one turn per slice of tokens (agents.SLICE_TOKENS) and queues again for
the next, so a long one cannot hold the others. `close()` (daemon shutdown) wakes every
waiter with CANCELLED.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from contextlib import contextmanager


class SlotClosed(Exception):
    """The daemon is stopping: this turn will never be granted."""


class FairSlot:
    def __init__(self):
        self._cv = threading.Condition()
        self._queues: OrderedDict[int, deque] = OrderedDict()   # uid -> its tickets, in turn order
        self._busy = False
        self._closed = False

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
            self._queues.setdefault(uid, deque()).append(ticket)
            while self._busy or self._head() is not ticket:
                if self._closed:
                    self._drop(uid, ticket)
                    self._cv.notify_all()
                    raise SlotClosed()
                self._cv.wait()
            self._drop(uid, ticket)
            if uid in self._queues:
                self._queues.move_to_end(uid)      # this user's next turn comes after the others'
            self._busy = True

    def _release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def _head(self):
        return next(iter(self._queues.values()))[0] if self._queues else None

    def _drop(self, uid: int, ticket) -> None:
        queue = self._queues[uid]
        queue.remove(ticket)
        if not queue:
            del self._queues[uid]

    def others_waiting(self, uid: int) -> bool:
        """Another user has a turn queued (so this one should yield after its slice)."""
        with self._cv:
            return any(u != uid for u in self._queues)

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
