#!/usr/bin/env bash
# Every GPU check in one run, written for the GPU machine this project may be lent as it
# is: Python 3.12 with numpy, numba, numba-cuda, nvidia-ml-py, pytest, cmake, ninja and
# nvcc, no network, no cffi or gguf (their wheels travel with the tree: run
# bench/gpu_wheels.sh here first), a few minutes of time.
#
#   bench/gpu_check.sh [--out DIR] [--dry-run]
#
# Steps, ordered so that a run cut short still returns what it measured:
#   setup            install bench/.wheels into DIR/site and put it and the tree on PYTHONPATH
#   device           numba sees a CUDA device and compiles a kernel (exit 2 here if not)
#   kernel_tests     tests/kernels/test_kernels.py on the GPU (the dry-run test deselected)
#   streamer_default the layer streamer at its defaults (JSON)
#   streamer_balance the same with --balance (JSON)
#   llama_cuda_build ./build_llama.sh --cuda --cuda-arch ${CUDA_ARCH:-90} --tools-min into the cache,
#                    from bench/.wheels/llama-src.tar.xz (no network there); its time is logged
#   model            random weights with Llama-3.2-1B's shapes, Q4_K_M (the build's llama-quantize)
#   fanout           shared and copy mode at N = 1, 4, 16 on the GPU (JSON with timings)
#   fanout_exact     exact shared vs exact copy, tokens compared (CPU kernels: CUDA hidden)
#   batched_bench    llama-batched-bench with the same document, N and tokens (JSONL)
# Every result goes into DIR (default bench/results/gpu-<date>); DIR/steps.json is
# rewritten after each step (name, seconds, exit, what it wrote). The first failing step
# stops the run.
#
# --dry-run runs, here and without a GPU, every step that needs none: the wheel list and
# imports, the model writer (a tiny shape, F16), both fan-out steps on this machine's
# libllama at small sizes, and the JSON layout; the GPU steps are recorded as skipped.
#
# Environment: PYTHON (default .venv/bin/python, else python3), CUDA_ARCH (default 90),
# DOC_TOKENS (default 1000), MAX_TOKENS (default 32).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out="bench/results/gpu-$(date +%Y-%m-%d)"; dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift ;;
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=$repo/.venv/bin/python
else py=$(command -v python3); fi
doc_tokens=${DOC_TOKENS:-1000}; max_tokens=${MAX_TOKENS:-32}; ns=1,4,16
cache="${SWARMKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swarmkv-ffi}"
cuda_prefix="$cache/libllama-cuda"
entries=""

record() {  # record NAME SECONDS EXIT NOTE: append to steps.json (valid JSON after every step)
    local e
    e=$(printf '{"step": "%s", "seconds": %s, "exit": %s, "note": "%s"}' "$1" "$2" "$3" "$4")
    entries="${entries:+$entries, }$e"
    printf '{"dry_run": %s, "out": "%s", "steps": [%s]}\n' \
        "$([ $dry = 1 ] && echo true || echo false)" "$out" "$entries" >"$out/steps.json"
}

step() {  # step NAME COMMAND...: run it, time it, log it; stop the script if it fails
    local name=$1; shift
    echo "== $name" >&2
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    record "$name" $((SECONDS - t0)) $rc "log: $name.log"
    tail -3 "$out/$name.log" >&2
    if [ $rc -ne 0 ]; then
        echo "gpu_check: step '$name' failed (exit $rc); log: $out/$name.log" >&2
        exit $rc
    fi
}

skip() { record "$1" 0 0 "skipped (dry run)"; echo "== $1 (skipped: dry run)" >&2; }

