"""Shared mode: one context, one unified KV cache, every branch in every llama_decode.

The document lives in sequence 0. Forking a branch is llama_memory_seq_cp(0 → i, 0, W):
the branch's sequence id is added to the document's cells, no bytes move. Each loop step
builds one batch holding the next prefill chunk (if any), each new branch's prompt, and
each running branch's last token, decodes it once, then samples every branch from its
own row. A finished branch removes its sequence, freeing the cells only it used.
"""
from __future__ import annotations

import time

from .. import exact, library
from ..batch import Batch
from ..errors import BudgetError
from ..generate import TextStream
from ..model import Model
from ..snapshot import Snapshot
from .plan import BranchResult, Plan, prefill_stops, rate, round_up

class _Live:
    """A branch inside the shared context: its sequence, sampler and text so far."""

    def __init__(self, plan: Plan, i: int, result: BranchResult):
        self.i, self.seq, self.res = i, i + 1, result
        self.spec = plan.specs[i]
        self.sampler = plan.sampler(i)
        self.stream = TextStream(plan.model)
        self.pieces: list[str] = []
        self.pending = plan.layout.suffixes[i]   # prompt tokens still to decode
        self.pos = plan.watermarks[i]
        self.row = -1
        self.first_at = 0.0

    def push(self, model: Model, token: int) -> bool:
        """Record a sampled token; True when the branch is finished."""
        if model.is_eog(token):
            self.res.stopped_on_eog = True
            return True
        self.res.token_ids.append(token)
        self.pieces.append(self.stream.push(token))
        return len(self.res.token_ids) >= self.spec.max_tokens

    def finish(self, ms: float) -> None:
        self.pieces.append(self.stream.flush())
        self.res.text = "".join(self.pieces)
        self.res.decode_ms = ms - self.first_at
        self.res.tokens_per_s = rate(len(self.res.token_ids), self.res.decode_ms)
        self.sampler.close()


def run_shared(plan: Plan, snapshot_in, snapshot_out, progress, keep_logits, serialize=False,
               on_capture=None):
    """snapshot_in may hold the whole document or a start of it (the rest is prefilled);
    on_capture(snapshot) receives seq 0's state at each of plan.capture_at."""
    lay = plan.layout
    n, n_branches = lay.n_prefix, len(plan.specs)
    if n_branches + 1 > library.lib().llama_max_parallel_sequences():
        raise BudgetError(f"shared mode holds one sequence per branch plus the document: "
                          f"{n_branches + 1} > llama_max_parallel_sequences()")
    # One context holds the document once and every branch's own cells; the planned n_ctx
    # (one sequence's budget) is its floor, the caller's headroom its margin.
    cells = n + sum(len(lay.suffixes[i]) + s.max_tokens for i, s in enumerate(plan.specs)) + plan.headroom
    n_ctx = max(plan.n_ctx, round_up(cells, 256))
    step_capacity = plan.n_batch + sum(len(s) for s in lay.suffixes) + n_branches
    results = [plan.result(i) for i in range(n_branches)]
    waiting = sorted(range(n_branches), key=lambda i: plan.watermarks[i])
    live: list[_Live] = []
    prefill_ms, snapshot_bytes = 0.0, 0
    with plan.context(n_ctx, n_seq_max=n_branches + 1, n_batch=step_capacity) as ctx:
        done = 0
        if snapshot_in is not None:
            snapshot_in.restore(ctx, 0)
            done, snapshot_bytes = snapshot_in.header.n_tokens, snapshot_in.nbytes
        stops = iter(s for s in prefill_stops(plan) if s > done)
        batch = Batch(step_capacity)
        t_prefill = plan.ms()
        ready_at = {w: t_prefill for w in set(plan.watermarks) if w <= done}
        while waiting or live or done < n:
            plan.check_stop()
            while waiting and plan.watermarks[waiting[0]] <= done:
                live.append(fork(ctx, plan, waiting.pop(0), results, ready_at))
            stop = next(stops) if done < n else done
            # One decode for the prefill chunk and every branch; serialize=True decodes them
            # one after another instead (as if one global mutex held every decode; for benchmarks).
            groups = [[None] + live] if not serialize else [[None]] + [[b] for b in live]
            for group in groups:
                batch.clear()
                for b in group:
                    if b is None:
                        if stop != done:
                            batch.add_sequence(lay.prefix[done:stop], done, 0, logits_last=False)
                    elif len(b.pending):  # a new branch's whole prompt
                        b.row = batch.add_sequence(b.pending, b.pos, b.seq, logits_last=True)
                        b.pos += len(b.pending)
                        b.pending = b.pending[:0]
                    else:  # a running branch's last token
                        b.row = batch.add(b.res.token_ids[-1], b.pos, (b.seq,), logits=True)
                        b.pos += 1
                if batch.n_tokens == 0:
                    continue
                ctx.decode(batch)
                if group[0] is None and stop != done:
                    done = stop
                    ready_at[done] = plan.ms()
                    if progress:
                        progress(done, n)
                    if on_capture is not None and done in plan.capture_at:
                        on_capture(Snapshot.capture(ctx, 0, lay.prefix[:done]))
                    if done == n:
                        prefill_ms = ready_at[done] - t_prefill
                        snapshot_bytes = ctx.seq_state_size(0)
                        if snapshot_out is not None:
                            snapshot_out(Snapshot.capture(ctx, 0, lay.prefix))
                for b in group:
                    if b is not None:
                        sample(ctx, plan, b, live, keep_logits)
    return results, prefill_ms, snapshot_bytes, n_ctx


def sample(ctx, plan: Plan, b: _Live, live: list[_Live], keep_logits: bool) -> None:
    """Sample b's next token from its row of the last decode; retire b when it is done."""
    token = b.sampler.sample(ctx, b.row)
    if keep_logits:
        b.res.logit_digests.append(exact.digest(ctx.logits(b.row)))
    if not b.res.token_ids and not b.res.stopped_on_eog:
        b.first_at = plan.ms()
        b.res.activation_ms = b.first_at - b.res.ready_ms
        if keep_logits:
            b.res.first_logits = ctx.logits(b.row).copy()
    if b.push(plan.model, token):
        b.finish(plan.ms())
        # Free the branch's own cells (shared ones stay with seq 0). Exact mode keeps them:
        # reused cells would put other branches' later tokens before their earlier ones in
        # cell order, which is the order flash attention sums in.
        if not plan.exact:
            ctx.seq_rm(b.seq)
        live.remove(b)


def fork(ctx, plan: Plan, i: int, results: list[BranchResult], ready_at: dict) -> _Live:
    """Branch i's sequence starts seeing the first W document cells: no bytes move."""
    b = _Live(plan, i, results[i])
    w = plan.watermarks[i]
    t = time.perf_counter_ns()
    ctx.seq_cp(0, b.seq, 0, w)
    b.res.fork_ms = (time.perf_counter_ns() - t) / 1e6
    b.res.ready_ms = ready_at[w]
    return b
