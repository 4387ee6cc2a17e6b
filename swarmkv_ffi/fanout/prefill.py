"""The document's prefill: where its chunks end, and the loop that decodes them.

Every mode prefills through prefill_stops, so a run that fills the prefix cache, a
watermark branch and a plain run all cut the document at the same places (outside exact
mode the kernels round differently for other chunkings)."""
from __future__ import annotations

from ..batch import Batch
from ..context import Context
from ..kvcache.thresholds import TAIL
from .plan import Plan


def prefill_stops(plan: Plan) -> list[int]:
    """Chunk boundaries: every n_batch tokens, at every watermark and cache point, and
    always TAIL tokens before the end (a prefix-cache point). Outside exact mode the
    kernels round differently for other chunkings, so a run that fills the cache must chunk
    like one that does not: then a restored document holds the bytes a cache-off run
    computes."""
    n = plan.layout.n_prefix
    stops = set(range(plan.n_batch, n, plan.n_batch)) | set(plan.watermarks) | set(plan.capture_at) | {n}
    if n > 2 * TAIL:
        stops.add(n - TAIL)
    return sorted(stops)


def prefill(plan: Plan, ctx: Context, upto: int | None = None, on_chunk=None, start: int = 0) -> None:
    """Decode the document's tokens start..upto (all by default; sequence 0 already holds
    the first `start`), in the plan's chunks, logits off; on_chunk(done) runs after each."""
    prefix = plan.layout.prefix
    upto = plan.layout.n_prefix if upto is None else upto
    done, batch = start, Batch(plan.n_batch)
    for stop in (s for s in prefill_stops(plan) if start < s <= upto):
        plan.check_stop()
        batch.clear().add_sequence(prefix[done:stop], done, 0, logits_last=False)
        ctx.decode(batch)
        done = stop
        if on_chunk:
            on_chunk(done)
