"""Which pool the scheduler serves and which runs sit in its batch: the choice between
pools (fair by owner's time, policy.py), seating a run (making room: pausing idle seats,
an own context, a reopen, a slice given up), and a request's cells as it grows (the
preemption that frees them, by swap or re-read, whichever the measured costs say).

`Seating` is a part of the Scheduler (scheduler.py holds the state it reads: pools,
live, _batch, _waiting, policy, host).
"""
from __future__ import annotations

import time

from ..grammar import Constraint
from ..kvcache.costs import Costs
from ..kvcache.thresholds import HOST_MIN, WAIT_FOR_PREFIX
from ..sampler import Sampler
from .policy import SLICE_SECONDS
from .pool import NoRoom, Pool
from .runs import Run, StepTally

SLICE_TOKENS = 32
#: A reopen for a newly registered agent (one that found no room for a context of its own)
#: waits up to this long for other users' DECODEs under way in the pool to end first.
REOPEN_WAIT = 2.0


class Seating:
    """The Scheduler's choice of pool and of runs to seat."""

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
        while a request pool is live (each pool books its own compute buffer: booking.py),
        so requests and conversations of one model take turns without rebuilding each
        other. Between lmxd's conversations' pools the seed's time-slicing stays: the one
        that was live has its agents paused to host RAM and its context freed, unless one
        of the two is a user's own context (booked apart: own.py). `pool`,
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
                run.figures.swap_s += cost
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
            run.figures.queued_s += time.perf_counter() - run.since
            t0 = time.perf_counter()
            try:
                if pool.seat_of(run.agent) is None:
                    entry = pool.seat(run.agent)
                    if entry.restored and entry.tier is None and pool.key.requests:
                        self._swap_cost(pool).observe(len(run.agent.history), entry.swap_s)   # back from a swap
                    run.figures.swap_s += entry.swap_s
                    run.figures.restored |= entry.restored
                    run.figures.forked |= entry.forked
                    run.figures.tier = run.figures.tier if run.began else entry.tier
                if not run.began:
                    self.host.begin(run)
                    run.figures.evicted = run.figures.evicted or self._switch_evicted
                    run.sampler = Sampler(**run.asked.sampling, n_vocab=run.agent.loaded.model.n_vocab)
                    if run.asked.grammar is not None:
                        run.constraint = Constraint(run.agent.loaded.model, run.asked.grammar)
            except Exception as exc:
                self._finish(run, error=exc)
                continue
            finally:     # seating and tokenizing are the scheduler's time too, failed or not
                self._charge({run.owner: time.perf_counter() - t0})
            run.figures.slices += 1
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
        if not pool.key.requests or agent.history or pool.seat_of(agent) is not None:
            return False
        return pool.coming(agent) >= pool.match(agent)[0] + WAIT_FOR_PREFIX

    def _make_room(self, pool: Pool, run: Run) -> bool:
        """Free a seat for `run`'s agent. If agents were registered since the pool opened and
        its owner's own idle seats cannot make room while another user's agent sits here,
        the agent decodes in a context of its owner's own (own.py: the run waits for
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
            return False       # it decodes in a context of its owner's own (own.py), pausing nobody
        idle = self._pausable(pool, run, idle, seqs, cells)
        if self._room(pool, idle, seqs, cells):
            t0 = time.perf_counter()
            for seat in idle:          # pausing them all would make room: pause only as many as needed
                pool.unseat(seat.agent, pause=True)
                run.figures.evicted = run.figures.evicted or seat.agent
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
