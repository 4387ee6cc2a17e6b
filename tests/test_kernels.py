"""The layer streamer on Numba's CUDA simulator: both schedules must produce exactly the
same output, equal to a NumPy reference; the simulator's missing timings are reported as
absent, never as -1. (Timings themselves are checked on a GPU by bench/gpu_check.sh.)"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

SIM = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
SMALL = ["--n-layers", "3", "--bytes-per-layer", "1K", "--compute-iters", "3", "--no-bandwidth"]


def demo(*args, env=SIM):
    return subprocess.run([sys.executable, "-m", "swarmkv_ffi.kernels.demo", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def report():
    proc = demo(*SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_both_schedules_match_numpy(report):
    assert report["simulator"] is True
    assert report["outputs_identical"] is True
    assert report["matches_numpy_reference"] is True


def test_simulator_reports_no_fake_timings(report):
    for schedule in ("serial", "overlapped"):
        assert len(report["layers"][schedule]) == 3
        for layer in report["layers"][schedule]:
            assert all(v is None for v in layer.values()), layer
    assert report["serial_ms"] > 0 and report["overlapped_ms"] > 0


def test_headline_line_format():
    proc = demo(*SMALL, "--n-layers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "simulator" in proc.stdout and "mean nothing" in proc.stdout
    assert re.search(r"^HEADLINE: serial=\d+\.\d\d ms, overlapped=\d+\.\d\d ms, "
                     r"savings=-?\d+\.\d\d%, speedup=\d+\.\d{3}x$", proc.stdout, re.M)


def test_bandwidth_measure_runs(tmp_path):
    proc = demo("--n-layers", "1", "--bytes-per-layer", "1K", "--compute-iters", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    bw = json.loads(proc.stdout)["bandwidth"]
    assert bw["pinned_gbps"] > 0 and bw["pageable_gbps"] > 0


def test_kernel_and_reference_agree_directly():
    code = """
import numpy as np
from numba import cuda
from swarmkv_ffi.kernels.fma import fma_sweep, reference, launch_shape
w = np.random.default_rng(1).uniform(-1, 1, (2, 300)).astype(np.float32)
out = cuda.to_device(np.zeros(300, np.float32))
for layer in w:
    b, t = launch_shape(300, 64)
    fma_sweep[b, t](cuda.to_device(layer), out, 5)
print(np.allclose(out.copy_to_host(), reference(w, 5), rtol=1e-6, atol=1e-6))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SIM, timeout=300)
    assert proc.stdout.strip() == "True", proc.stderr


@pytest.mark.parametrize("args,message", [(["--bytes-per-layer", "lots"], "not a size"),
                                          (["--n-layers", "0"], "must be >= 1")])
def test_bad_flags(args, message):
    proc = demo(*args)
    assert proc.returncode == 2 and message in proc.stderr


def test_without_gpu_or_simulator_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = demo("--n-layers", "1", env=env)
    if proc.returncode == 0:
        pytest.skip("a CUDA device is present")
    assert proc.returncode == 2 and "NUMBA_ENABLE_CUDASIM=1" in proc.stderr
