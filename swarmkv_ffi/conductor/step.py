"""One step of the scheduler: plan it, run it, apply what it gave.

`plan` is a pure function of the runs in the step and the rows the step cap allows: it
fills the batch and returns a `StepPlan` (which run put how many tokens at which rows,
and who put in how many rows: what the step's seconds are charged by). `Steps._step`
(part of the Scheduler, scheduler.py) runs the plan in one llama_decode, then moves
each run's tokens into its history (`advance`) and samples the runs whose last input
token was in the step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..batch import Batch
from ..grammar import GrammarError
from ..sampler import logprobs
from .common_prompts import PromptTrie
from .pool import Pool, Seat
from .runs import Run, StepTally


@dataclass
class Row:
    """What one run puts into a step."""
    run: Run
    seat: Seat
    n: int             # its input tokens in the batch
    logits: int        # the batch row to sample from, or -1 (a chunk of a prompt, not its last)


@dataclass
class StepPlan:
    """A filled batch and what is in it."""
    batch: Batch
    rows: list[Row] = field(default_factory=list)
    by_owner: dict[int, int] = field(default_factory=dict)   # batch rows each user put in
    decode_rows: int = 0                                     # rows of runs decoding one token

    def add(self, rows: list[Row], owner: int, n_rows: int) -> None:
        """`owner`'s `rows`, which took `n_rows` batch rows (fewer than their tokens when
        runs starting together share their common ones)."""
        self.rows += rows
        self.by_owner[owner] = self.by_owner.get(owner, 0) + n_rows


def input_len(pool: Pool, run: Run) -> int:
    """The tokens the run has still to put in: history not yet in its cells, then its feed."""
    return len(run.agent.history) - pool.seat_of(run.agent).kv_len + len(run.feed)


def plan(pool: Pool, batch: Batch, runs: list[Run], order: Callable, cap: Callable[[int], int]) -> StepPlan:
    """Fill `batch` with one token of each decoding run, then prompts and re-reads (runs
    starting together from one point with their common tokens once, common_prompts.py),
    the shortest first, in the rows `cap(base)` allows (policy.step_rows): base
    is the rows whose pace the cap keeps, the decode rows; with none, the shortest prompt
    when two users' prompts share the step; else none (then a step stays short, so a
    user coming back meets no 512-row step in flight)."""
    step = StepPlan(batch.clear())
    decoding = [r for r in runs if input_len(pool, r) == 1]
    prompts = sorted((r for r in runs if input_len(pool, r) > 1), key=lambda r: (input_len(pool, r), order(r)))
    several = len({r.owner for r in runs}) > 1
    base = len(decoding) or (min(input_len(pool, r) for r in prompts) if several else 0)
    room = cap(base)
    if len(decoding) > room:        # a batch smaller than the runs decoding: the furthest behind go first
        decoding.sort(key=lambda r: len(r.generated))
    for run in decoding:
        room -= _add_input(pool, step, run, room)
    step.decode_rows = sum(row.n for row in step.rows)
    groups, rest = starting_together(pool, prompts)
    for group in groups:
        trie = PromptTrie([(id(run), seat.seq, run.feed) for run, seat in group])
        if trie.size > room:
            rest += [run for run, _ in group]
            continue
        found = trie.add_to(batch, group[0][1].kv_len)
        step.add([Row(run, seat, len(run.feed), found[id(run)]) for run, seat in group], group[0][0].owner, trie.size)
        room -= trie.size
    for run in rest:
        room -= _add_input(pool, step, run, room)
    return step


def _add_input(pool: Pool, step: StepPlan, run: Run, room: int) -> int:
    """Put up to `room` of the run's next input tokens into the batch; returns how many."""
    seat = pool.seat_of(run.agent)
    wanted = run.agent.history[seat.kv_len:] + run.feed
    take = wanted[:max(0, room)]
    if not take:
        return 0
    last = len(take) == len(wanted)
    row = step.batch.add_sequence(take, seat.kv_len, seat.seq, logits_last=last)
    step.add([Row(run, seat, len(take), row if last else -1)], run.owner, len(take))
    return len(take)


