"""The scheduler: one thread runs every llama_decode, for all running agents of a model at once.

A DECODE becomes a `Run`. The scheduler serves one pool at a time (pool.py: the context
agents of one model share) and each step decodes, in one llama_decode, the next token of
every run in that pool's batch (or the next chunk of a prompt, or of tokens being
re-read), then samples each run's next token. A new DECODE joins at the next step, a
finished one leaves: continuous batching, as llama-server's slots, under lmxd's ledger.

Fair between users by time (policy.py decides; this module only measures and obeys):
each step's seconds are charged to its users by the batch rows each put in, a user
SLICE_SECONDS ahead of another in the batch sits steps out until that one catches up,
virtual time never goes back for anyone (a newcomer starts at the floor of the active
users, not at zero), and while users share the device a step carries no more rows than
keep it within STEP_RATIO of a step of its decodes alone, so a long prompt goes in
chunk by chunk beside the others' decodes. The waiting run of the least-charged user
goes first (ties: arrival) when joining a full batch or when another pool is to be
served; a run that has taken SLICE_TOKENS tokens gives its seat up to such a user, and
a pool is left after SLICE_SECONDS for one, so no DECODE holds the device forever. A
run that gave its place up rejoins where it was. Whoever makes a pool switch, reopen
or rebuild pays for it, never the users it pauses.

Requests (requests.py, which serve/ submits to) are runs too, of short-lived agents in
request pools: they carry their sampler settings and a per-token callback (stop strings,
streaming, logprobs), and one whose opening a running request of its owner is decoding
waits for it and forks its cells (kvcache/device.py) instead of decoding the same tokens beside it.

Nothing else touches the pools' contexts: RESET, UNREGISTER and close hand the thread
closures (`call`) that run between two steps, once the agent they name has no DECODE in
flight. A cancelled or failed DECODE is rolled back alone: the other runs go on.

This module holds the thread, its queues and the endings of a run; each round it
chooses and seats (seating.py), then plans one step, runs it and applies it (step.py).
The records it keeps are in runs.py.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

from ..batch import Batch
from ..kvcache.costs import Costs
from .policy import Policy, StepCost
from .pool import Pool, PoolKey
from .runs import Run, Stopping, StepTally
from .seating import Seating
from .step import Steps

log = logging.getLogger("lmxd")

#: An idle scheduler that is woken waits until DECODEs stop arriving (this long apart, at
#: most GATHER_MAX): agents that send at once start in one step, not one step each.
GATHER_GAP = 0.002
GATHER_MAX = 0.02
#: A scheduler with waiting runs none of which can run now checks again after this long
#: (or as soon as a DECODE, an operation or an own context arrives).
IDLE_WAIT = 0.005


class Host(Protocol):
    """What the scheduler asks of the conductor that owns it (agents.py's Conductor), on
    the scheduler's thread: the ledgers, the agents' table and their conversations stay
    the conductor's."""

    def open_pool(self, key: PoolKey, loaded) -> Pool:
        """A pool for `key`, lent what books memory (not yet open)."""

    def agents_of(self, key: PoolKey, sizing_for: set[int] | None = None) -> list:
        """The agents a pool of `key` is sized for."""

    def begin(self, run: Run) -> None:
        """The run's prompt as tokens (run.feed), checked against its context."""

    def finished(self, run: Run) -> None:
        """A run has ended (a request leaves its cells as cache)."""

    def book_excess(self, pool: Pool, agents: list) -> bool:
        """Book the pool's cells beyond its agents' bookings; False when they do not fit."""

    def own_context(self, pool: Pool, run: Run) -> bool:
        """Seat the run's agent in a context of its owner's own instead; True: it waits for it."""

    def forget_conversation(self, agent) -> None:
        """The agent's conversation is gone (a failed roll-back)."""

    def reset_error(self, agent, exc: Exception) -> Exception:
        """The error a run gets when its roll-back failed."""

    def rewind_paused(self, agent) -> None:
        """A DECODE was undone while its agent was paused."""


class _Op:
    def __init__(self, fn: Callable, agent):
        self.fn, self.agent = fn, agent
        self.done, self.result, self.error = threading.Event(), None, None


class Scheduler(Seating, Steps):
    """host: the conductor, which lends the pools what books memory (open_pool) and
    turns a run's prompt into tokens (begin): all it is asked is `Host`."""

    def __init__(self, host: Host, policy: Policy | None = None):
        self.host = host
        self.policy = policy or Policy()
        self._costs: dict[PoolKey, StepCost] = {}   # per pool key: its steps' fitted cost
        self.tally: dict[PoolKey, StepTally] = {}    # per pool key: its steps, counted for /metrics
        self._swap_costs: dict[PoolKey, Costs] = {}  # per pool key: a preempted request's KV to host and back
        self.preempt_by = "cost"     # or "swap" / "recompute" always (bench serve --scenarios preempt)
        self._cv = threading.Condition()
        self._waiting: list[Run] = []
        self._batch: list[Run] = []
        self._ops: deque[_Op] = deque()
        self._arrivals = itertools.count()
        self.pools: dict[PoolKey, Pool] = {}
        self.live: Pool | None = None
        self._turn_began = 0.0
        self._switch_evicted = None
        self._closed = False
        self._deadline: float | None = None
        self._exit = False
        self._thread: threading.Thread | None = None
        self._step_batch: Batch | None = None
        self._last_arrival = 0.0
        self._stalled: set[PoolKey] = set()   # pools whose waiting runs could not be seated, since the last change

    # ---- the request threads' side ----------------------------------------------------------
    def submit(self, run: Run) -> None:
        """Queue `run` and wait for its reply (run.done)."""
        self.enqueue(run)
        run.done.wait()

    def enqueue(self, run: Run) -> None:
        """Queue `run`; run.done is set when it has ended. Raises Stopping once closed."""
        with self._cv:
            if self._closed:
                raise Stopping()
            active = self._active()
            if run.owner not in active:
                self.policy.arrive(run.owner, active)
            run.arrival = next(self._arrivals)
            self._last_arrival = time.monotonic()
            self._stalled.clear()
            self._waiting.append(run)
            self._start()
            self._cv.notify_all()

    def call(self, fn: Callable, agent=None):
        """Run fn() on the scheduler's thread between two steps, once `agent` (if given)
        has no DECODE queued or running; returns its result or raises its exception."""
        if threading.current_thread() is self._thread:
            return fn()
        op = _Op(fn, agent)
        with self._cv:
            self._ops.append(op)
            self._start()
            self._cv.notify_all()
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def waiting(self, uid: int | None = None) -> int:
        with self._cv:
            return sum(1 for r in self._waiting if uid is None or r.owner == uid)

    def decoding(self) -> list:
        """The agents in the batch now."""
        with self._cv:
            return [r.agent for r in self._batch]

    def close(self, grace_s: float) -> None:
        """Stop: queued DECODEs that have not begun are CANCELLED now, the running ones
        within grace_s (rolled back like a disconnect)."""
        with self._cv:
            self._closed, self._deadline = True, time.monotonic() + grace_s
            self._cv.notify_all()

    def stop(self) -> None:
        """End the thread (after every pool was closed through call())."""
        with self._cv:
            self._exit = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def forget_model(self, loaded) -> None:
        """The model `loaded` is about to be freed (its last agent left): free its pools'
        contexts first. Pools of the same file loaded afresh since are another model's."""
        self.drop([k for k, pool in self.pools.items() if pool.loaded is loaded])

    def drop(self, keys: list[PoolKey]) -> None:
        """Free these pools' contexts without pausing anyone: nobody is left in them."""
        for key in keys:
            pool = self.pools.pop(key)
            pool.discard()
            if self.live is pool:
                self.live = None

    def adopt(self, pool: Pool) -> None:
        """(On this thread.) Serve `pool`, opened elsewhere (a user's own context: own.py)
        in place of the pool of its key, whose agents are paused (their runs wait to
        rejoin: in `pool`)."""
        old = self.pools.get(pool.key)
        if old is not None and old.is_open:
            if self.live is old:
                for run in list(self._batch):
                    self._to_waiting(run)
                self.live = None
            old.close()
        pool.prefill_row_s = self._cost(pool).prompt_row_seconds
        self.pools[pool.key] = pool

    def detach(self, key: PoolKey) -> Pool | None:
        """(On this thread.) Stop serving pool `key` (nobody is left in it); the caller
        frees its context."""
        pool = self.pools.pop(key, None)
        if self.live is pool:
            self.live = None
        return pool

    def shrink(self, key: PoolKey, agents: list, owner: int) -> None:
        """An agent of `owner` left pool `key` (on this thread; `agents`: those left). If
        the pool holds more than one agent's n_ctx beyond what they booked, it is made
        smaller at `owner`'s cost (unless other users' agents sit in it and the ledger can
        book its spare cells as the pool's until it closes: Conductor.book_excess):
        closed at once when no DECODE runs in it (its agents paused; the next DECODE
        opens it to size), else rebuilt before its next step."""
        pool = self.pools.get(key)
        if pool is None or not pool.is_open or not pool.oversized(agents):
            return
        if any(s.agent.owner != owner for s in pool.seats.values()) and self.host.book_excess(pool, agents):
            return                 # others sit in it: its spare cells booked, nobody paused for the leaver
        if not any(r.pool_key == key for r in self._waiting + self._batch):
            t0 = time.perf_counter()
            pool.close()           # idle: its agents wait in host RAM; the next DECODE opens it to size
            if self.live is pool:
                self.live = None
            self._charge({owner: time.perf_counter() - t0})
        else:        # (as rare as the reopens that grew it: policy.reopen)
            pool.resize = True
            pool.rebuild_by[owner] = pool.rebuild_by.get(owner, 0) + 1

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lmxd-scheduler", daemon=True)
            self._thread.start()

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._ready_ops() or self._waiting or self._batch or self._exit):
                    self._cv.wait(timeout=0.5 if self._ops else None)
                if self._exit and not self._ops:
                    return
                ops = self._ready_ops()
                for op in ops:
                    self._ops.remove(op)
            for op in ops:
                self._run_op(op)
            try:
                if not self._tick() and all(r.pool_key in self._stalled for r in self._waiting):
                    with self._cv:     # nothing can run (runs wait for room): until something changes
                        self._cv.wait(IDLE_WAIT)
            except Exception:      # a bug, not a request's failure: keep serving the others
                log.exception("scheduler step failed")
                for run in self._waiting + self._batch:
                    self._finish(run, error=RuntimeError("the scheduler failed; see the daemon's log"))

    def _ready_ops(self) -> list[_Op]:
        """Closures that may run now: their agent has no DECODE queued or running, and their
        owner is not sitting steps out (a loop of REGISTER/UNREGISTER or RESET is device
        time like a DECODE's, and waits its turn the same way)."""
        busy = {id(r.agent) for r in self._waiting + self._batch}
        stepping = {r.owner for r in self._batch}     # (users whose DECODEs wait for a seat do not count)
        return [op for op in self._ops if op.agent is None or (
            id(op.agent) not in busy and op.agent.owner in self.policy.stepping(stepping | {op.agent.owner}))]

    def _run_op(self, op: _Op) -> None:
        """Run a closure between steps; its time is charged to its agent's owner (a RESET
        loop is device time like any other)."""
        t0 = time.perf_counter()
        try:
            op.result = op.fn()
        except BaseException as exc:
            op.error = exc
        if op.agent is not None:
            self._charge({op.agent.owner: time.perf_counter() - t0})
        self._stalled.clear()
        op.done.set()

    def _tick(self) -> bool:
        """One round: the pool to serve, its waiting runs seated, one step. False when no
        run could be stepped."""
        if not self._batch:
            self._gather()
        self._drop_stopped()
        pool = self._choose_pool()
        if pool is None:
            return False
        if pool is not self.live or not pool.is_open or pool.stale:
            try:   # (a stale pool is rebuilt: its cells are out of order, or it is oversized)
                self._switch(pool, pool.rebuild_by if pool.is_open and pool.stale else self._payer_of(pool))
            except Exception as exc:   # its context could not be made: its DECODEs fail, not the rest
                log.exception("opening a pool failed")
                self.live = None
                for run in [r for r in self._waiting if r.pool_key == pool.key]:
                    if run.began:
                        self._fail(run, exc)
                    else:
                        self._finish(run, error=exc)
                return True
        self._join()
        if self._batch:
            self._reserve(self.live)
        if not self._batch:
            self._stalled.add(pool.key)      # its runs wait (for room, a reopen's turn): serve another
            return False
        self._step()
        return True

    def _gather(self) -> None:
        woke = time.monotonic()
        while time.monotonic() - self._last_arrival < GATHER_GAP and time.monotonic() - woke < GATHER_MAX:
            time.sleep(GATHER_GAP / 2)

    def _drop_stopped(self) -> None:
        past = self._deadline is not None and time.monotonic() >= self._deadline
        for run in list(self._waiting + self._batch):
            if self._closed and not run.began:
                self._finish(run, error=Stopping())
            elif past or run.asked.should_stop():
                self._cancel(run)

    def _cost(self, pool: Pool) -> StepCost:
        return self._costs.setdefault(pool.key, StepCost())

    def _charge(self, costs: dict[int, float]) -> None:
        self.policy.charge(costs, self._active())

    # ---- endings ------------------------------------------------------------------------------
    def _finish(self, run: Run, error: BaseException | None = None) -> None:
        self._stalled.clear()              # room may have freed for a run that waits
        with self._cv:
            if run in self._batch:
                self._batch.remove(run)
            if run in self._waiting:
                self._waiting.remove(run)
        if run.sampler is not None:
            run.sampler.close()
            run.sampler = None
        if run.constraint is not None:
            run.constraint.close()
            run.constraint = None
        run.agent.last_used = time.monotonic()
        self.policy.seen(run.owner)
        run.error = error
        self.host.finished(run)
        run.done.set()

    def _cancel(self, run: Run) -> None:
        """The client left or the daemon stops: the DECODE is undone."""
        try:
            if run.began:
                self._roll_back(run)
        except Exception as exc:
            self._finish(run, error=exc)
            return
        run.cancelled = True
        self._finish(run)

    def _fail(self, run: Run, exc: BaseException) -> None:
        try:
            self._roll_back(run)
        except Exception as reset:
            exc = reset
        self._finish(run, error=exc)

    def _roll_back(self, run: Run) -> None:
        """Put the agent back as it was before the DECODE, seated or paused."""
        agent = run.agent
        agent.history, agent.pending = agent.history[:run.n_history], run.pending
        pool = self.pools.get(run.pool_key)        # (a request pool may be open but not live)
        seat = pool.seat_of(agent) if pool is not None and pool.is_open else None
        if seat is not None:
            try:
                pool.trim(seat, run.n_history)
            except Exception as exc:
                pool.unseat(agent, pause=False)
                self.host.forget_conversation(agent)
                raise self.host.reset_error(agent, exc) from exc
        else:
            self.host.rewind_paused(agent)
