"""run_fanout: the one entry point that picks a mode and runs it as a DAG."""
from __future__ import annotations

from typing import Callable

from ..model import Model
from ..kvcache.files import PrefixCache
from ..snapshot import Snapshot
from .config import FanoutConfig
from .copy import add_copy_nodes
from .dag import Dag
from .plan import check_snapshot_document, plan_fanout
from .shared import Schedule, run_shared, together
from .types import MODES, BranchSpec, FanoutResult


def run_fanout(model: Model, document: str, specs: list[BranchSpec],
               config: FanoutConfig | None = None, *, mode: str = "shared",
               snapshot_in: Snapshot | None = None, snapshot_out: Callable[[Snapshot], None] | None = None,
               progress: Callable[[int, int], None] | None = None, trace_logits: bool = False,
               branch_workers: int = 1, schedule: Schedule = together,
               timeout: float | None = 3600.0, cache: PrefixCache | bool | None = True,
               **settings) -> FanoutResult:
    """Answer every branch over one prefill of `document`.

    config / settings: the context and prompt settings (FanoutConfig; keyword settings
    such as n_batch=256 or exact=True override fields of `config`).

    cache: the prefix cache (True: the default folder, see kvcache/files.py; False or None:
    none). The longest cached start of the document is restored and only the rest is
    prefilled; afterwards the document's state is stored at the whole prefix and at
    cache boundaries, so the next run over it (or over an extension of it) skips that work.
    A cache that cannot be read or written (a full disk, a read-only folder) never fails
    the run: it logs one warning, which the result's cache_warning also holds.
    snapshot_in: reuse a snapshot of this document (its tokens must match) and skip the
    prefill. snapshot_out: called with the document's snapshot once the prefill is done.
    trace_logits: keep each branch's first logits, and a digest of the logits of every
    sampled token (exact.digest). progress(done, total): prefill progress in tokens.
    branch_workers: copy-mode branches that may run at once (each in its own context).
    schedule: how shared mode splits one step's work into decodes (default: all of it in
    one; benchmarks pass others to measure what batching buys).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan = plan_fanout(model, document, specs, config, **settings)
    cache = PrefixCache.open_optional() if cache is True else (cache or None)
    if snapshot_in is not None:
        check_snapshot_document(snapshot_in, plan.layout)
    captured: list[Snapshot] = []
    if cache is not None:
        snapshot_in = snapshot_in or _cached_start(cache, plan)
        have = snapshot_in.header.n_tokens if snapshot_in is not None else 0
        plan.capture_at = frozenset(k for k in cache.store_points(plan.layout.n_prefix, _step(cache, plan)) if k > have)
    restored = snapshot_in.header.n_tokens if snapshot_in is not None else 0
    if snapshot_out is not None and restored == plan.layout.n_prefix and cache is not None:
        snapshot_out(snapshot_in)  # a cache hit: the document's snapshot without a prefill
        snapshot_out = None
    dag = Dag()
    plan.stop = dag.stop
    if mode == "shared":
        dag.add("shared", lambda _: run_shared(plan, snapshot_in, snapshot_out, progress, trace_logits,
                                               on_capture=captured.append, schedule=schedule))
        branches, prefill_ms, snapshot_bytes, n_ctx_used = dag.run(max_workers=1, timeout=timeout)["shared"]
    else:
        add_copy_nodes(dag, plan, snapshot_in, snapshot_out, progress, trace_logits, on_capture=captured.append)
        out = dag.run(max_workers=branch_workers + 1, timeout=timeout)
        branches = [out[f"branch-{i}"] for i in range(len(specs))]
        prefill_ms, snapshot_bytes = out["prefill"]
        n_ctx_used = plan.n_ctx
    total_ms = plan.ms()
    cache_warning = cache.offer(captured, plan.cache_signature(), head=document) if captured else None
    return FanoutResult(mode=mode, model=model.path.name, n_prefix=plan.layout.n_prefix,
                        n_ctx=n_ctx_used, prefill_ms=prefill_ms, prefill_skipped=restored == plan.layout.n_prefix,
                        snapshot_bytes=snapshot_bytes, total_ms=total_ms, branches=branches,
                        cached_tokens=restored, cache_store_ms=plan.ms() - total_ms, cache_warning=cache_warning)


def _step(cache: PrefixCache, plan) -> int:
    """Cache boundaries: about every cache.boundary tokens, always at a chunk boundary."""
    return plan.n_batch * max(1, round(cache.boundary / plan.n_batch))


def _cached_start(cache: PrefixCache, plan) -> Snapshot | None:
    """The longest cached start of this document's prefix (checked), or None."""
    snap = cache.lookup(plan.model.fingerprint, plan.cache_signature(), plan.layout.prefix)
    if snap is not None:
        check_snapshot_document(snap, plan.layout, partial=True)
    return snap
