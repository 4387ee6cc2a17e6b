"""The batch probe finds the first node whose value depends on the batch, and finds none
in exact mode: the configuration is what makes shared mode exact, and this test fails
without it (fast kernels) or without the patches (no llama_set_batch_invariant).

600 cells before the target put a lone query on flash attention's split-KV path (one
query over >= 512 cells, split across threads); 4 threads make the split real on any
machine. A batch of 2 or 4 queries takes the per-row path instead."""
from __future__ import annotations

import pytest

from swarmkv_ffi import fattn, probe


@pytest.mark.slow
def test_fast_kernels_differ_first_in_flash_attention(smol):
    # ggml's stock kernels: the shared-prefix kernel (patch 0003) would take the lone
    # query too in the default mode, and it is batch-invariant.
    with fattn.shared_kernel("off"):
        found = probe.probe(smol, 600, [2, 4], exact=False, kv_type="f16", n_threads=4)
    for d in found:
        assert d.first_op == "FLASH_ATTN_EXT", d
        assert d.max_abs_diff > 0
        assert d.nodes_compared > 0


@pytest.mark.slow
@pytest.mark.fidelity
def test_exact_kernels_equal_in_every_node(any_model):
    found = probe.probe(any_model, 600, [3, 16], exact=True, kv_type="f16", n_threads=2)
    for d in found:
        assert d.first_node is None, d
        assert d.nodes_compared > 100
