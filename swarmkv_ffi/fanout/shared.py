"""Shared mode: one context, one unified KV cache, every branch in every llama_decode.

The document lives in sequence 0. Forking a branch is llama_memory_seq_cp(0 → i, 0, W):
the branch's sequence id is added to the document's cells, no bytes move. Each loop step
builds one batch holding the next prefill chunk (if any), each new branch's prompt, and
each running branch's last token, decodes it once, then samples every branch from its
own row. A finished branch removes its sequence, freeing the cells only it used.
"""
from __future__ import annotations

import time
from typing import Callable

from .. import library
from ..batch import Batch
from ..errors import BudgetError
from ..generate import Answer
from ..snapshot import Snapshot
from .plan import Plan, round_up
from .prefill import prefill_stops

Chunk = tuple[int, int] | None   # document tokens [start, stop) to prefill in this step
Schedule = Callable[[Chunk, list], list[tuple[Chunk, list]]]


def together(chunk: Chunk, branches: list) -> list[tuple[Chunk, list]]:
    """The step's work in one llama_decode: the prefill chunk and every live branch."""
    return [(chunk, branches)]


class _Branch:
    """A branch inside the shared context: its sequence, sampler and answer so far."""

    def __init__(self, plan: Plan, i: int, trace_logits: bool):
        self.i, self.seq = i, i + 1
        self.res = plan.result(i)
        self.sampler = plan.sampler(i)
        self.answer = Answer(plan.model, plan.specs[i].max_tokens, trace_logits=trace_logits)
        self.prompt = plan.layout.suffixes[i]   # decoded whole in the branch's first step
        self.pos = plan.watermarks[i]
        self.row = -1

    def add_to(self, batch: Batch) -> None:
        """Its prompt (first step) or its last sampled token, with logits for its row."""
        if len(self.prompt):
            self.row = batch.add_sequence(self.prompt, self.pos, self.seq, logits_last=True)
            self.pos += len(self.prompt)
            self.prompt = self.prompt[:0]
        else:
            self.row = batch.add(self.answer.tokens[-1], self.pos, (self.seq,), logits=True)
            self.pos += 1