def starting_together(pool: Pool, runs: list[Run]) -> tuple[list[list], list[Run]]:
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


def advance(run: Run, seat: Seat, n: int) -> None:
    """n more tokens of the run's input have their KV in the sequence."""
    agent = run.agent
    from_feed = max(0, n - (len(agent.history) - seat.kv_len))
    agent.history += run.feed[:from_feed]
    del run.feed[:from_feed]
    seat.kv_len += n


class Steps:
    """The Scheduler's step (scheduler.py holds the state it reads: live, _batch, policy)."""

    def _step(self) -> None:
        """One llama_decode for the batch (plan); each user is charged the step's time by
        the rows it put in, and the host work on its rows after it (sampling, logprobs,
        its callbacks) as measured."""
        pool = self.live
        ctx = pool.ctx
        if self._step_batch is None or self._step_batch.capacity != ctx.n_batch \
                or self._step_batch.n_seq_max != ctx.n_seq_max:
            self._step_batch = Batch(ctx.n_batch, ctx.n_seq_max)
        sharing = self.policy.sharing(self._active())

        def cap(base: int) -> int:
            return min(ctx.n_batch, self.policy.step_rows(self._cost(pool), base, ctx.n_batch, sharing))
        step = plan(pool, self._step_batch, self._in_step(), self._order, cap)
        if not step.rows:
            return
        t0 = time.perf_counter()
        try:
            ctx.decode(step.batch)
        except Exception as exc:
            for row in step.rows:
                self._fail(row.run, exc)
            return
        seconds = time.perf_counter() - t0
        prompt_rows = step.batch.n_tokens - step.decode_rows
        self._cost(pool).observe(step.decode_rows, prompt_rows, seconds)
        self.tally.setdefault(pool.key, StepTally()).step(step.decode_rows, prompt_rows, seconds)
        self._charge(self.policy.by_rows(step.by_owner, seconds))
        self._apply(pool, step)

    def _apply(self, pool: Pool, step: StepPlan) -> None:
        """The step's tokens into each run's history; the runs at the end of their input
        sample their next token, each owner charged its host time."""
        host: dict[int, float] = {}
        for row in step.rows:
            row.run.figures.batch_max = max(row.run.figures.batch_max, len(step.rows))
            row.run.stepped = True
            advance(row.run, row.seat, row.n)
            pool.last = row.run.agent
            if row.logits >= 0:
                t1 = time.perf_counter()
                self._sample(row.run, pool.ctx, row.logits)
                host[row.run.owner] = host.get(row.run.owner, 0.0) + time.perf_counter() - t1
            elif row.run.asked.on_prompt is not None:
                row.run.asked.on_prompt(row.seat.kv_len, row.run.figures.cached)
        self._charge(host)

    def _in_step(self) -> list[Run]:
        """The runs this step serves: all of them, but those of a user more than
        SLICE_SECONDS ahead of the least-charged user in the batch (policy.stepping), so
        one user's many DECODEs cannot take the device from another's one."""
        stepping = self.policy.stepping({r.owner for r in self._batch})
        return [r for r in self._batch if r.owner in stepping]

    def _sample(self, run: Run, ctx, row: int) -> None:
        """The run's next token from its row: under its grammar's mask if it has one
        (its next mask is then computed while the next decode runs). A grammar that fails
        fails its own run, never the step of the others."""
        try:
            if run.constraint is not None:
                run.constraint.apply(ctx.logits(row))
            top = run.asked.top_logprobs
            if run.sampler.post_sampling and top is not None:
                token, ranked = run.sampler.sample_candidates(ctx, row, top)
            else:
                token, ranked = run.sampler.sample(ctx, row), None
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
        if run.asked.on_token is not None:
            if ranked is None and top is not None:
                ranked = logprobs(ctx.logits(row), token, top)
            more = run.asked.on_token(token, ranked)
        if not more or run.completed or len(run.generated) >= run.asked.max_tokens:
            run.agent.pending = token       # decoded with the next prompt
            self._finish(run)
        else:
            run.feed = [token]
