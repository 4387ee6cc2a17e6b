"""Sampler: libllama's sampler chain.

    logit bias → penalties → greedy, or top-k → top-p → min-p → temperature → dist

The bias and the penalties come first so that they move the logits both greedy and the
sampled chain choose from; each link is added only when it changes something.
"""
from __future__ import annotations

import numpy as np

from . import library
from ._owned import Owned
from .library import ffi

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: libllama picks a random seed
#: llama_token_data as numpy reads it
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler(Owned):
    """temp <= 0 means greedy (the default). Otherwise the usual chain; `seed=None` lets
    libllama pick one, any int makes the draw reproducible. logit_bias {token: bias} is
    added to those tokens' logits; the penalties (llama.cpp's, over the last
    penalty_last_n tokens the chain has chosen) lower tokens already generated: presence
    by a fixed amount, frequency by each time it came, repeat by dividing. Both need
    n_vocab, the model's vocabulary size. `post_sampling`: the run reports the chain's
    probabilities (sample_candidates), not the model's."""

    def __init__(self, *, temp: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None, logit_bias: dict[int, float] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 penalty_last_n: int = 64, n_vocab: int | None = None, post_sampling: bool = False):
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {min_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if repeat_penalty <= 0 or penalty_last_n < 1:
            raise ValueError("repeat_penalty must be > 0 and penalty_last_n >= 1")
        penalised = presence_penalty != 0 or frequency_penalty != 0 or repeat_penalty != 1.0
        if (logit_bias or penalised) and not n_vocab:
            raise ValueError("logit_bias and the penalties need n_vocab")
        if logit_bias and not all(0 <= t < n_vocab for t in logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary (0..{n_vocab - 1})")
        self.settings = dict(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                             logit_bias=dict(logit_bias or {}), presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty)
        self.post_sampling = post_sampling
        lib = self._lib = library.backend()
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if logit_bias:
            bias = ffi.new("llama_logit_bias[]", [{"token": int(t), "bias": float(b)} for t, b in logit_bias.items()])
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_logit_bias(n_vocab, len(logit_bias), bias))
        if penalised:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_penalties(
                n_vocab, penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty))
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

    def sample_candidates(self, ctx, idx: int, top: int) -> tuple[int, tuple[float, list[tuple[int, float]]]]:
        """Pick as sample() does, and say what the chain left to draw from (llama-server's
        post_sampling_probs): the token and (its log-probability after the chain, the
        `top` likeliest candidates with theirs, none of probability 0). Greedy draws from
        one candidate, its probability 1, as a temperature of 0 leaves llama.cpp's chain."""
        self._check_open()
        if self.settings["temp"] <= 0:
            token = self.sample(ctx, idx)
            return token, (0.0, [(token, 0.0)])
        logits = ctx.logits(idx)
        data = ffi.new("llama_token_data[]", logits.size)
        view = np.frombuffer(ffi.buffer(data), dtype=TOKEN_DATA)
        view["id"], view["logit"], view["p"] = np.arange(logits.size), logits, 0.0
        cur = ffi.new("llama_token_data_array *", {"data": data, "size": logits.size, "selected": -1, "sorted": False})
        self._lib.llama_sampler_apply(self._handle, cur)
        left = np.frombuffer(ffi.buffer(cur.data, cur.size * TOKEN_DATA.itemsize), dtype=TOKEN_DATA).copy()
        token = int(left["id"][cur.selected])
        self._lib.llama_sampler_accept(self._handle, token)
        order = np.argsort(-left["p"], kind="stable")[:top]
        best = [(int(left["id"][i]), float(np.log(left["p"][i]))) for i in order if left["p"][i] > 0]
        return token, (float(np.log(left["p"][cur.selected])), best)

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
