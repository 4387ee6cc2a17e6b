"""The fan-out's public types: what to ask (BranchSpec) and what came back (BranchResult,
FanoutResult). Every mode (shared, copy, baseline, Ray) returns a FanoutResult."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..generate import Answer, Generation

MODES = ("shared", "copy")   # run_fanout(mode=...); run_baseline and Ray report "baseline", "ray"


@dataclass
class BranchSpec:
    """One question to answer. `watermark`: how many document tokens it needs (None = all)."""
    question: str
    max_tokens: int = 64
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    watermark: int | None = None


@dataclass
class BranchResult:
    """One branch's answer, its full prompt and its timings (see fanout/__init__.py)."""
    index: int
    question: str
    n_prefix_used: int
    prompt_token_ids: list[int]
    prompt_text: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped_on_eog: bool = False
    ready_ms: float = 0.0
    prefill_ms: float = 0.0      # baseline only: this agent's own prefill of the document
    fork_ms: float = 0.0
    activation_ms: float = 0.0
    decode_ms: float = 0.0
    tokens_per_s: float = 0.0
    first_logits: np.ndarray | None = field(default=None, repr=False)
    logit_digests: list[str] = field(default_factory=list)  # trace_logits: exact.digest of each sampled row

    def record(self, answer: Answer, activation_ms: float) -> "BranchResult":
        """Copy a branch's answer in; activation_ms: from ready to its first token."""
        self.token_ids, self.text, self.stopped_on_eog = answer.tokens, answer.text, answer.stopped_on_eog
        self.activation_ms = activation_ms
        self.decode_ms, self.tokens_per_s = answer.decode_ms, answer.tokens_per_s
        self.first_logits, self.logit_digests = answer.first_logits, answer.logit_digests
        return self

    def record_generation(self, gen: Generation, setup_ms: float) -> "BranchResult":
        """A branch that ran generate(): setup_ms is what it paid before its prompt (a fork,
        or the baseline's own prefill), so activation = setup + first token."""
        return self.record(gen, setup_ms + gen.first_token_ms)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("first_logits")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BranchResult":
        """The inverse of to_dict (what a Ray actor sends back); first_logits stay None."""
        return cls(**d)


@dataclass
class FanoutResult:
    mode: str
    model: str
    n_prefix: int
    n_ctx: int
    prefill_ms: float
    prefill_skipped: bool
    snapshot_bytes: int
    total_ms: float
    branches: list[BranchResult]
    cached_tokens: int = 0          # document tokens restored (prefix cache or snapshot_in)
    cache_store_ms: float = 0.0     # writing this run's snapshots to the cache, after total_ms
    cache_warning: str | None = None  # why the cache could not store this run's snapshots
    extras: dict = field(default_factory=dict)  # what one mode alone measures (Ray: actors, retries)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["branches"] = [b.to_dict() for b in self.branches]
        return d
