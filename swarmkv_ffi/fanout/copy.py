"""Copy mode: snapshot bytes restored per branch; the path that crosses contexts, processes and disks.

prefill (one context) ─▶ snapshot at every watermark (a gate) ─▶ per branch: copy the
bytes, restore into a fresh context, decode the branch prompt at positions W…, generate.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from ..generate import generate
from ..snapshot import Snapshot
from .dag import Dag
from .plan import Plan
from .prefill import prefill
from .types import BranchResult


def add_copy_nodes(dag: Dag, plan: Plan, snapshot_in, snapshot_out, progress, trace_logits, on_capture=None):
    """prefill → one snapshot per distinct watermark (a gate) → branch-i nodes.
    snapshot_in may hold the whole document or a start of it; on_capture(snapshot)
    receives the document's state at each of plan.capture_at."""
    # One gate per distinct watermark, plus the whole document (for snapshot_out).
    gates = {w: Future() for w in sorted(set(plan.watermarks) | {plan.layout.n_prefix})}

    def prefill(_):
        try:
            return _copy_prefill(plan, gates, snapshot_in, snapshot_out, progress, on_capture)
        except BaseException as exc:
            for g in gates.values():
                if not g.done():
                    g.set_exception(exc)
            raise

    dag.add("prefill", prefill)
    for i, w in enumerate(plan.watermarks):
        dag.add(f"branch-{i}", lambda _, i=i, w=w: _copy_branch(plan, i, gates[w].result(), trace_logits),
                gates=[gates[w]])


def _copy_prefill(plan: Plan, gates: dict[int, Future], snapshot_in, snapshot_out, progress, on_capture):
    prefix, n = plan.layout.prefix, plan.layout.n_prefix
    t_start = plan.ms()
    start = snapshot_in.header.n_tokens if snapshot_in is not None else 0
    for w, gate in gates.items():   # what the snapshot already covers is ready now
        if w <= start:
            gate.set_result((snapshot_in, plan.ms()))
    if start == n:
        return 0.0, snapshot_in.nbytes
    snaps = {}
    with plan.context(plan.n_ctx) as ctx:
        if snapshot_in is not None:
            snapshot_in.restore(ctx, 0)

        def on_chunk(done: int) -> None:
            if progress:
                progress(done, n)
            if done in gates or done in plan.capture_at:
                snaps[done] = Snapshot.capture(ctx, 0, prefix[:done])
            if done in gates:  # a watermark (or the end): branches waiting on it may start
                gates[done].set_result((snaps[done], plan.ms()))
            if on_capture is not None and done in plan.capture_at:
                on_capture(snaps[done])

        prefill(plan, ctx, on_chunk=on_chunk, start=start)
        prefill_ms = plan.ms() - t_start
    if snapshot_out is not None:
        snapshot_out(snaps[n])
    return prefill_ms, snaps[n].nbytes


def _copy_branch(plan: Plan, i: int, gate_value, trace_logits: bool) -> BranchResult:
    snapshot, ready_ms = gate_value
    res = plan.result(i)
    res.ready_ms = ready_ms
    w = plan.watermarks[i]
    t = time.perf_counter_ns()
    mine = snapshot.copy()  # this branch owns its bytes
    with plan.context(plan.n_ctx) as ctx, plan.sampler(i) as sampler:
        mine.restore(ctx, 0)
        if w < mine.header.n_tokens:  # a full snapshot reused for a watermark branch
            ctx.seq_rm(0, w, -1)
        res.fork_ms = (time.perf_counter_ns() - t) / 1e6
        plan.check_stop()
        gen = generate(ctx, plan.layout.suffixes[i], max_tokens=plan.specs[i].max_tokens,
                       sampler=sampler, pos0=w, trace_logits=trace_logits, should_stop=plan.stop.is_set)
    return res.record_generation(gen, res.fork_ms)
