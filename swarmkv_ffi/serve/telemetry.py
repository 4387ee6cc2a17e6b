"""llama-server's own telemetry, for clients written against it.

`timings_per_token` asks for a `timings` object on every streamed event, and the final
answer carries one anyway; `verbose` asks for a whole answer's `__verbose` object (what was
read and written, as llama-server's debug field has it); `return_progress` asks for
`prompt_progress` events while the prompt is read. Their fields are llama-server's
(tools/server/server-common.cpp). Ours are measured from the request's start, so prompt_ms
includes time spent waiting for a seat; generation's rates count the steps after the first
token (which came with the prompt's last step, and its time is the prompt's), as
llama-server's do. Progress, as there: first the tokens forked from the cache (`cache`,
nothing read yet), then the prompt's tokens in cells after each step that read a chunk of
it (a long prompt takes several, at most the batch's rows each), the last when it is all
read (its first token come).
"""
from __future__ import annotations

import time


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def timings(call, choice, read: int | None = None) -> dict:
    """llama-server's `timings` of one choice so far; `read`: as a progress report had it,
    the prompt's tokens in cells (nothing generated yet)."""
    now = time.perf_counter()
    first = choice.first_at or now
    cached = cached_tokens(choice)
    prompt_n = (len(call.prompts[choice.index // call.body.n]) if read is None else read) - cached
    prompt_ms = 1e3 * (first - call.started) if prompt_n else 0.0
    predicted_n, predicted_ms = (choice.n_tokens, 1e3 * (now - first)) if read is None else (0, 0.0)
    steps = max(predicted_n - 1, 0)      # the first token came with the prompt's last step
    return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": _rate(prompt_n, prompt_ms),
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": _rate(steps, predicted_ms)}


def progress(call, choice, read: int | None = None) -> list[tuple[dict, dict]]:
    """llama-server's `prompt_progress` reports due now, each with its timings: the first
    time, the tokens forked from the cache (none read yet); then `read`, the prompt's
    tokens in cells (None: all of them, its first token come). A report is never sent twice
    nor goes back (a prompt read again after its cells were taken for others)."""
    total = len(call.prompts[choice.index // call.body.n])
    cache = cached_tokens(choice)
    due = [cache] if choice.progress is None else []
    last = cache if choice.progress is None else choice.progress
    read = total if read is None else min(read, total)
    if read > last:
        due.append(read)
    if due:
        choice.progress = due[-1]
    at = choice.first_at or time.perf_counter()
    return [({"total": total, "cache": cache, "processed": n, "time_ms": 1e3 * (at - call.started)},
             timings(call, choice, None if n == total else n)) for n in due]


def cached_tokens(choice) -> int:
    """The choice's prompt tokens forked from cells (the cache), not decoded."""
    request = choice.job.request if choice.job is not None else None
    return request.cached if request is not None else choice.forked


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
