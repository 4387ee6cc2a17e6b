"""run_fanout: the one entry point that picks a mode and runs it as a DAG."""
from __future__ import annotations

from typing import Callable

from ..budget import DEFAULT_HEADROOM
from ..dag import Dag
from ..model import Model
from ..snapshot import Snapshot
from .copy import add_copy_nodes
from .plan import MODES, BranchSpec, FanoutResult, check_snapshot_document, plan_fanout
from .shared import run_shared


def run_fanout(model: Model, document: str, specs: list[BranchSpec], *, mode: str = "shared",
               n_ctx: int | None = None, n_batch: int = 512, headroom: int = DEFAULT_HEADROOM,
               chat: bool = True, n_threads: int | None = None,
               kv_type: str = "q8_0", flash_attn: str = "on",
               snapshot_in: Snapshot | None = None, snapshot_out: Callable[[Snapshot], None] | None = None,
               progress: Callable[[int, int], None] | None = None, keep_logits: bool = False,
               branch_workers: int = 1, serialize: bool = False,
               timeout: float | None = 3600.0) -> FanoutResult:
    """Answer every branch over one prefill of `document`.

    snapshot_in: reuse a snapshot of this document (its tokens must match) and skip the
    prefill. snapshot_out: called with the document's snapshot once the prefill is done.
    progress(done, total): prefill progress in tokens. branch_workers: copy-mode branches
    that may run at once (each in its own context). serialize: shared mode decodes the
    branches one at a time instead of together (to measure what batching buys).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan = plan_fanout(model, document, specs, n_ctx=n_ctx, n_batch=n_batch, headroom=headroom,
                       chat=chat, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn)
    if snapshot_in is not None:
        check_snapshot_document(snapshot_in, plan.layout)
    dag = Dag()
    if mode == "shared":
        dag.add("shared", lambda _: run_shared(plan, snapshot_in, snapshot_out, progress, keep_logits, serialize))
        results = dag.run(max_workers=1, timeout=timeout)["shared"]
        branches, prefill_ms, snapshot_bytes = results
    else:
        add_copy_nodes(dag, plan, snapshot_in, snapshot_out, progress, keep_logits)
        out = dag.run(max_workers=branch_workers + 1, timeout=timeout)
        branches = [out[f"branch-{i}"] for i in range(len(specs))]
        prefill_ms, snapshot_bytes = out["prefill"]
    return FanoutResult(mode=mode, model=model.path.name, n_prefix=plan.layout.n_prefix,
                        n_ctx=plan.n_ctx, prefill_ms=prefill_ms, prefill_skipped=snapshot_in is not None,
                        snapshot_bytes=snapshot_bytes, total_ms=plan.ms(), branches=branches)
