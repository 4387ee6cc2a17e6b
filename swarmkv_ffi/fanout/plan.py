"""The plan of a fan-out run: everything decided before any context or buffer exists
(prompt layout, watermarks, context budget, context parameters)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import exact
from ..context import Context, ContextParams
from ..errors import SnapshotMismatchError
from ..model import Model
from ..sampler import Sampler
from ..snapshot import Snapshot, params_signature, tokens_hash
from .budget import check_budget
from .config import FanoutConfig
from .dag import DagStopped
from .prompts import PromptLayout, layout
from .types import BranchResult, BranchSpec


@dataclass
class Plan:
    """Everything decided before any context or buffer exists."""
    model: Model
    layout: PromptLayout
    specs: list[BranchSpec]
    watermarks: list[int]
    n_ctx: int                            # resolved: config.n_ctx or sized from the layout
    config: FanoutConfig
    t0: int
    capture_at: frozenset = frozenset()   # prefix lengths to snapshot for the prefix cache
    stop: threading.Event = field(default_factory=threading.Event)  # set when the run times out

    @property
    def n_batch(self) -> int:
        return self.config.n_batch

    @property
    def headroom(self) -> int:
        return self.config.headroom

    @property
    def exact(self) -> bool:
        return self.config.exact

    def check_stop(self) -> None:
        """Give up between two decodes once the run has timed out."""
        if self.stop.is_set():
            raise DagStopped("the fan-out timed out; this step was not started")

    def ms(self, at_ns: int | None = None) -> float:
        """Milliseconds since the plan was made (until now, or until perf_counter_ns at_ns)."""
        return ((at_ns or time.perf_counter_ns()) - self.t0) / 1e6

    def context(self, n_ctx: int, n_seq_max: int = 1, n_batch: int | None = None) -> Context:
        return Context(self.model, self.params(n_ctx, n_seq_max, n_batch))

    def cache_signature(self) -> dict:
        """What decides a cached prefix's KV bytes besides model, commit and tokens: the
        KV layout, and the prefill chunk size (chunks round differently)."""
        return {**params_signature(self.params(self.n_ctx), self.model), "n_batch": self.n_batch}

    def params(self, n_ctx: int, n_seq_max: int = 1, n_batch: int | None = None) -> ContextParams:
        c = self.config
        # Forks see the whole shared prefix, so sliding-window layers keep a full cache.
        return ContextParams(n_ctx=n_ctx, n_batch=n_batch or c.n_batch,
                             n_ubatch=min(c.n_batch, 512), n_seq_max=n_seq_max,
                             kv_unified=True, swa_full=self.model.n_swa > 0,
                             type_k=c.kv_type, type_v=c.kv_type, flash_attn=c.attention,
                             batch_invariant=c.exact, n_threads=c.threads)

    def result(self, i: int) -> BranchResult:
        w = self.watermarks[i]
        tokens = np.concatenate([self.layout.prefix[:w], self.layout.suffixes[i]])
        return BranchResult(index=i, question=self.specs[i].question, n_prefix_used=w,
                            prompt_token_ids=tokens.tolist(), prompt_text=self.layout.texts[i])

    def sampler(self, i: int) -> Sampler:
        s = self.specs[i]
        return Sampler(temp=s.temp, top_p=s.top_p, seed=s.seed)


def plan_fanout(model: Model, document: str, specs: list[BranchSpec],
                config: FanoutConfig | None = None, **settings) -> Plan:
    """Tokenize, place watermarks and check the budget: no context exists yet.
    settings: FanoutConfig fields, overriding `config`."""
    t0 = time.perf_counter_ns()
    config = FanoutConfig.of(config, **settings)
    if not specs:
        raise ValueError("at least one branch is needed")
    if config.exact:
        exact.check_build()
    lay = layout(model, document, [s.question for s in specs], chat=config.chat)
    watermarks = []
    for i, s in enumerate(specs):
        if s.max_tokens < 1:
            raise ValueError(f"branch {i}: max_tokens must be >= 1, got {s.max_tokens}")
        w = lay.n_prefix if s.watermark is None else s.watermark
        if not 1 <= w <= lay.n_prefix:
            raise ValueError(f"branch {i}: watermark {w} outside 1..{lay.n_prefix} (document tokens)")
        watermarks.append(w)
    max_branch = max(len(lay.suffixes[i]) + s.max_tokens for i, s in enumerate(specs))
    n_ctx = config.n_ctx or round_up(lay.n_prefix + max_branch + config.headroom, 256)
    check_budget(lay.n_prefix, max_branch, n_ctx, config.headroom)
    return Plan(model, lay, list(specs), watermarks, n_ctx, config, t0=t0)


def check_snapshot_document(snap: Snapshot, lay: PromptLayout, partial: bool = False) -> None:
    """The snapshot must hold this document's prefix (or, if partial, a start of it)."""
    k = snap.header.n_tokens if partial else lay.n_prefix
    if snap.header.n_tokens != k or k > lay.n_prefix or snap.header.tokens_hash != tokens_hash(lay.prefix[:k]):
        raise SnapshotMismatchError(
            f"snapshot holds {snap.header.n_tokens} tokens (hash {snap.header.tokens_hash}) but "
            f"this document's prefix is {lay.n_prefix} tokens (hash {tokens_hash(lay.prefix)}): "
            "it was made from another document, model template or --chat setting")


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k
