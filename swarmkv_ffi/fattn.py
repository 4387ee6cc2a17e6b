"""ggml's CPU flash-attention op called directly on numpy arrays.

The bench for kernels/ggml/0003-shared-prefix-flash-attention.patch: one op, any shape,
any mask, any thread count, with the kernel chosen explicitly, so the shared-prefix
kernel can be compared with ggml's own reference kernel (and with numpy) without a
model. The op runs through ggml's plain graph API (ggml_graph_plan/ggml_graph_compute),
the same code llama_decode reaches through the CPU backend.

Layouts follow ggml's, fastest dimension last in numpy:
  q    [n_seq, n_head,    n_tok, DK]  float32
  k    [n_seq, n_head_kv, n_kv,  DK]  float32 (stored as kv_type)
  v    [n_seq, n_head_kv, n_kv,  DV]  float32 (stored as kv_type)
  mask [n_seq, n_tok, n_kv]           float32, 0 or a bias where visible, -inf where not
  out  [n_seq, n_tok, n_head, DV]     float32
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
from cffi import FFI

from . import library

_CDEF = """
struct ggml_context;
struct ggml_tensor;
struct ggml_cgraph;
struct ggml_threadpool;
typedef uint16_t ggml_fp16_t;
typedef bool (*ggml_abort_callback)(void * data);
struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
struct ggml_cplan {
    size_t work_size; uint8_t * work_data; int n_threads; struct ggml_threadpool * threadpool;
    ggml_abort_callback abort_callback; void * abort_callback_data; bool use_ref;
};
struct ggml_context * ggml_init(struct ggml_init_params params);
void                  ggml_free(struct ggml_context * ctx);
struct ggml_tensor *  ggml_new_tensor_4d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor *  ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                          struct ggml_tensor * v, struct ggml_tensor * mask,
                                          float scale, float max_bias, float logit_softcap);
void                  ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
struct ggml_cgraph *  ggml_new_graph(struct ggml_context * ctx);
void                  ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
void *                ggml_get_data(const struct ggml_tensor * tensor);
size_t                ggml_nbytes(const struct ggml_tensor * tensor);
size_t                ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
                                          int64_t nrows, int64_t n_per_row, const float * imatrix);
void                  ggml_fp32_to_fp16_row(const float * x, ggml_fp16_t * y, int64_t n);
void                  ggml_cpu_init(void);
struct ggml_cplan     ggml_graph_plan(const struct ggml_cgraph * cgraph, int n_threads, struct ggml_threadpool * threadpool);
int                   ggml_graph_compute(struct ggml_cgraph * cgraph, struct ggml_cplan * cplan);
void                  ggml_cpu_set_fa_shared(int mode);
int                   ggml_cpu_get_fa_shared(void);
"""

_ffi = FFI()
_ffi.cdef(_CDEF)
_lib = None
_lock = threading.RLock()  # the kernel choice is process-wide in ggml; shared_kernel() may wrap flash_attn()

#: Which kernel runs, as ggml_cpu_set_fa_shared takes it.
KERNELS = {
    "reference": (1, True),    # GGML_FA_SHARED_OFF + use_ref: ggml's one-row reference kernel
    "stock": (1, False),       # GGML_FA_SHARED_OFF: ggml's fast kernels (split-KV, tiled)
    "shared": (2, False),      # GGML_FA_SHARED_ON: the shared-prefix kernel at every shape
    "exact": (0, True),        # AUTO + use_ref: what exact mode runs
    "auto": (0, False),        # AUTO: what the default mode runs
}
_TYPES = library.enum("ggml_type")


def _load():
    global _lib
    if _lib is None:
        library.lib()   # checked, and the calibrated kernel rule applied, as for a model
        lib = _ffi.dlopen(str(library.find_library()))
        if not hasattr(lib, "ggml_cpu_set_fa_shared"):
            raise RuntimeError("this libllama predates kernels/ggml/0003 (no ggml_cpu_set_fa_shared); "
                               "rebuild it with ./build_llama.sh")
        lib.ggml_cpu_init()
        _lib = lib
    return _lib


MODES = {"auto": 0, "off": 1, "on": 2}


@contextlib.contextmanager
def shared_kernel(mode: str):
    """Process-wide choice of the flash-attention kernel for everything computed inside
    the block (llama_decode included): "auto" (the patch's default rule), "off" (stock
    ggml kernels; exact mode then runs ggml's reference kernel) or "on" (the
    shared-prefix kernel wherever it applies). Like GGML_FA_SHARED, for comparisons."""
    lib = _load()
    with _lock:
        lib.ggml_cpu_set_fa_shared(MODES[mode])
        try:
            yield
        finally:
            lib.ggml_cpu_set_fa_shared(-1)


def _fill(lib, tensor, values: np.ndarray, type_name: str) -> None:
    """Write float32 values into a ggml tensor of the given type (converting rows)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, values.shape[-1])
    dst = lib.ggml_get_data(tensor)
    src = _ffi.cast("float *", _ffi.from_buffer(flat))
    if type_name == "GGML_TYPE_F32":
        _ffi.memmove(dst, flat, flat.nbytes)
    elif type_name == "GGML_TYPE_F16":
        lib.ggml_fp32_to_fp16_row(src, _ffi.cast("ggml_fp16_t *", dst), flat.size)
    else:
        lib.ggml_quantize_chunk(_TYPES[type_name], src, dst, 0, flat.shape[0], flat.shape[1], _ffi.NULL)


