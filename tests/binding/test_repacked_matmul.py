"""Our repacked GEMM/GEMV kernels on x86 against ggml's own kernel and exact sums: Q4_1
(kernels/ggml/0005), Q6_K and Q5_K (0006).

On x86 ggml multiplies Q4_1, Q6_K and Q5_K weights one vec_dot per row; the patches repack eight
weight rows per block at load (llama.cpp's CPU_REPACK buffer) and run a gemm over groups of
four batch rows, a gemv over the rest. `Model(..., repack=False)` keeps ggml's kernel. Q6_K
and Q5_K take ours by default only where ggml's tiled K-quant GEMM lacks its AVX-512 VNNI
kernel; GGML_KX8=on makes them take ours here on every build, so the kernels are compared
on every machine.

Logits of a deep model are no place to compare two kernels: thirty layers turn a rounding
difference into any other. So the comparison runs on a model that is one matmul: its layers
are zeros, so its logits are the quantized output matrix times the normalised embedding row, and
NumPy computes the same product exactly from the dequantized weights. Both kernels quantize
the activations to 8 bits the same way, which dominates their error; ours must be as close
to the exact product as ggml's and within rounding of ggml's answer. Exact mode runs the gemv
for every row and stays bit-identical whatever the batch (tests/binding/test_exact.py, default model).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

from swarmkv_ffi import Batch, Context, ContextParams, Model, catalog, library, tiny_gguf

pytestmark = pytest.mark.skipif("avx2" not in (library.manifest().get("cpu_features") or []),
                                reason="the repacked Q4_1, Q6_K and Q5_K kernels are built for x86 with AVX2 only")

#: a native build with these has ggml's VNNI tiled GEMM, which Q6_K and Q5_K keep by default
VNNI_GEMM = {"avx512_vnni", "avx512vl", "avx512dq"}
#: types the gguf package cannot quantize to: random blocks instead
RANDOM_BLOCKS = {"Q6_K": tiny_gguf.random_q6_k, "Q5_K": tiny_gguf.random_q5_k}
BATCHES = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33]   # gemv only, gemm + gemv remainders, several gemm groups
# Ours against ggml's answer: they differ by rounding only (for Q4_1 ggml rounds the activation
# sum to fp16, we keep fp32); a wrong interleave or a lost min term is off by order 1.
NEAR_GGML = 2e-5
# Ours against the exact product, relative to ggml's own distance from it.
NO_WORSE = 1.25


@pytest.fixture(autouse=True)
def our_k_quant_kernels(monkeypatch):
    """Q6_K and Q5_K take our kernels whatever this build would choose (GGML_KX8)."""
    monkeypatch.setenv("GGML_KX8", "on")


def buffer_mib(path, repack: bool, caplog) -> float:
    """Load `path` and return what libllama reports for its CPU_REPACK weights buffer
    (0.0 when it makes none)."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="swarmkv_ffi.llama"):
        Model(path, repack=repack).close()
    return sum(float(r.getMessage().split("=")[1].split()[0]) for r in caplog.records
               if "CPU_REPACK model buffer size" in r.getMessage())


def all_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """The logits of every position of `tokens`, decoded as one batch."""
    with Context(model, ContextParams(n_ctx=256, n_batch=64, n_ubatch=64)) as ctx:
        batch = Batch(len(tokens))
        for pos, token in enumerate(tokens):
            batch.add(token, pos, logits=True)
        ctx.decode(batch)
        return np.stack([ctx.logits(i).copy() for i in range(len(tokens))])


def nmse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: sum((a - b)^2) / sum(b^2), as ggml's test-backend-ops measures it."""
    return ((a - b) ** 2).sum(axis=-1) / (b ** 2).sum(axis=-1)


def one_matmul_model(path: str, n_embd: int, n_vocab: int, kind: str = "Q4_1"):
    """A model whose logits are one matmul: output (n_vocab x n_embd, of type `kind`) times
    rmsnorm(embedding row) (f32), every layer zero. Returns the path and an exact(tokens)
    that computes those logits in float64 from the dequantized weights."""
    import gguf
    kept, rng = {}, np.random.default_rng(n_embd + n_vocab)

    def weight(name, data):
        if name.startswith("blk."):
            return np.zeros_like(data), None
        if name != "output.weight":
            qtype, stored = gguf.GGMLQuantizationType.F32, data * 20
        elif kind in RANDOM_BLOCKS:
            qtype, stored = gguf.GGMLQuantizationType[kind], RANDOM_BLOCKS[kind](*data.shape, rng)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            stored = gguf.quants.quantize(data, qtype)
        kept[name] = gguf.quants.dequantize(stored, qtype).astype(np.float64)
        return stored, qtype

    shape = dict(n_embd=n_embd, n_head=n_embd // 32, n_head_kv=1, n_ff=64, n_layer=1, n_ctx=256, n_vocab=n_vocab)
    tiny_gguf.write_llama(path, f"one {kind} matmul", shape, weight)

    def exact(tokens):
        h = kept["token_embd.weight"][tokens]
        return (h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)) @ kept["output.weight"].T
    return path, exact


