"""A context of a user's own: an agent too large for the shared pool that another
user's agents sit in decodes in a context of its owner's, made on a thread of its own,
instead of making that pool reopen larger and pausing everyone in it (issue #50).

`OwnContexts` is a part of the Conductor (agents.py holds the state it reads).
"""
from __future__ import annotations

import logging
import os
import threading

from ..admission.ledger import LedgerDenied
from .agent import Agent
from .booking import compute_key_of
from .agent import Kind, pool_key
from .pool import Pool, PoolKey
from .runs import Run

log = logging.getLogger("lmxd")

#: The CPU priority (nice) of the threads that make and free users' own contexts: low, so
#: the decode threads win the cores, but not the lowest (19), under which a busy daemon
#: left an own context unmade for tens of seconds (#50's ladder: 8 steps in a phase).
NICE = 10


def in_background(fn, name: str) -> None:
    """Run fn() on a thread of its own at a low CPU priority (NICE): making or freeing a
    user's own context (clearing or unmapping up to a gigabyte of KV) yields the cores to
    the scheduler's decode threads, so the users decoding meanwhile do not wait for it;
    its owner does."""
    def low() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)   # this thread (Linux)
        except (OSError, AttributeError):
            pass                   # elsewhere: it runs at the daemon's priority
        fn()
    threading.Thread(target=low, name=name, daemon=True).start()


class OwnContexts:
    """The Conductor's users' own contexts (on the scheduler's thread, but the building)."""

    def own_context(self, pool: Pool, run: Run) -> bool:
        """`run` cannot be seated in the shared `pool` unless it reopens larger. If another
        user's agent sits in it, the run's agent decodes in a context of its owner's own
        instead, beside the owner's other agents that outgrew it: joined now if it has
        room, else made (or rebuilt larger) on a thread of its own while the scheduler goes
        on stepping the others; True: the run waits for it. Reopening would pause every
        resident to host RAM and back, once per growth step, at the cost of users who
        asked for nothing (issue #50). Its compute buffer is booked to the owner (its
        agents' cells are their own bookings already); a rebuild pauses the owner's agents
        only. False (no other user there, or no room in the ledger or the owner's share
        for that buffer): the scheduler reopens the shared pool as before."""
        agent = run.agent
        key = pool.key._replace(alone=str(agent.owner))
        if agent.kind is not Kind.CONVERSATION or key in self._unmade or \
                not any(s.agent.owner != agent.owner for s in pool.seats.values()):
            return False
        own = self.scheduler.pools.get(key)
        if own is not None and own.is_open and own.fits(agent):
            agent.alone = True          # its run joins that pool from the next step
            return True
        return self._build_own(key, agent)

    def _build_own(self, key: PoolKey, agent: Agent) -> bool:
        """Make uid key.alone's own context on a thread of its own, sized for `agent` and
        the owner's agents of that model and mode not seated in the shared pool (those
        already in its own context, those that have not decoded or wait to: all decode
        there once it is made, in place of the one of that key, if any). False if its
        compute buffer does not fit the ledger."""
        if key in self._building:
            return True
        if not self.ledger.held(compute_key_of(key)):
            owner = int(key.alone)
            try:
                self.ledger.reserve(compute_key_of(key), agent.loaded.context_bytes[2],
                                    cap=self._cap(self.ledger, self.quotas.ledger_share, owner),
                                    base=self._weights_used_by(owner))
            except LedgerDenied:
                return False
        mine = self._outside_shared(key)
        self._building.add(key)
        in_background(lambda: self._open_own(key, agent, mine), f"lmxd-own-{key.alone}")
        return True

    def _outside_shared(self, key: PoolKey, among: list[Agent] | None = None) -> list[Agent]:
        """(On the scheduler's thread.) The registered agents of uid key.alone of that
        model and mode (of `among`, if given) not seated in the shared pool."""
        shared_key = key._replace(alone="")
        shared = self.scheduler.pools.get(shared_key)
        with self._lock:
            agents = [a for a in self.agents.values() if a.owner == int(key.alone)] if among is None else \
                [a for a in among if self.agents.get((a.owner, a.id)) is a]
        return [a for a in agents if a.kind is Kind.CONVERSATION and pool_key(a)._replace(alone="") == shared_key
                and (shared is None or not shared.is_open or shared.seat_of(a) is None)]

    def _open_own(self, key: PoolKey, agent: Agent, sized_for: list[Agent]) -> None:
        """(A thread of its own.) Open the context, then hand it to the scheduler."""
        own = self.open_pool(key, agent.loaded)
        try:
            own.open(sized_for)
        except Exception:              # noqa: BLE001 - the run is told by the reopen that follows
            log.exception("opening uid %s's own context failed", key.alone)
            own = None

        def adopt() -> bool:
            self._building.discard(key)
            if own is None:
                self._unmade.add(key)
            here = self._outside_shared(key, among=sized_for)
            if own is None or not here:
                if key not in self.scheduler.pools:
                    self.ledger.release(compute_key_of(key))
                return False
            self.scheduler.adopt(own)
            for a in here:
                a.alone = True
            return True
        if not self.scheduler.call(adopt) and own is not None:
            own.discard()
