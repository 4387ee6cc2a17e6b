"""The shared-prefix flash-attention kernel (kernels/ggml/0003) against ggml's reference.

Each case builds one GGML_OP_FLASH_ATTN_EXT on random data and runs it with ggml's
one-row reference kernel, with the new kernel, and in float64 numpy. Tolerances: the
reference kernel accumulates V in f16 when V is f16, so it is only ~1e-3 from float64;
the new kernel accumulates in f32 and must be much closer.

Then the property exact mode rests on: a row's result is bit-identical whatever else
is in the batch, however many threads run, and wherever its cells sit in the cache.
"""
import numpy as np
import pytest

from swarmkv_ffi import fattn

pytestmark = pytest.mark.fidelity


NEG = -np.inf


def rounded(x, kv_type):
    """What the op really sees of an f32 array stored as kv_type."""
    if kv_type == "GGML_TYPE_F16":
        return x.astype(np.float16).astype(np.float32)
    if kv_type == "GGML_TYPE_Q8_0":
        return q8_0(x)
    return x


def q8_0(x):
    """ggml's q8_0 round trip (quantize_row_q8_0_ref, then dequantize): blocks of 32 with
    an f16 scale amax/127 and the values rounded half away from zero."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    xq = (b * inv).astype(np.float32)
    q = np.sign(xq) * np.floor(np.abs(xq) + np.float32(0.5))
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float32)


def make(rng, *, n_seq=1, n_head, n_head_kv, n_tok, n_kv, dk, dv=None, kv_type="GGML_TYPE_F16"):
    dv = dv or dk
    q = rng.standard_normal((n_seq, n_head, n_tok, dk), dtype=np.float32)
    k = rounded(rng.standard_normal((n_seq, n_head_kv, n_kv, dk), dtype=np.float32), kv_type)
    v = rounded(rng.standard_normal((n_seq, n_head_kv, n_kv, dv), dtype=np.float32), kv_type)
    return q, k, v


def causal(n_seq, n_tok, n_kv, start):
    """Token t sees cells 0..start+t (a prefill continuing a cache of `start` cells)."""
    cells = np.arange(n_kv)[None, :]
    rows = (start + np.arange(n_tok))[:, None]
    return np.broadcast_to(np.where(cells <= rows, 0.0, NEG), (n_seq, n_tok, n_kv)).astype(np.float32)


def fanout(n_doc, n_branch, steps, n_kv):
    """The fan-out's decode mask: every branch sees the document, then its own cells,
    which sit interleaved with the other branches' (one cell per branch per step)."""
    mask = np.full((1, n_branch, n_kv), NEG, np.float32)
    mask[0, :, :n_doc] = 0.0
    for b in range(n_branch):
        own = n_doc + np.arange(steps) * n_branch + b
        mask[0, b, own[own < n_kv]] = 0.0
    return mask


def holes(rng, n_seq, n_tok, n_kv, p=0.3):
    mask = np.where(rng.random((n_seq, n_tok, n_kv)) < p, NEG, 0.0).astype(np.float32)
    mask[:, 0, :] = NEG    # one fully masked row
    return mask


def check(q, k, v, mask, *, kv_type="GGML_TYPE_F16", tol_new=2e-5, **op):
    want = fattn.attention_f64(q, k, v, mask, **op)
    got = fattn.flash_attn(q, k, v, mask, kv_type=kv_type, kernel="shared", n_threads=2, **op)
    ref = fattn.flash_attn(q, k, v, mask, kv_type=kv_type, kernel="reference", n_threads=2, **op)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(ref - want).max() <= 5e-3 * scale, "ggml's reference kernel itself is off"
    assert np.abs(got - want).max() <= tol_new * scale
    assert np.abs(got - ref).max() <= 5e-3 * scale
    return got


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("dk", [64, 128, 256])
def test_random_shapes_causal_and_holes(gqa, dk):
    rng = np.random.default_rng(gqa * 1000 + dk)
    n_head_kv = 2 if gqa < 8 else 1
    n_tok, n_kv = 37, 333      # n_kv not a multiple of the 128-cell chunk
    q, k, v = make(rng, n_head=gqa * n_head_kv, n_head_kv=n_head_kv, n_tok=n_tok, n_kv=n_kv, dk=dk)
    check(q, k, v, causal(1, n_tok, n_kv, n_kv - n_tok), scale=dk ** -0.5)
    check(q, k, v, holes(rng, 1, n_tok, n_kv), scale=dk ** -0.5)


def test_fanout_decode_layout_and_two_sequences():
    rng = np.random.default_rng(7)
    n_doc, n_branch, steps = 700, 16, 9
    n_kv = n_doc + n_branch * steps
    q, k, v = make(rng, n_head=9, n_head_kv=3, n_tok=n_branch, n_kv=n_kv, dk=64)
    check(q, k, v, fanout(n_doc, n_branch, steps, n_kv), scale=0.125)
    q2, k2, v2 = make(rng, n_seq=2, n_head=4, n_head_kv=2, n_tok=5, n_kv=260, dk=64)
    check(q2, k2, v2, causal(2, 5, 260, 255), scale=0.125)


def test_sinks_softcap_alibi_no_mask_and_head_sizes_apart():
    rng = np.random.default_rng(11)
    q, k, v = make(rng, n_head=8, n_head_kv=2, n_tok=6, n_kv=300, dk=64, dv=72)
    mask = holes(rng, 1, 6, 300)
    check(q, k, v, mask, scale=0.125, sinks=rng.standard_normal(8).astype(np.float32))
    check(q, k, v, mask, scale=0.125, softcap=3.0)
    check(q, k, v, mask, scale=0.125, max_bias=8.0)
    check(q, k, v, None, scale=0.125)


