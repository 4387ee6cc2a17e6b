"""FanoutConfig: the settings a fan-out, its baseline, Ray and the benchmarks share.

One dataclass instead of the same keyword arguments repeated in every entry point, so a
new setting (or a changed default) reaches all of them at once.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace

from ..context import FLASH_ATTN, KV_TYPES
from .budget import DEFAULT_HEADROOM


@dataclass(frozen=True)
class FanoutConfig:
    """n_ctx: one sequence's context (None: sized from the document and answers).
    n_batch: prefill chunk size. headroom: cells kept free beyond the planned tokens.
    chat: wrap document + question in the model's chat template. n_threads: CPU threads
    (None: all). kv_type: KV cache type. flash_attn: "on", "off" or "auto".
    exact: batch-invariant kernels, so every branch's logits equal a plain run's bit for
    bit (see swarmkv_ffi/exact.py); forces flash attention on."""
    n_ctx: int | None = None
    n_batch: int = 512
    headroom: int = DEFAULT_HEADROOM
    chat: bool = True
    n_threads: int | None = None
    kv_type: str = "f16"        # chosen by measurement: bench/results/*/defaults/ and README
    flash_attn: str = "on"
    exact: bool = False

    @classmethod
    def of(cls, config: "FanoutConfig | None" = None, **settings) -> "FanoutConfig":
        """`config` (or the defaults) with `settings` replaced; unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown fan-out setting(s) {unknown}; known: {sorted(known)}")
        out = replace(config or cls(), **settings)
        out.validate()
        return out

    def validate(self) -> None:
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.n_batch}")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {self.kv_type!r}")
        if self.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, got {self.flash_attn!r}")
        if self.exact and self.flash_attn == "off":
            raise ValueError("exact mode needs flash attention (its reference kernel skips other "
                             "sequences' cells); flash_attn='off' cannot be exact")

    @property
    def threads(self) -> int:
        """The CPU threads contexts get: n_threads, or all of this machine's CPUs."""
        return self.n_threads or os.cpu_count() or 1

    @property
    def attention(self) -> str:
        """The flash-attention setting contexts get: exact mode always turns it on."""
        return "on" if self.exact else self.flash_attn

    def as_dict(self) -> dict:
        return asdict(self)