class _SharedRun:
    """One run's moving parts: the document's progress in sequence 0, the branches
    waiting for their watermark, the live ones, and what the caller asked to receive."""

    def __init__(self, plan: Plan, ctx, trace_logits: bool, capacity: int,
                 progress, snapshot_out, on_capture):
        self.plan, self.ctx = plan, ctx
        self.progress, self.snapshot_out, self.on_capture = progress, snapshot_out, on_capture
        self.branches = [_Branch(plan, i, trace_logits) for i in range(len(plan.specs))]
        self.waiting = sorted(self.branches, key=lambda b: b.pos)
        self.live: list[_Branch] = []
        self.batch = Batch(capacity)
        self.done = 0                  # document tokens in sequence 0
        self.ready_at: dict[int, float] = {}
        self.t_prefill = 0.0
        self.prefill_ms, self.snapshot_bytes = 0.0, 0

    def close(self) -> None:
        for b in self.branches:
            b.sampler.close()

    def start(self, snapshot_in: Snapshot | None) -> None:
        if snapshot_in is not None:
            snapshot_in.restore(self.ctx, 0)
            self.done, self.snapshot_bytes = snapshot_in.header.n_tokens, snapshot_in.nbytes
        self.t_prefill = self.plan.ms()
        self.ready_at = {w: self.t_prefill for w in self.plan.watermarks if w <= self.done}

    def fork_ready(self) -> None:
        """Branch i's sequence starts seeing the first W document cells: no bytes move."""
        while self.waiting and self.waiting[0].pos <= self.done:
            b = self.waiting.pop(0)
            t = time.perf_counter_ns()
            self.ctx.seq_cp(0, b.seq, 0, b.pos)
            b.res.fork_ms = (time.perf_counter_ns() - t) / 1e6
            b.res.ready_ms = self.ready_at[b.pos]
            self.live.append(b)

    def step(self, chunk: Chunk, branches: list[_Branch]) -> None:
        """One llama_decode of a prefill chunk and/or branches, then their samples."""
        self.batch.clear()
        if chunk is not None:
            start, stop = chunk
            self.batch.add_sequence(self.plan.layout.prefix[start:stop], start, 0, logits_last=False)
        for b in branches:
            b.add_to(self.batch)
        if self.batch.n_tokens == 0:
            return
        self.ctx.decode(self.batch)
        if chunk is not None:
            self.prefilled(chunk[1])
        for b in branches:
            self.sample(b)

    def prefilled(self, done: int) -> None:
        """Sequence 0 holds `done` document tokens: tell whoever asked."""
        self.done = done
        self.ready_at[done] = self.plan.ms()
        n = self.plan.layout.n_prefix
        if self.progress:
            self.progress(done, n)
        if self.on_capture is not None and done in self.plan.capture_at:
            self.on_capture(Snapshot.capture(self.ctx, 0, self.plan.layout.prefix[:done]))
        if done == n:
            self.prefill_ms = self.ready_at[done] - self.t_prefill
            self.snapshot_bytes = self.ctx.seq_state_size(0)
            if self.snapshot_out is not None:
                self.snapshot_out(Snapshot.capture(self.ctx, 0, self.plan.layout.prefix))

    def sample(self, b: _Branch) -> None:
        """b's next token from its row of the last decode; retire b when it is done."""
        if not b.answer.take(self.ctx, b.row, b.sampler):
            return
        b.answer.finish()
        b.res.record(b.answer, self.plan.ms(b.answer.first_ns) - b.res.ready_ms)
        # Free the branch's own cells (shared ones stay with seq 0). Exact mode keeps them:
        # reused cells would put other branches' later tokens before their earlier ones in
        # cell order, which is the order flash attention sums in.
        if not self.plan.exact:
            self.ctx.seq_rm(b.seq)
        self.live.remove(b)


def context_size(plan: Plan) -> int:
    """The document once and every branch's own cells; the planned n_ctx (one sequence's
    budget) is its floor, the caller's headroom its margin."""
    lay = plan.layout
    own = sum(len(lay.suffixes[i]) + s.max_tokens for i, s in enumerate(plan.specs))
    return max(plan.n_ctx, round_up(lay.n_prefix + own + plan.headroom, 256))


def run_shared(plan: Plan, snapshot_in, snapshot_out, progress, trace_logits,
               on_capture=None, schedule: Schedule = together):
    """snapshot_in may hold the whole document or a start of it (the rest is prefilled);
    on_capture(snapshot) receives seq 0's state at each of plan.capture_at. schedule
    splits each step's work into decodes (benchmarks measure other splits)."""
    n, n_branches = plan.layout.n_prefix, len(plan.specs)
    if n_branches + 1 > library.lib().llama_max_parallel_sequences():
        raise BudgetError(f"shared mode holds one sequence per branch plus the document: "
                          f"{n_branches + 1} > llama_max_parallel_sequences()")
    n_ctx = context_size(plan)
    capacity = plan.n_batch + sum(len(s) for s in plan.layout.suffixes) + n_branches
    with plan.context(n_ctx, n_seq_max=n_branches + 1, n_batch=capacity) as ctx:
        run = _SharedRun(plan, ctx, trace_logits, capacity, progress, snapshot_out, on_capture)
        try:
            run.start(snapshot_in)
            stops = iter(s for s in prefill_stops(plan) if s > run.done)
            while run.waiting or run.live or run.done < n:
                plan.check_stop()
                run.fork_ready()
                chunk = (run.done, next(stops)) if run.done < n else None
                for part, branches in schedule(chunk, list(run.live)):
                    run.step(part, branches)
        finally:
            run.close()
    return [b.res for b in run.branches], run.prefill_ms, run.snapshot_bytes, n_ctx
