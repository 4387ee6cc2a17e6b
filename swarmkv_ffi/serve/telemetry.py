"""llama-server's own telemetry, for clients written against it.

`timings_per_token` asks for a `timings` object on every streamed event, and the final
answer carries one anyway; `verbose` asks for a whole answer's `__verbose` object (what was
read and written, as llama-server's debug field has it); `return_progress` asks for a `prompt_progress` event while the
prompt is read. Their fields are llama-server's (tools/server/server-common.cpp). Ours are
measured from the request's start, so prompt_ms includes time spent waiting for a seat;
generation's rates count the steps after the first token (which came with the prompt's last
step, and its time is the prompt's), as llama-server's do. The engine reads a prompt in
one go per request as far as the client can tell, so progress comes once, when the prompt
has been read, with the tokens forked from the cache (`cache`) apart from those decoded.
"""
from __future__ import annotations

import time


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def timings(call, choice) -> dict:
    """llama-server's `timings` of one choice so far."""
    now = time.perf_counter()
    first = choice.first_at or now
    cached = cached_tokens(choice)
    prompt_n = len(call.prompts[choice.index // call.body.n]) - cached
    prompt_ms = 1e3 * (first - call.started)
    predicted_ms = 1e3 * (now - first)
    steps = max(choice.n_tokens - 1, 0)      # the first token came with the prompt's last step
    return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": _rate(prompt_n, prompt_ms),
            "predicted_n": choice.n_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": _rate(steps, predicted_ms)}


def progress(call, choice) -> dict:
    """llama-server's `prompt_progress` once the choice's prompt has been read."""
    total = len(call.prompts[choice.index // call.body.n])
    return {"total": total, "cache": cached_tokens(choice), "processed": total,
            "time_ms": 1e3 * ((choice.first_at or time.perf_counter()) - call.started)}


def cached_tokens(choice) -> int:
    request = choice.job.request if choice.job is not None else None
    return request.cached if request is not None else 0


def verbose(call) -> dict:
    """llama-server's `__verbose` of a whole answer: its first choice's prompt as text (special
    tokens written out), what it wrote, its token counts and timings. The caller's own prompt:
    nothing of another request's."""
    choice = call.choices[0]
    prompt = call.prompts[0]
    generated = len(choice.result.generated) if choice.result is not None else 0
    return {"prompt": call.hosted.model.detokenize(prompt, unparse_special=True), "content": choice.text.sent,
            "tokens_evaluated": len(prompt) - cached_tokens(choice), "tokens_cached": cached_tokens(choice),
            "tokens_predicted": generated, "timings": timings(call, choice)}
