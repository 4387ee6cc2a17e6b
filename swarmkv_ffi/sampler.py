"""Sampler: libllama's sampler chain (greedy, or top-k → top-p → min-p → temperature → dist)."""
from __future__ import annotations

import numpy as np

from . import library
from ._owned import Owned

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: libllama picks a random seed


class Sampler(Owned):
    """temp <= 0 means greedy (the default). Otherwise the usual chain; `seed=None` lets
    libllama pick one, any int makes the draw reproducible."""

    def __init__(self, *, temp: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None):
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {min_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.settings = dict(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        lib = self._lib = library.backend()
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if temp <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(min_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temp))
            s = DEFAULT_SEED if seed is None else int(seed) & 0xFFFFFFFF
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(s))
        self._handle = chain
        self._closed = False

    def _release(self) -> None:
        self._lib.llama_sampler_free(self._handle)

    def sample(self, ctx, idx: int) -> int:
        """Pick a token from the logits of batch row `idx` of the last decode; the chain
        records it (llama_sampler_sample accepts the token itself)."""
        self._check_open()
        return int(self._lib.llama_sampler_sample(self._handle, ctx.handle, idx))

    def reset(self) -> None:
        self._check_open()
        self._lib.llama_sampler_reset(self._handle)


def logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under the model's distribution (the logits before
    any sampler), and the `top` most likely tokens with theirs, most likely first."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    logz = np.log(np.exp(shifted).sum())
    best = np.argpartition(-x, top)[:top] if top else np.empty(0, dtype=np.int64)
    best = best[np.argsort(-x[best], kind="stable")]
    return float(shifted[token] - logz), [(int(t), float(shifted[t] - logz)) for t in best]