setup() {  # the wheels this python lacks, from bench/.wheels (made by bench/gpu_wheels.sh)
    local imports="import cffi, gguf, yaml, pytest_timeout"
    if "$py" -c "$imports" 2>/dev/null; then
        echo "this python has cffi, gguf, PyYAML and pytest-timeout already"
    elif ls bench/.wheels/*.whl >/dev/null 2>&1; then
        ls bench/.wheels/*.whl
        "$py" -m pip install -q --no-index --no-deps --target "$out/site" bench/.wheels/*.whl || return 1
    else
        echo "no bench/.wheels: run bench/gpu_wheels.sh on a machine with network first"; return 1
    fi
    "$py" -c "$imports; print('imports ok: cffi', cffi.__version__, 'from', cffi.__file__)"
}

device() {
    "$py" - <<'PY'
import sys
try:
    from numba import cuda
except ImportError:
    sys.exit("numba / numba-cuda missing")
if not cuda.is_available():
    sys.exit("no CUDA device visible to numba")
import numpy as np
@cuda.jit
def add_one(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1
a = cuda.to_device(np.zeros(8, np.float32))
add_one[1, 8](a)
assert a.copy_to_host().sum() == 8, "a compiled kernel gave a wrong result"
name = cuda.get_current_device().name
print("device:", name.decode() if isinstance(name, bytes) else name)
PY
}

streamer() {  # streamer NAME ARGS...: the demo's JSON into $out/streamer_NAME.json
    local name=$1; shift
    "$py" -m swarmkv_ffi.kernels.demo --json "$@" >"$out/streamer_$name.json" && tail -c 400 "$out/streamer_$name.json"
}

batched_bench() {
    local n_ctx=$((doc_tokens + 16 * (max_tokens + 8) + 64))
    "$cuda_prefix/tools-stock/llama-batched-bench" -m "$out/model.gguf" -c "$n_ctx" -b 2048 -ub 512 \
        -npp "$doc_tokens" -ntg "$max_tokens" -npl "$ns" -pps -kvu -fa on -ngl 99 --output-format jsonl \
        >"$out/batched_bench.jsonl"
    cat "$out/batched_bench.jsonl"
}

export PYTHONPATH="$out/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
step setup setup
if [ $dry = 1 ]; then
    for s in device kernel_tests streamer_default streamer_balance llama_cuda_build; do skip "$s"; done
    step model "$py" -m swarmkv_ffi.shaped_gguf "$out/model.gguf" --shape tiny --type F16
    step fanout "$py" bench/gpu_fanout.py "$out/model.gguf" "$out/fanout.json" --ns 1,4 \
        --doc-tokens 128 --max-tokens 4
    step fanout_exact "$py" bench/gpu_fanout.py "$out/model.gguf" "$out/fanout_exact.json" --ns 4 \
        --doc-tokens 128 --max-tokens 4 --exact
    skip batched_bench
    echo "gpu_check: dry run done; wrote $out" >&2
    exit 0
fi
if ! device >"$out/device.log" 2>&1; then
    cat "$out/device.log" >&2
    record device 0 2 "no CUDA device, or numba cannot compile for it"
    echo "gpu_check: no CUDA device (or numba cannot compile for it); nothing else was run" >&2
    exit 2
fi
record device 0 0 "$(tail -1 "$out/device.log")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.csv" 2>/dev/null || true
step kernel_tests env SWARMKV_TEST_GPU=1 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k "not gpu_check"
step streamer_default streamer default
step streamer_balance streamer balance --balance --no-bandwidth
archive=(); [ -f bench/.wheels/llama-src.tar.xz ] && archive=(--source-archive bench/.wheels/llama-src.tar.xz)
step llama_cuda_build ./build_llama.sh --cuda --cuda-arch "${CUDA_ARCH:-90}" --tools-min --prefix "$cuda_prefix" "${archive[@]}"
export SWARMKV_LIBLLAMA="$cuda_prefix/lib"
step model "$py" -m swarmkv_ffi.shaped_gguf "$out/model.gguf" --shape llama-3.2-1b --type Q4_K_M --threads "$(nproc)"
step fanout "$py" bench/gpu_fanout.py "$out/model.gguf" "$out/fanout.json" --ns "$ns" \
    --doc-tokens "$doc_tokens" --max-tokens "$max_tokens"
step fanout_exact env CUDA_VISIBLE_DEVICES= "$py" bench/gpu_fanout.py "$out/model.gguf" "$out/fanout_exact.json" \
    --ns "$ns" --doc-tokens 512 --max-tokens 16 --exact
step batched_bench batched_bench
rm -f "$out/model.gguf"            # 0.8 GB of random weights: not a result
echo "gpu_check: all steps passed; wrote $out" >&2
