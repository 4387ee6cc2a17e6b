"""The tests' own plain decode loop, written against Context and Batch only (no
generate(), no fan-out code): the independent anchor fidelity tests compare with."""
from __future__ import annotations

import numpy as np

from swarmkv_ffi import exact


def greedy(ctx, row: int) -> int:
    """The most likely token of `row`: a pick for one_token_per_decode."""
    return int(np.argmax(ctx.logits(row)))


def one_token_per_decode(ctx, batch, row: int, pos: int, max_tokens: int, pick) -> tuple[list[int], list[str]]:
    """From the logits in `row` of the last decode, pick a token, decode it alone, repeat:
    up to max_tokens tokens or end of generation. Returns the tokens and the digest of
    every row of logits a token was picked from. pick(ctx, row) -> token id."""
    model, tokens, digests = ctx.model, [], []
    while len(tokens) < max_tokens:
        digests.append(exact.digest(ctx.logits(row)))
        token = pick(ctx, row)
        if model.is_eog(token):
            break
        tokens.append(token)
        batch.clear()
        row = batch.add(token, pos, (0,), logits=True)
        ctx.decode(batch)
        pos += 1
    return tokens, digests
