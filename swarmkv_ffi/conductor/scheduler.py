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
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..batch import Batch
from ..grammar import Compiled, Constraint, GrammarError
from ..sampler import Sampler, logprobs
from .common_prompts import PromptTrie
from .policy import SLICE_SECONDS, Policy, StepCost
from .pool import Kind, NoRoom, Pool, PoolKey, pool_key
from ..kvcache.costs import Costs
from ..kvcache.thresholds import HOST_MIN, WAIT_FOR_PREFIX

log = logging.getLogger("lmxd")

SLICE_TOKENS = 32
#: An idle scheduler that is woken waits until DECODEs stop arriving (this long apart, at
#: most GATHER_MAX): agents that send at once start in one step, not one step each.
GATHER_GAP = 0.002
GATHER_MAX = 0.02
#: A scheduler with waiting runs none of which can run now checks again after this long
#: (or as soon as a DECODE, an operation or an own context arrives).
IDLE_WAIT = 0.005
#: A reopen for a newly registered agent (one that found no room for a context of its own)
#: waits up to this long for other users' DECODEs under way in the pool to end first.
REOPEN_WAIT = 2.0


class Stopping(Exception):
    """The daemon is stopping: this DECODE was not run."""


@dataclass
class Run:
    """One DECODE, from its arrival to its reply."""
    agent: object
    owner: int
    prompt: str
    max_tokens: int
    should_stop: Callable[[], bool]
    arrival: int = 0
    began: bool = False
    feed: list[int] = field(default_factory=list)   # tokens for the next steps, not in history yet
    prompt_tokens: int = 0
    n_history: int = 0            # the history's length before the DECODE (for a roll-back)
    pending: int | None = None    # the agent's pending token before the DECODE
    generated: list[int] = field(default_factory=list)
    stopped_on_eog: bool = False
    cancelled: bool = False
    error: BaseException | None = None
    evicted: object | None = None     # the agent paused to make room for this one
    restored: bool = False
    forked: bool = False
    tier: str | None = None       # where a request's cached opening came from (pool.Entry.tier)
    stepped: bool = False         # it has been in a step (its prompt is no longer whole)
    slices: int = 0
    slice_tokens: int = 0
    batch_max: int = 0
    queued_s: float = 0.0
    swap_s: float = 0.0
    since: float = field(default_factory=time.perf_counter)   # when it last began waiting
    sampler: Sampler | None = None
    sampling: dict = field(default_factory=dict)   # Sampler settings (temp, top_p, seed)
    top_logprobs: int | None = None   # report each token's logprob and this many alternatives
    grammar: "str | Compiled | None" = None   # the output must follow it (grammar.py); constraint: its state
    constraint: Constraint | None = None
    completed: bool = False       # the grammar allowed nothing more: the output is whole
    on_token: Callable | None = None  # (token, logprobs or None) after each one; False ends the run
    cached: int = 0               # prompt tokens whose cells were forked, not decoded (a request)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def pool_key(self) -> PoolKey:
        return pool_key(self.agent)


class _Op:
    def __init__(self, fn: Callable, agent):
        self.fn, self.agent = fn, agent
        self.done, self.result, self.error = threading.Event(), None, None


