"""The baseline that fan-out is measured against, and the "plain run" that fidelity tests
compare every branch with: each agent in its own fresh context, prefilling the document
itself (same n_batch chunks as the fan-out prefill), then decoding its branch.
"""
from __future__ import annotations

import time

from ..generate import generate
from ..model import Model
from .config import FanoutConfig
from .plan import Plan, plan_fanout
from .prefill import prefill
from .types import BranchResult, BranchSpec, FanoutResult


def run_baseline(model: Model, document: str, specs: list[BranchSpec],
                 config: FanoutConfig | None = None, *, trace_logits: bool = False,
                 **settings) -> FanoutResult:
    """N independent agents, one after another. Nothing is shared. config / settings as
    for run_fanout."""
    plan = plan_fanout(model, document, specs, config, **settings)
    branches = [plain_branch(plan, i, trace_logits) for i in range(len(specs))]
    return FanoutResult(mode="baseline", model=model.path.name, n_prefix=plan.layout.n_prefix,
                        n_ctx=plan.n_ctx, prefill_ms=sum(b.prefill_ms for b in branches),
                        prefill_skipped=False, snapshot_bytes=0, total_ms=plan.ms(), branches=branches)


def plain_branch(plan: Plan, i: int, trace_logits: bool = False) -> BranchResult:
    """One agent: fresh context, prefill of the first W document tokens, branch prompt,
    generation. Its activation is the redundant re-prefill plus the first token."""
    res = plan.result(i)
    w = plan.watermarks[i]
    res.ready_ms = plan.ms()
    t = time.perf_counter_ns()
    with plan.context(plan.n_ctx) as ctx, plan.sampler(i) as sampler:
        prefill(plan, ctx, upto=w)
        res.prefill_ms = (time.perf_counter_ns() - t) / 1e6
        gen = generate(ctx, plan.layout.suffixes[i], max_tokens=plan.specs[i].max_tokens,
                       sampler=sampler, pos0=w, trace_logits=trace_logits)
    return res.record_generation(gen, res.prefill_ms)
