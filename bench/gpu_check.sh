#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU, after the README's setup
# plus the cuda extra (.venv/bin/pip install -e '.[cuda]'):
#   1. numba sees a CUDA device and can compile a kernel       (exit 2 here if not)
#   2. the kernel tests on the real GPU (not the simulator)
#   3. the layer streamer at the seed's defaults and with --balance (every run checked)
#   4. a CUDA build of libllama (--cuda-arch 90 unless CUDA_ARCH is set) and one fan-out
# Each step's JSON/log goes into one folder ($OUT, else bench/results/gpu-<date>), with
# steps.json saying how long each took and how it ended. The first failing step stops it.
#
# Environment: PYTHON (default .venv/bin/python), CUDA_ARCH (default 90), SKIP_LLAMA=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu-$(date +%Y-%m-%d)}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
steps="$out/steps.json"
echo "[" >"$steps"

step() {  # step NAME COMMAND...: run it, time it, log it; stop the script if it fails
    local name=$1; shift
    echo "== $name" >&2
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    printf '  {"step": "%s", "seconds": %d, "exit": %d},\n' "$name" $((SECONDS - t0)) $rc >>"$steps"
    tail -3 "$out/$name.log" >&2
    if [ $rc -ne 0 ]; then
        echo '  {"step": "stopped"}' >>"$steps"; echo "]" >>"$steps"
        echo "gpu_check: step '$name' failed (exit $rc); log: $out/$name.log" >&2
        exit $rc
    fi
}

if [ ! -x "$py" ] && ! command -v "$py" >/dev/null; then
    echo "gpu_check: no python at $py; run the README's setup first (or set PYTHON)" >&2
    exit 2
fi
if ! "$py" - >"$out/device.log" 2>&1 <<'PY'
import sys
try:
    from numba import cuda
except ImportError:
    sys.exit("numba / numba-cuda missing: .venv/bin/pip install -e '.[cuda]'")
if not cuda.is_available():
    sys.exit("no CUDA device visible to numba")
@cuda.jit
def add_one(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1
import numpy as np
a = cuda.to_device(np.zeros(8, np.float32))
add_one[1, 8](a)
assert a.copy_to_host().sum() == 8, "a compiled kernel gave a wrong result"
print("device:", cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes) else cuda.get_current_device().name)
PY
then
    cat "$out/device.log" >&2
    echo "gpu_check: no CUDA device (or numba cannot compile for it); nothing else was run" >&2
    echo '  {"step": "device", "exit": 2}]' >>"$steps"
    exit 2
fi
cat "$out/device.log" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.csv" 2>/dev/null || true

step kernel_tests env SWARMKV_TEST_GPU=1 "$py" -m pytest -q tests/test_kernels.py -k "not gpu_check"
step streamer_default "$py" -m swarmkv_ffi.kernels.demo --json
step streamer_balance "$py" -m swarmkv_ffi.kernels.demo --balance --no-bandwidth
cp "$out/streamer_default.log" "$out/layer_stream_default.json"
if [ "${SKIP_LLAMA:-0}" != 1 ]; then
    cuda_prefix="${SWARMKV_CACHE:-$HOME/.cache/swarmkv-ffi}/libllama-cuda"
    step llama_cuda_build ./build_llama.sh --cuda --cuda-arch "${CUDA_ARCH:-90}" --prefix "$cuda_prefix"
    step fanout_cuda env SWARMKV_LIBLLAMA="$cuda_prefix/lib" "$py" -m swarmkv_ffi.cli fanout --json \
        --doc examples/apache-2.0.txt --ask "Can I sell copies of the software?" \
        --ask "Do I have to include the NOTICE file?" --max-tokens 32
fi
echo '  {"step": "done"}' >>"$steps"; echo "]" >>"$steps"
grep -h 'HEADLINE' "$out"/streamer_balance.log >&2
echo "gpu_check: all steps passed; wrote $out" >&2