@dataclass
class StepTally:
    """A pool's steps since it opened, for operators (serve's /metrics): how many, the
    rows they carried, their seconds, and how many steps carried each number of decode rows."""
    steps: int = 0
    decode_rows: int = 0
    prompt_rows: int = 0
    seconds: float = 0.0
    by_decode_rows: dict[int, int] = field(default_factory=dict)
    preemptions: int = 0         # requests that gave their cells up for others to grow
    swapped: int = 0             # of those, how many kept their KV in host RAM (not re-read)

    def step(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        self.steps += 1
        self.decode_rows += decode_rows
        self.prompt_rows += prompt_rows
        self.seconds += seconds
        self.by_decode_rows[decode_rows] = self.by_decode_rows.get(decode_rows, 0) + 1


class Scheduler:
    """host: the conductor, which lends the pools what books memory (open_pool) and
    turns a run's prompt into tokens (begin)."""

    def __init__(self, host, policy: Policy | None = None):
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
        """(On this thread.) Serve `pool`, opened elsewhere (a user's own context: agents.py)
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
            elif past or run.should_stop():
                self._cancel(run)

    # ---- which pool, which runs ------------------------------------------------------------
    def _order(self, run: Run) -> tuple[float, int]:
        return self.policy.key(run.owner), run.arrival

    def _active(self) -> set[int]:
        return {r.owner for r in self._waiting + self._batch}

    def _payer_of(self, pool: Pool) -> dict[int, float]:
        """Who a switch to `pool` serves: the first of its waiting runs pays for it."""
        runs = [r for r in self._waiting if r.pool_key == pool.key]
        return {min(runs, key=self._order).owner: 1.0} if runs else {}

    def _choose_pool(self) -> Pool | None:
        """The live pool while its turn lasts (SLICE_SECONDS); then the pool of the first
        waiting run (least time used, then arrival) if it comes before every run in the
        batch: another user who has used less, or the same user's older DECODE. A pool
        whose waiting runs could not be seated (waiting for room, or for their user's
        next reopen) is passed over, until something changes, while another has runs."""
        if not self._waiting and not self._batch:
            return None
        ready = [r for r in self._waiting if r.pool_key not in self._stalled] or self._waiting
        elsewhere = [r for r in ready if self.live is None or r.pool_key != self.live.key]
        if not self._batch:
            return self._pool(min(ready, key=self._order))
        if not elsewhere or time.monotonic() - self._turn_began < SLICE_SECONDS:
            return self.live
        best = min(elsewhere, key=self._order)
        return self._pool(best) if self._order(best) < min(map(self._order, self._batch)) else self.live

    def _pool(self, run: Run) -> Pool:
        key = run.pool_key
        if key not in self.pools:
            pool = self.pools[key] = self.host.open_pool(key, run.agent.loaded)
            pool.prefill_row_s = self._cost(pool).prompt_row_seconds
        return self.pools[key]

    def _switch(self, pool: Pool, payers: dict[int, float]) -> None:
        """Make `pool` live: the batch leaves (its runs wait to rejoin). A request pool
        stays open, its requests seated, its kept cells kept (its cells are booked whole
        by its reservation, its compute buffer with it), and so does a conversations' pool
        while a request pool is live (each pool books its own compute buffer: agents.py),
        so requests and conversations of one model take turns without rebuilding each
        other. Between lmxd's conversations' pools the seed's time-slicing stays: the one
        that was live has its agents paused to host RAM and its context freed, unless one
        of the two is a user's own context (booked apart: agents.py). `pool`,
        unless open (or if stale: rebuilt), opens sized for its agents that have DECODEd
        and every agent of `payers` (uid -> weight), who are charged its time."""
        t0 = time.perf_counter()
        for run in list(self._batch):
            self._to_waiting(run)
        left = self.live
        if left is not None and left.is_open and (left is pool or self._time_sliced(left, pool)):
            last = left.last
            paused = left.close()
            self._switch_evicted = last if last in paused else (paused[-1] if paused else None)
        self.live = pool
        if not pool.is_open:
            pool.open(self.host.agents_of(pool.key, sizing_for=set(payers)))
        self._turn_began = time.monotonic()
        cost = time.perf_counter() - t0
        for run in self._waiting:
            if run.pool_key == pool.key:
                run.swap_s += cost
        self._charge(self.policy.by_rows(payers, cost))

    @staticmethod
    def _time_sliced(left: Pool, pool: Pool) -> bool:
        """Whether serving `pool` closes `left`: both are shared conversations' pools."""
        return not (left.fixed or pool.fixed or left.key.alone or pool.key.alone)

    def _to_waiting(self, run: Run) -> None:
        if run in self._batch:
            self._batch.remove(run)
        run.since = time.perf_counter()
        self._waiting.append(run)

    def _join(self) -> None:
        """Seat the waiting runs of the live pool, the least-used user first; one DECODE of
        an agent at a time."""
        pool = self.live
        busy = {id(r.agent) for r in self._batch}
        held_back = False      # a preempted request waits for room: none after it takes that room
        for run in sorted((r for r in self._waiting if r.pool_key == pool.key), key=self._order):
            if held_back or id(run.agent) in busy or self._earlier_run_of(run) or self._prefix_coming(pool, run):
                continue
            if pool.seat_of(run.agent) is None and not self._make_room(pool, run):
                held_back = run.agent.preempted
                continue
            busy.add(id(run.agent))
            self._waiting.remove(run)
            run.queued_s += time.perf_counter() - run.since
            t0 = time.perf_counter()
            try:
                if pool.seat_of(run.agent) is None:
                    entry = pool.seat(run.agent)
                    if entry.restored and entry.tier is None and run.agent.kind is Kind.REQUEST:
                        self._swap_cost(pool).observe(len(run.agent.history), entry.swap_s)   # back from a swap
                    run.swap_s += entry.swap_s
                    run.restored |= entry.restored
                    run.forked |= entry.forked
                    run.tier = run.tier if run.began else entry.tier
                if not run.began:
                    self.host.begin(run)
                    run.evicted = run.evicted or self._switch_evicted
                    run.sampler = Sampler(**run.sampling, n_vocab=run.agent.loaded.model.n_vocab)
                    if run.grammar is not None:
                        run.constraint = Constraint(run.agent.loaded.model, run.grammar)
            except Exception as exc:
                self._finish(run, error=exc)
                continue
            finally:     # seating and tokenizing are the scheduler's time too, failed or not
                self._charge({run.owner: time.perf_counter() - t0})
            run.slices += 1
            run.slice_tokens = 0
            self._batch.append(run)
        self._switch_evicted = None

    def _earlier_run_of(self, run: Run) -> bool:
        return any(r.agent is run.agent and r.arrival < run.arrival for r in self._waiting)

    @staticmethod
    def _prefix_coming(pool: Pool, run: Run) -> bool:
        """A request whose opening a running request is decoding right now waits for it
        and forks its cells (kvcache/device.py): requests sent together over one document prefill
        it once."""
        agent = run.agent
        if agent.kind is not Kind.REQUEST or agent.history or pool.seat_of(agent) is not None:
            return False
        return pool.coming(agent) >= pool.match(agent)[0] + WAIT_FOR_PREFIX

    def _make_room(self, pool: Pool, run: Run) -> bool:
        """Free a seat for `run`'s agent. If agents were registered since the pool opened and
        its owner's own idle seats cannot make room while another user's agent sits here,
        the agent decodes in a context of its owner's own (agents.py: the run waits for
        it), pausing nobody. Else pause idle residents (its owner's own first, then the
        least recently used of others: freely those of users holding as many cells, the
        rest as often as its owner may reopen a pool; charged to `run`'s owner); or reopen
        the pool larger for agents registered since it opened (no room in the ledger for
        an own context: once no other user's DECODE is under way here; its runs rejoin at
        once); else, if the batch is full of runs whose slice is over, the one of the user
        who has used the most gives its seat up. False when `run` must wait."""
        if pool.fixed is not None and not pool.seats and not pool.could_hold(run.agent):
            self._finish(run, error=NoRoom(pool.no_room(run.agent)))   # it could never run to its end
            return False
        if pool.fits(run.agent) or (pool.cache.kept and pool.evict_for(run.agent)):
            return True
        if pool.fixed is not None and not pool.seats and not pool.fits_after_flush(run.agent):
            self._finish(run, error=NoRoom(pool.no_room(run.agent)))   # nothing will free
            return False
        seqs, cells = pool.need(run.agent)
        if pool.fits_after_flush(run.agent):
            pool.flush_tombs()     # the cells others left behind: freed, and the pool rebuilt at their cost
            if pool.stale:
                self._switch(pool, pool.rebuild_by)
            return pool.fits(run.agent)
        undersized = pool.undersized(self.host.agents_of(pool.key, sizing_for={run.owner}))
        idle = self._idle_seats(pool, run.owner)
        if undersized and not self._room(pool, [s for s in idle if s.agent.owner == run.owner], seqs, cells) \
                and self.host.own_context(pool, run):
            return False       # it decodes in a context of its owner's own (agents.py), pausing nobody
        idle = self._pausable(pool, run, idle, seqs, cells)
        if self._room(pool, idle, seqs, cells):
            t0 = time.perf_counter()
            for seat in idle:          # pausing them all would make room: pause only as many as needed
                pool.unseat(seat.agent, pause=True)
                run.evicted = run.evicted or seat.agent
                if pool.fits(run.agent):
                    break
            self._charge({run.owner: time.perf_counter() - t0})
            return True
        if undersized:
            if self._others_under_way(pool, run) or not self.policy.reopen(run.owner):
                return False       # not in another user's DECODE, nor too often a minute: it waits
            self._switch(pool, {run.owner: 1.0})     # agents registered since it opened: reopen it larger
            return pool.fits(run.agent)
        done = [r for r in self._batch if r.slice_tokens >= SLICE_TOKENS
                and self.policy.key(r.owner) > self.policy.key(run.owner)]
        if done:
            self._to_waiting(max(done, key=self._order))
        return False

    @staticmethod
    def _room(pool: Pool, seats: list, seqs: int, cells: int) -> bool:
        """Whether pausing `seats` would leave `seqs` sequences and `cells` cells free."""
        return len(pool.free_seqs) + len(seats) >= seqs and pool.cells_free + sum(s.cells for s in seats) >= cells

    def _others_under_way(self, pool: Pool, run: Run) -> bool:
        """Whether another user has a DECODE under way in `pool` that a reopen for `run`
        would interrupt (for at most REOPEN_WAIT seconds of `run`'s wait: then it goes)."""
        if time.perf_counter() - run.since > REOPEN_WAIT:
            return False
        return any(r.began and r.owner != run.owner and r.pool_key == pool.key
                   for r in self._batch + self._waiting)

    def _idle_seats(self, pool: Pool, owner: int) -> list:
        """The seats in `pool` with no run in the batch: `owner`'s first, then the least
        recently used."""
        in_batch = {id(r.agent) for r in self._batch}
        return sorted((s for s in pool.seats.values() if id(s.agent) not in in_batch),
                      key=lambda s: (s.agent.owner != owner, s.agent.last_used))

    def _pausable(self, pool: Pool, run: Run, idle: list, seqs: int, cells: int) -> list:
        """Of the `idle` seats (_idle_seats), those `run` may pause for a seat. Those of
        users who hold as many cells as `run`'s owner would may always be paused; pausing
        a user who holds fewer costs it a swap it did not cause, so it counts as a reopen
        (policy.reopen)."""
        held: dict[int, int] = {}
        for seat in pool.seats.values():
            held[seat.agent.owner] = held.get(seat.agent.owner, 0) + seat.cells
        mine = held.get(run.owner, 0) + cells
        free = [s for s in idle if s.agent.owner == run.owner or held[s.agent.owner] >= mine]
        if len(free) == len(idle):
            return idle
        if self._room(pool, free, seqs, cells):
            return free
        if self.policy.reopen(run.owner):
            return idle
        return free

    # ---- requests' cells as they grow ----------------------------------------------------------
    def _reserve(self, pool: Pool) -> None:
        """Every request in the batch has cells booked for what this step adds to it (a
        fast request pool books RESERVE at a time, pool.py): where the pool has none left,
        the request that comes last (its user has used the most, then the newest) gives
        its cells up and waits, to re-read its tokens when it can book all it may need."""
        if pool.fixed is None or pool.exact:
            return
        for run in sorted(self._batch, key=self._order):
            if run not in self._batch:
                continue                       # preempted for an earlier one
            upto = len(run.agent.history) + len(run.feed)
            while not pool.grow(pool.seat_of(run.agent), upto):
                victim = max(self._batch, key=self._order)
                self._preempt(pool, victim)
                if victim is run:
                    break

    def _preempt(self, pool: Pool, run: Run) -> None:
        """Free the run's cells (what others forked of them stays) and put it back to wait,
        its KV copied to host RAM when that is cheaper than re-reading it (_swap_pays)."""
        swap = self._swap_pays(pool, run)
        run.agent.preempted = True
        t0 = time.perf_counter()
        pool.unseat(run.agent, pause=swap)
        tally = self.tally.setdefault(pool.key, StepTally())
        tally.preemptions += 1
        if run.agent.saved is not None:
            self._swap_cost(pool).observe(len(run.agent.history), time.perf_counter() - t0)
            tally.swapped += 1
        self._to_waiting(run)

    def _swap_pays(self, pool: Pool, run: Run) -> bool:
        """Whether a preempted request should keep its KV in host RAM (the swap ledger's,
        as a paused conversation does) rather than re-read its tokens when it comes back:
        when copying them out and back (measured: the pool's swaps so far; tried while
        unmeasured) costs less than prefilling what it would re-read (measured: the pool's
        prompt rows). Never for a request that shares a long prefix with another sequence:
        it forks it again on its return, and a restored copy would hold those cells twice."""
        seat = pool.seat_of(run.agent)
        tokens, shared = seat.kv_len, pool.shared(seat.seq)
        if tokens != len(run.agent.history) or self.preempt_by == "recompute":
            return False
        if self.preempt_by == "swap":
            return True
        if shared >= HOST_MIN:
            return False
        prefill, swap = self._cost(pool).prompt_row_seconds(), self._swap_cost(pool).per_token()
        return prefill is not None and (swap is None or 2 * swap * tokens < prefill * (tokens - shared))

    def _swap_cost(self, pool: Pool) -> Costs:
        return self._swap_costs.setdefault(pool.key, Costs())

    # ---- one step ---------------------------------------------------------------------------
    def _step(self) -> None:
        """One llama_decode for the batch: one token of each decoding run, then prompts and
        re-reads (DECODEs starting together from one point with their common tokens once,
        common_prompts.py), the shortest first, in what the step cap leaves (policy.py:
        kept within its ratio of the decode rows alone, or, with none, of the shortest
        prompt alone); each user is charged the step's time by the rows it put in, and
        the host work on its rows after it (sampling, logprobs, its callbacks) as measured."""
        pool = self.live
        ctx = pool.ctx
        if self._step_batch is None or self._step_batch.capacity != ctx.n_batch \
                or self._step_batch.n_seq_max != ctx.n_seq_max:
            self._step_batch = Batch(ctx.n_batch, ctx.n_seq_max)
        batch, plan, rows = self._step_batch.clear(), [], {}
        runs = self._in_step()
        decoding = [r for r in runs if self._input_len(pool, r) == 1]
        prompts = sorted((r for r in runs if self._input_len(pool, r) > 1),
                         key=lambda r: (self._input_len(pool, r), self._order(r)))
        # The rows whose pace the cap keeps: the decode rows; with none, the shortest
        # prompt when two users' prompts share the step; else none (then a step stays
        # short, so a user coming back meets no 512-row step in flight).
        several = len({r.owner for r in runs}) > 1
        base = len(decoding) or (min(self._input_len(pool, r) for r in prompts) if several else 0)
        room = min(ctx.n_batch, self.policy.step_rows(self._cost(pool), base, ctx.n_batch,
                                                       self.policy.sharing(self._active())))
        for run in decoding:
            room -= self._add_input(pool, batch, plan, rows, run, room)
        groups, rest = self._starting_together(pool, prompts)
        for group in groups:
            trie = PromptTrie([(id(run), seat.seq, run.feed) for run, seat in group])
            if trie.size > room:
                rest += [run for run, _ in group]
                continue
            found = trie.add_to(batch, group[0][1].kv_len)
            plan += [(run, seat, len(run.feed), found[id(run)]) for run, seat in group]
            rows[group[0][0].owner] = rows.get(group[0][0].owner, 0) + trie.size
            room -= trie.size
        for run in rest:
            room -= self._add_input(pool, batch, plan, rows, run, room)
        if not plan:
            return
        t0 = time.perf_counter()
        try:
            ctx.decode(batch)
        except Exception as exc:
            for run, *_ in plan:
                self._fail(run, exc)
            return
        seconds = time.perf_counter() - t0
        decode_rows = sum(n for run, _, n, _ in plan if run in decoding)
        self._cost(pool).observe(decode_rows, batch.n_tokens - decode_rows, seconds)
        self.tally.setdefault(pool.key, StepTally()).step(decode_rows, batch.n_tokens - decode_rows, seconds)
        self._charge(self.policy.by_rows(rows, seconds))
        host: dict[int, float] = {}      # each owner's sampling, logprobs, stop strings, cache
        for run, seat, n, row in plan:
            run.batch_max = max(run.batch_max, len(plan))
            run.stepped = True
            self._advance(run, seat, n)
            pool.last = run.agent
            if row >= 0:
                t1 = time.perf_counter()
                self._sample(run, ctx, row)
                host[run.owner] = host.get(run.owner, 0.0) + time.perf_counter() - t1
        self._charge(host)

    def _add_input(self, pool: Pool, batch, plan: list, rows: dict, run: Run, room: int) -> int:
        """Put up to `room` of the run's next input tokens into the batch; returns how many."""
        seat = pool.seat_of(run.agent)
        wanted = run.agent.history[seat.kv_len:] + run.feed
        take = wanted[:max(0, room)]
        if not take:
            return 0
        last = len(take) == len(wanted)
        row = batch.add_sequence(take, seat.kv_len, seat.seq, logits_last=last)
        plan.append((run, seat, len(take), row if last else -1))
        rows[run.owner] = rows.get(run.owner, 0) + len(take)
        return len(take)

    def _cost(self, pool: Pool) -> StepCost:
        return self._costs.setdefault(pool.key, StepCost())

    def _in_step(self) -> list[Run]:
        """The runs this step serves: all of them, but those of a user more than
        SLICE_SECONDS ahead of the least-charged user in the batch (policy.stepping), so
        one user's many DECODEs cannot take the device from another's one."""
        stepping = self.policy.stepping({r.owner for r in self._batch})
        return [r for r in self._batch if r.owner in stepping]

    def _starting_together(self, pool: Pool, runs: list[Run]) -> tuple[list[list], list[Run]]:
        """Groups (two or more) of (run, seat) of one user taking their first step from the
        same point (a fresh conversation, or exactly their shared document) whose prompts
        may share tokens; the other runs. Never across users: a step that took a shared
        opening once would be faster, and its time would tell one user another's prompt."""
        groups: dict = {}
        rest = []
        for run in runs:
            agent, seat = run.agent, pool.seat_of(run.agent)
            base = agent.prefix.n_tokens if agent.prefix is not None else 0
            if run.stepped or seat.kv_len != len(agent.history) or len(agent.history) != base:
                rest.append(run)
            else:
                groups.setdefault((run.owner, agent.prefix.key if agent.prefix else None), []).append((run, seat))
        shared = []
        for group in groups.values():
            if len(group) > 1:
                shared.append(group)
            else:
                rest.append(group[0][0])
        return shared, rest

    @staticmethod
    def _input_len(pool: Pool, run: Run) -> int:
        return len(run.agent.history) - pool.seat_of(run.agent).kv_len + len(run.feed)

    @staticmethod
    def _advance(run: Run, seat, n: int) -> None:
        """n more tokens of the run's input have their KV in the sequence."""
        agent = run.agent
        from_feed = max(0, n - (len(agent.history) - seat.kv_len))
        agent.history += run.feed[:from_feed]
        del run.feed[:from_feed]
        seat.kv_len += n

    def _sample(self, run: Run, ctx, row: int) -> None:
        """The run's next token from its row: under its grammar's mask if it has one
        (its next mask is then computed while the next decode runs). A grammar that fails
        fails its own run, never the step of the others."""
        try:
            if run.constraint is not None:
                run.constraint.apply(ctx.logits(row))
            token = run.sampler.sample(ctx, row)
            model = run.agent.loaded.model
            if model.is_eog(token):
                run.stopped_on_eog = True
                self._finish(run)
                return
            if run.constraint is not None:
                run.constraint.accept(token)
                run.completed = run.constraint.finished
        except GrammarError as exc:
            self._fail(run, exc)
            return
        run.generated.append(token)
        run.slice_tokens += 1
        more = True
        if run.on_token is not None:
            ranked = None if run.top_logprobs is None else logprobs(ctx.logits(row), token, run.top_logprobs)
            more = run.on_token(token, ranked)
        if not more or run.completed or len(run.generated) >= run.max_tokens:
            run.agent.pending = token       # decoded with the next prompt
            self._finish(run)
        else:
            run.feed = [token]

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
