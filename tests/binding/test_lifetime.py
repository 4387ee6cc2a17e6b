"""Creating and freeing many contexts must not leak: RSS stays flat."""
from __future__ import annotations

import gc

import pytest

from swarmkv_ffi import Context
from swarmkv_ffi.procmem import rss_bytes


def churn(model, n):
    for _ in range(n):
        with Context(model, n_ctx=256, n_batch=64) as ctx:
            ctx.decode_tokens(model.tokenize("The quick brown fox"))


@pytest.mark.slow
def test_200_contexts_keep_rss_flat(smol):
    churn(smol, 20)  # warm up allocator pools and libllama's one-time caches
    gc.collect()
    before = rss_bytes()
    churn(smol, 200)
    gc.collect()
    growth = rss_bytes() - before
    # One context here holds ~6 MiB of KV and buffers; a leak of one per iteration
    # would add >1 GiB. Allow allocator noise only.
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 200 contexts"