def test_q8_0_kv_and_f32_kv():
    rng = np.random.default_rng(13)
    q, k, v = make(rng, n_head=6, n_head_kv=2, n_tok=4, n_kv=200, dk=64, kv_type="GGML_TYPE_F32")
    mask = causal(1, 4, 200, 196)
    check(q, k, v, mask, kv_type="GGML_TYPE_F32", scale=0.125)
    # q8_0, most cells masked: K and V are q8_0 values already, so the new kernel, which
    # dequantises them, must be as close to float64 as with f32 KV; ggml's reference also
    # quantises Q to q8_0 (an integer dot), about 1/127 of the logits off.
    q, k, v = make(rng, n_head=6, n_head_kv=2, n_tok=4, n_kv=320, dk=64, kv_type="GGML_TYPE_Q8_0")
    mask = holes(rng, 1, 4, 320, p=0.8)
    want = fattn.attention_f64(q, k, v, mask, scale=0.125)
    got = fattn.flash_attn(q, k, v, mask, kv_type="GGML_TYPE_Q8_0", kernel="shared", scale=0.125)
    ref = fattn.flash_attn(q, k, v, mask, kv_type="GGML_TYPE_Q8_0", kernel="reference", scale=0.125)
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-5 * scale
    assert np.abs(ref - want).max() <= 3e-2 * scale
    assert np.abs(got - ref).max() <= 3e-2 * scale


def test_a_row_is_bit_identical_alone_in_a_batch_and_on_any_thread_count():
    rng = np.random.default_rng(17)
    n_doc, n_branch, steps = 1000, 16, 5
    n_kv = n_doc + n_branch * steps
    q, k, v = make(rng, n_head=9, n_head_kv=3, n_tok=n_branch, n_kv=n_kv, dk=64)
    mask = fanout(n_doc, n_branch, steps, n_kv)
    batch1 = fattn.flash_attn(q, k, v, mask, kernel="shared", scale=0.125, n_threads=1)
    batch2 = fattn.flash_attn(q, k, v, mask, kernel="shared", scale=0.125, n_threads=2)
    assert np.array_equal(batch1, batch2)
    for b in (0, 7, 15):
        alone = fattn.flash_attn(q[:, :, b:b + 1], k, v, mask[:, b:b + 1], kernel="shared",
                                 scale=0.125, n_threads=2)
        assert np.array_equal(alone[0, 0], batch1[0, b])
        exact = fattn.flash_attn(q[:, :, b:b + 1], k, v, mask[:, b:b + 1], kernel="exact",
                                 scale=0.125, n_threads=1)
        assert np.array_equal(exact, alone), "exact mode must run the same kernel for one row"


@pytest.mark.parametrize("gqa,dk", [(1, 64), (2, 128), (3, 64), (4, 256), (3, 80)])
def test_few_rows_read_f16_directly_and_give_the_gemm_paths_bits(gqa, dk):
    """A unit of at most 4 rows over f16 K/V computes straight from the f16 rows (no f32
    copies, patch 0003); more rows take the GEMMs. Same sums in the same order: a row
    alone (gqa rows per unit) equals that row in a batch of 8 tokens (8*gqa rows), with
    chunks that end mid-vector (1,029 cells) and a branch's own cells gathered."""
    rng = np.random.default_rng(gqa * 1000 + dk)
    n_doc, n_branch, steps = 1005, 8, 3
    n_kv = n_doc + n_branch * steps
    q, k, v = make(rng, n_head=2 * gqa, n_head_kv=2, n_tok=n_branch, n_kv=n_kv, dk=dk)
    mask = fanout(n_doc, n_branch, steps, n_kv)
    batch = check(q, k, v, mask, scale=dk ** -0.5)
    for b in (0, 5):
        alone = fattn.flash_attn(q[:, :, b:b + 1], k, v, mask[:, b:b + 1], kernel="shared", scale=dk ** -0.5,
                                 n_threads=2)
        assert np.array_equal(alone[0, 0], batch[0, b])


def test_a_row_does_not_depend_on_where_its_cells_sit():
    """A branch's cells interleaved with other branches' (shared mode) or contiguous
    after the document (a plain run): the same visible cells in the same order give the
    same bits."""
    rng = np.random.default_rng(19)
    n_doc, n_branch, steps, b = 900, 4, 40, 2
    n_kv = n_doc + n_branch * steps
    q, k, v = make(rng, n_head=6, n_head_kv=2, n_tok=n_branch, n_kv=n_kv, dk=128)
    mask = fanout(n_doc, n_branch, steps, n_kv)
    shared = fattn.flash_attn(q, k, v, mask, kernel="shared", scale=128 ** -0.5)
    own = n_doc + np.arange(steps) * n_branch + b
    order = np.concatenate([np.arange(n_doc), own])
    plain_k, plain_v = k[:, :, order], v[:, :, order]
    plain_mask = np.zeros((1, 1, len(order)), np.float32)
    plain = fattn.flash_attn(q[:, :, b:b + 1], plain_k, plain_v, plain_mask, kernel="shared",
                             scale=128 ** -0.5)
    assert np.array_equal(plain[0, 0], shared[0, b])
