#!/usr/bin/env bash
# Every GPU check of the layer streamer in one run (for a machine with an NVIDIA GPU):
# the demo at the default configuration, at 16 layers, and the bandwidth measure.
# Writes JSON into $OUT (the device tool's output folder) or bench/results/gpu-<date>.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu-$(date +%Y-%m-%d)}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" || true
echo "== default: 8 layers x 64 MiB x 64 iterations"
"$py" -m swarmkv_ffi.kernels.demo --json > "$out/layer_stream_default.json"
"$py" -m swarmkv_ffi.kernels.demo --no-bandwidth | tee "$out/layer_stream_default.txt"
echo "== 16 layers"
"$py" -m swarmkv_ffi.kernels.demo --n-layers 16 --no-bandwidth --json > "$out/layer_stream_16.json"
grep -h '"speedup"\|"overlap_efficiency_pct"\|"outputs_identical"' "$out"/layer_stream_*.json
echo "wrote $out"