@pytest.fixture(scope="module", params=[("Q4_1", 96, 328), ("Q4_1", 576, 1024), ("Q4_1", 2048, 264),
                                        ("Q6_K", 256, 328), ("Q6_K", 1536, 576), ("Q6_K", 4096, 264),
                                        ("Q5_K", 256, 328), ("Q5_K", 1536, 576), ("Q5_K", 4096, 264)],
                ids=["q4_1-3-blocks", "q4_1-smollm2-width", "q4_1-64-blocks",
                     "q6_k-1-block", "q6_k-smollm2-ffn-width", "q6_k-16-blocks",
                     "q5_k-1-block", "q5_k-smollm2-ffn-width", "q5_k-16-blocks"])
def matmul(request, tmp_path_factory):
    kind, n_embd, n_vocab = request.param
    return one_matmul_model(str(tmp_path_factory.mktemp(kind) / "one.gguf"), n_embd, n_vocab, kind)


def test_the_default_model_takes_the_repacked_kernel(caplog):
    path = catalog.resolve("smollm2-135m")
    assert buffer_mib(path, True, caplog) > 50, "SmolLM2's Q4_1 matrices did not go to the CPU_REPACK buffer"
    assert buffer_mib(path, False, caplog) == 0


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_k_quants_keep_ggmls_layout_where_its_vnni_gemm_is_built(tmp_path, caplog, monkeypatch, kind):
    """By default Q6_K and Q5_K take our kernels unless this is a native build for a CPU
    with AVX-512 VNNI (ggml's tiled GEMM then ran 2.2-2.5x ours in prefill); GGML_KX8=off
    keeps ggml's anywhere."""
    path, _ = one_matmul_model(str(tmp_path / "one.gguf"), 256, 328, kind)
    manifest = library.manifest()
    vnni = manifest.get("cpu_target") == "native" and VNNI_GEMM <= set(manifest.get("cpu_features") or [])
    monkeypatch.delenv("GGML_KX8")
    assert (buffer_mib(path, True, caplog) > 0) == (not vnni)
    monkeypatch.setenv("GGML_KX8", "off")
    assert buffer_mib(path, True, caplog) == 0


@pytest.mark.parametrize("kind,width", [("Q4_1", 96), ("Q6_K", 256), ("Q5_K", 256)])
def test_rows_not_a_multiple_of_8_keep_ggml_kernel(tmp_path, caplog, kind, width):
    repacked, _ = one_matmul_model(str(tmp_path / "328.gguf"), width, 328, kind)
    odd, exact = one_matmul_model(str(tmp_path / "325.gguf"), width, 325, kind)
    assert buffer_mib(repacked, True, caplog) > 0
    assert buffer_mib(odd, True, caplog) == 0      # its only quantized matrix has 325 rows
    with Model(odd) as model:
        assert nmse(all_logits(model, [5, 6, 7, 8, 9]), exact([5, 6, 7, 8, 9])).max() < 1e-3


def test_ours_is_as_exact_as_ggml_at_every_batch_size(matmul):
    path, exact = matmul
    rng = np.random.default_rng(7)
    with Model(path, repack=True) as ours, Model(path, repack=False) as ggml:
        for n in BATCHES:
            tokens = [int(t) for t in rng.integers(3, ours.n_vocab, size=n)]
            a, b, want = all_logits(ours, tokens), all_logits(ggml, tokens), exact(tokens)
            assert nmse(a, b).max() < NEAR_GGML, f"batch of {n}: NMSE {nmse(a, b).max():.2e} from ggml's kernel"
            assert nmse(a, want).max() <= NO_WORSE * nmse(b, want).max(), (
                f"batch of {n}: ours {nmse(a, want).max():.2e} from the exact product, ggml's {nmse(b, want).max():.2e}")

