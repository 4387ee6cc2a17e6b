"""One prompt, one sequence, one answer: the plain decode loop (llama.cpp's examples/simple),
and `Answer`, the step every decode loop of the package samples through.

The fan-out engine is compared against this loop, so it stays as linear as possible.
"""
from __future__ import annotations

import codecs
import time
from typing import Callable

import numpy as np

from . import exact
from .batch import Batch
from .context import Context
from .sampler import Sampler


def rate(n_tokens: int, ms: float) -> float:
    """Tokens per second after the first one (llama.cpp's eval rate: the first token's
    wait belongs to the prompt)."""
    return (n_tokens - 1) / (ms / 1e3) if n_tokens > 1 and ms > 0 else 0.0


class TextStream:
    """Turns token pieces into text without splitting UTF-8 characters; the control
    tokens in `shown` as their text (others write nothing)."""

    def __init__(self, model, shown: frozenset[int] = frozenset()):
        self.model, self.shown = model, shown
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self.model.token_bytes(token, special=token in self.shown))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class Answer:
    """One sequence's answer as it is sampled: the stop rule (end of generation, or
    max_tokens), its text, its logits on request, and its timing.

    generate() (and so lmxd and copy mode) and shared mode's branches all sample through
    take(), so they stop, count and time alike. trace_logits: keep the first row of logits
    and a digest of every sampled row (exact.digest)."""

    def __init__(self, model, max_tokens: int, *, trace_logits: bool = False,
                 on_text: Callable[[str], None] | None = None):
        self.model, self.max_tokens = model, max_tokens
        self.trace_logits, self.on_text = trace_logits, on_text
        self.tokens: list[int] = []
        self.text = ""
        self.stopped_on_eog = False
        self.first_logits: np.ndarray | None = None
        self.logit_digests: list[str] = []
        self.first_ns = self.last_ns = 0    # perf_counter_ns of the first and last sample
        self._stream = TextStream(model)
        self._pieces: list[str] = []

    def take(self, ctx: Context, row: int, sampler: Sampler) -> bool:
        """Sample the next token from `row` of ctx's last decode; True when the answer is
        complete (the token is then not appended if it ends the generation)."""
        if self.trace_logits:
            logits = ctx.logits(row)
            if self.first_logits is None:
                self.first_logits = logits.copy()
            self.logit_digests.append(exact.digest(logits))
        token = sampler.sample(ctx, row)
        self.last_ns = time.perf_counter_ns()
        self.first_ns = self.first_ns or self.last_ns
        if self.model.is_eog(token):
            self.stopped_on_eog = True
            return True
        self.tokens.append(token)
        self._emit(self._stream.push(token))
        return len(self.tokens) >= self.max_tokens

    def finish(self) -> None:
        """Flush the last partial character into the text."""
        self._emit(self._stream.flush())
        self.text = "".join(self._pieces)

    def _emit(self, text: str) -> None:
        self._pieces.append(text)
        if self.on_text and text:
            self.on_text(text)

    @property
    def decode_ms(self) -> float:
        """From the first sampled token to the last."""
        return (self.last_ns - self.first_ns) / 1e6

    @property
    def tokens_per_s(self) -> float:
        return rate(len(self.tokens), self.decode_ms)


class Generation(Answer):
    """generate()'s answer, with its prompt and the time the prompt took."""

    def __init__(self, model, prompt_tokens: list[int], max_tokens: int, **kwargs):
        super().__init__(model, max_tokens, **kwargs)
        self.prompt_tokens = prompt_tokens
        self.prompt_ms = 0.0
        self.first_token_ms = 0.0   # from the call to the first sampled token
        self.cancelled = False      # should_stop() said so before the answer was complete


def generate(ctx: Context, prompt_tokens, *, max_tokens: int = 64, sampler: Sampler | None = None,
             seq_id: int = 0, pos0: int = 0, on_text: Callable[[str], None] | None = None,
             trace_logits: bool = False,
             should_stop: Callable[[], bool] | None = None) -> Generation:
    """Decode `prompt_tokens` at positions pos0…, then sample up to `max_tokens` tokens,
    stopping at end-of-generation. `on_text` receives text as it is produced; `should_stop`
    is asked before each token and ends the loop early (Generation.cancelled).
    trace_logits: keep the first row of logits, and a digest of every sampled row."""
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    if len(prompt) == 0:
        raise ValueError("generate needs at least one prompt token")
    out = Generation(ctx.model, [int(t) for t in prompt], max_tokens,
                     trace_logits=trace_logits, on_text=on_text)
    own_sampler = sampler is None
    sampler = sampler or Sampler()
    try:
        t0 = time.perf_counter_ns()
        row = ctx.decode_tokens(prompt, pos0, seq_id)
        out.prompt_ms = (time.perf_counter_ns() - t0) / 1e6
        step, pos = Batch(1), pos0 + len(prompt)
        while max_tokens > 0:
            if should_stop is not None and should_stop():
                out.cancelled = True
                break
            if out.take(ctx, row, sampler):
                break
            step.clear()
            row = step.add(out.tokens[-1], pos, (seq_id,), logits=True)
            ctx.decode(step)
            pos += 1
        out.finish()
        out.first_token_ms = (out.first_ns - t0) / 1e6 if out.first_ns else 0.0
    finally:
        if own_sampler:
            sampler.close()
    return out
