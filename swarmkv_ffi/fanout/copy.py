"""Copy mode: the seed's path, and the one that crosses contexts, processes and disks.

prefill (one context) ─▶ snapshot at every watermark (a gate) ─▶ per branch: copy the
bytes, restore into a fresh context, decode the branch prompt at positions W…, generate.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from ..batch import Batch
from ..dag import Dag
from ..generate import generate
from ..snapshot import Snapshot
from .plan import BranchResult, Plan, prefill_stops, rate

def add_copy_nodes(dag: Dag, plan: Plan, snapshot_in, snapshot_out, progress, keep_logits):
    """prefill → one snapshot per distinct watermark (a gate) → branch-i nodes."""
    # One gate per distinct watermark, plus the whole document (for snapshot_out).
    gates = {w: Future() for w in sorted(set(plan.watermarks) | {plan.layout.n_prefix})}

    def prefill(_):
        try:
            return _copy_prefill(plan, gates, snapshot_in, snapshot_out, progress)
        except BaseException as exc:
            for g in gates.values():
                if not g.done():
                    g.set_exception(exc)
            raise

    dag.add("prefill", prefill)
    for i, w in enumerate(plan.watermarks):
        dag.add(f"branch-{i}", lambda _, i=i, w=w: _copy_branch(plan, i, gates[w].result(), keep_logits),
                gates=[gates[w]])


def _copy_prefill(plan: Plan, gates: dict[int, Future], snapshot_in, snapshot_out, progress):
    prefix, n = plan.layout.prefix, plan.layout.n_prefix
    t_start = plan.ms()
    if snapshot_in is not None:
        for gate in gates.values():
            gate.set_result((snapshot_in, plan.ms()))
        return 0.0, snapshot_in.nbytes
    full = None
    with plan.context(plan.n_ctx) as ctx:
        done = 0
        batch = Batch(plan.n_batch)
        for stop in prefill_stops(plan):
            batch.clear().add_sequence(prefix[done:stop], done, 0, logits_last=False)
            ctx.decode(batch)
            done = stop
            if progress:
                progress(done, n)
            if done in gates:
                snap = Snapshot.capture(ctx, 0, prefix[:done])
                gates[done].set_result((snap, plan.ms()))
                full = snap
        prefill_ms = plan.ms() - t_start
    if snapshot_out is not None:
        snapshot_out(full)
    return prefill_ms, full.nbytes


def _copy_branch(plan: Plan, i: int, gate_value, keep_logits: bool) -> BranchResult:
    snapshot, ready_ms = gate_value
    res = plan.result(i)
    res.ready_ms = ready_ms
    w = plan.watermarks[i]
    t = time.perf_counter_ns()
    mine = snapshot.fork()  # copy-on-fork: this branch owns its bytes
    with plan.context(plan.n_ctx) as ctx, plan.sampler(i) as sampler:
        mine.restore(ctx, 0)
        if w < mine.header.n_tokens:  # a full snapshot reused for a watermark branch
            ctx.seq_rm(0, w, -1)
        res.fork_ms = (time.perf_counter_ns() - t) / 1e6
        gen = generate(ctx, plan.layout.suffixes[i], max_tokens=plan.specs[i].max_tokens,
                       sampler=sampler, pos0=w, keep_first_logits=keep_logits)
    res.token_ids, res.text, res.stopped_on_eog = gen.tokens, gen.text, gen.stopped_on_eog
    res.activation_ms = res.fork_ms + gen.first_token_ms
    res.decode_ms = gen.decode_ms - (gen.first_token_ms - gen.prompt_ms)
    res.tokens_per_s = rate(len(gen.tokens), res.decode_ms)
    res.first_logits = gen.first_logits
    return res