def flash_attn(q, k, v, mask=None, *, kernel: str = "shared", n_threads: int = 1, **op) -> np.ndarray:
    """Run GGML_OP_FLASH_ATTN_EXT once on the CPU with the named kernel (see KERNELS).
    op: scale (required), max_bias, softcap, sinks, kv_type (a ggml_type name, f16 default)."""
    return _run(q, k, v, mask, kernel=kernel, n_threads=n_threads, repeat=1, **op)[0]


def time_flash_attn(q, k, v, mask=None, *, kernel: str, n_threads: int, repeat: int = 5, **op) -> list[float]:
    """Seconds of each of `repeat` computes of the same op (data written once)."""
    return _run(q, k, v, mask, kernel=kernel, n_threads=n_threads, repeat=repeat, **op)[1]


def _run(q, k, v, mask, *, scale: float, max_bias: float = 0.0, softcap: float = 0.0, sinks=None,
         kv_type: str = "GGML_TYPE_F16", kernel: str, n_threads: int, repeat: int):
    lib = _load()
    mode, use_ref = KERNELS[kernel]
    n_seq, n_head, n_tok, dk = q.shape
    _, n_head_kv, n_kv, dv = v.shape
    f32, f16 = _TYPES["GGML_TYPE_F32"], _TYPES["GGML_TYPE_F16"]
    kvt = _TYPES[kv_type]
    size = (q.nbytes + 2 * k.nbytes + 2 * v.nbytes + (mask.nbytes if mask is not None else 0)
            + n_seq * n_tok * n_head * dv * 4 + 4 * n_head + (1 << 20))
    ctx = lib.ggml_init({"mem_size": size, "mem_buffer": _ffi.NULL, "no_alloc": False})
    if ctx == _ffi.NULL:
        raise MemoryError(f"ggml_init could not allocate {size} bytes")
    try:
        tq = lib.ggml_new_tensor_4d(ctx, f32, dk, n_tok, n_head, n_seq)
        tk = lib.ggml_new_tensor_4d(ctx, kvt, dk, n_kv, n_head_kv, n_seq)
        tv = lib.ggml_new_tensor_4d(ctx, kvt, dv, n_kv, n_head_kv, n_seq)
        _fill(lib, tq, q, "GGML_TYPE_F32")
        _fill(lib, tk, k, kv_type)
        _fill(lib, tv, v, kv_type)
        tm = _ffi.NULL
        if mask is not None:
            tm = lib.ggml_new_tensor_4d(ctx, f16, n_kv, n_tok, 1, mask.shape[0])
            _fill(lib, tm, mask, "GGML_TYPE_F16")
        out = lib.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, max_bias, softcap)
        if sinks is not None:
            ts = lib.ggml_new_tensor_4d(ctx, f32, n_head, 1, 1, 1)
            _fill(lib, ts, np.asarray(sinks, np.float32).reshape(1, -1), "GGML_TYPE_F32")
            lib.ggml_flash_attn_ext_add_sinks(out, ts)
        graph = lib.ggml_new_graph(ctx)
        lib.ggml_build_forward_expand(graph, out)
        seconds = []
        with _lock:
            previous = lib.ggml_cpu_get_fa_shared()   # a shared_kernel() block's choice, if any
            lib.ggml_cpu_set_fa_shared(mode)
            try:
                plan = lib.ggml_graph_plan(graph, n_threads, _ffi.NULL)
                work = np.empty(max(plan.work_size, 1), dtype=np.uint8)
                plan.work_data = _ffi.cast("uint8_t *", _ffi.from_buffer(work))
                plan.use_ref = use_ref
                cplan = _ffi.new("struct ggml_cplan *", plan)
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    status = lib.ggml_graph_compute(graph, cplan)
                    seconds.append(time.perf_counter() - t0)
                    if status != 0:
                        raise RuntimeError(f"ggml_graph_compute returned status {status}")
            finally:
                lib.ggml_cpu_set_fa_shared(previous)
        res = np.frombuffer(_ffi.buffer(lib.ggml_get_data(out), lib.ggml_nbytes(out)), dtype=np.float32)
        return res.reshape(n_seq, n_tok, n_head, dv).copy(), seconds
    finally:
        lib.ggml_free(ctx)


def attention_f64(q, k, v, mask=None, *, scale: float, softcap: float = 0.0, sinks=None,
                  max_bias: float = 0.0) -> np.ndarray:
    """The same attention in float64 numpy, for an independent check of both kernels."""
    n_seq, n_head, n_tok, _ = q.shape
    gqa = n_head // k.shape[1]
    out = np.zeros((n_seq, n_tok, n_head, v.shape[-1]))
    n_head_log2 = 1 << int(np.floor(np.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_head_log2), 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    for s in range(n_seq):
        for h in range(n_head):
            slope = 1.0 if max_bias <= 0 else (m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1))
            kk, vv = k[s, h // gqa].astype(np.float64), v[s, h // gqa].astype(np.float64)
            logits = q[s, h].astype(np.float64) @ kk.T * scale
            if softcap:
                logits = softcap * np.tanh(logits / softcap)
            if mask is not None:
                logits = logits + slope * mask[s].astype(np.float64)
            m = logits.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, sinks[h])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(logits - m)
            denom = p.sum(axis=1, keepdims=True)
            if sinks is not None:
                denom = denom + np.exp(sinks[h] - m)
            out[s, :, h] = np.divide(p @ vv, denom, out=np.zeros((n_tok, vv.shape[1])), where=denom > 0)
    return out
