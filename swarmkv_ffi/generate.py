"""One prompt, one sequence, one answer: the plain decode loop (llama.cpp's examples/simple).

The fan-out engine is compared against this loop, so it stays as linear as possible.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import exact
from .batch import Batch
from .context import Context
from .sampler import Sampler


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped_on_eog: bool = False
    prompt_ms: float = 0.0
    first_token_ms: float = 0.0  # from the call to the first sampled token
    decode_ms: float = 0.0       # from the end of the prompt to the last token
    first_logits: np.ndarray | None = None  # logits the first token was sampled from
    logit_digests: list[str] = field(default_factory=list)  # keep_first_logits: every sampled row's
    cancelled: bool = False      # should_stop() said so before the answer was complete

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


class TextStream:
    """Turns token pieces into text without splitting UTF-8 characters."""

    def __init__(self, model):
        self.model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self.model.token_bytes(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def generate(ctx: Context, prompt_tokens, *, max_tokens: int = 64, sampler: Sampler | None = None,
             seq_id: int = 0, pos0: int = 0, on_text: Callable[[str], None] | None = None,
             keep_first_logits: bool = False,
             should_stop: Callable[[], bool] | None = None) -> Generation:
    """Decode `prompt_tokens` at positions pos0…, then sample up to `max_tokens` tokens,
    stopping at end-of-generation. `on_text` receives text as it is produced; `should_stop`
    is asked before each token and ends the loop early (Generation.cancelled).
    keep_first_logits: keep the first row of logits, and a digest of every sampled row."""
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    if len(prompt) == 0:
        raise ValueError("generate needs at least one prompt token")
    own_sampler = sampler is None
    sampler = sampler or Sampler()
    model = ctx.model
    out = Generation(prompt_tokens=[int(t) for t in prompt])
    stream = TextStream(model)
    pieces = []
    try:
        t0 = time.perf_counter_ns()
        row = ctx.decode_tokens(prompt, pos0, seq_id)
        t1 = time.perf_counter_ns()
        out.prompt_ms = (t1 - t0) / 1e6
        step = Batch(1)
        pos = pos0 + len(prompt)
        for i in range(max_tokens):
            if should_stop is not None and should_stop():
                out.cancelled = True
                break
            if keep_first_logits:
                if i == 0:
                    out.first_logits = ctx.logits(row).copy()
                out.logit_digests.append(exact.digest(ctx.logits(row)))
            token = sampler.sample(ctx, row)
            if i == 0:
                out.first_token_ms = (time.perf_counter_ns() - t0) / 1e6
            if model.is_eog(token):
                out.stopped_on_eog = True
                break
            out.tokens.append(token)
            text = stream.push(token)
            pieces.append(text)
            if on_text and text:
                on_text(text)
            if len(out.tokens) == max_tokens:
                break
            step.clear()
            row = step.add(token, pos, (seq_id,), logits=True)
            ctx.decode(step)
            pos += 1
        tail = stream.flush()
        pieces.append(tail)
        if on_text and tail:
            on_text(tail)
        out.decode_ms = (time.perf_counter_ns() - t1) / 1e6
    finally:
        if own_sampler:
            sampler.close()
    out.text = "".join(pieces)
    return out
