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

from corpus import ROOT
# bench/gpu_check.sh sets SWARMKV_TEST_GPU=1 to run these same tests on a real GPU.
ON_GPU = os.environ.get("SWARMKV_TEST_GPU") == "1"
SIM = dict(os.environ) if ON_GPU else {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
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
    assert report["simulator"] is not ON_GPU
    assert report["outputs_identical"] is True
    assert report["matches_numpy_reference"] is True
    assert report["check_failures"] == [] and report["runs_checked"] == 2 and report["ok"] is True


@pytest.mark.skipif(ON_GPU, reason="a GPU has real timings")
def test_simulator_reports_no_fake_timings(report):
    for schedule in ("serial", "overlapped"):
        assert len(report["layers"][schedule]) == 3
        for layer in report["layers"][schedule]:
            assert all(v is None for v in layer.values()), layer
    assert report["serial_ms"] > 0 and report["overlapped_ms"] > 0


def test_headline_line_format():
    proc = demo(*SMALL, "--n-layers", "2")
    assert proc.returncode == 0, proc.stderr
    assert ON_GPU or ("simulator" in proc.stdout and "mean nothing" in proc.stdout)
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


def cuda_device_present(env) -> bool:
    probe = "import sys\nfrom numba import cuda\nsys.exit(0 if cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0


GPU_CHECK = str(ROOT / "bench" / "gpu_check.sh")


@pytest.mark.skipif(ON_GPU, reason="bench/gpu_check.sh runs this file on the GPU; it must not run itself")
def test_gpu_check_without_a_gpu_stops_at_the_first_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if cuda_device_present(env):   # decided before anything runs: no gpu_check.sh inside gpu_check.sh
        pytest.skip("a CUDA device is present")
    env.update(PYTHON=sys.executable)
    proc = subprocess.run(["bash", GPU_CHECK, "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    steps = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [(s["step"], s["exit"]) for s in steps] == [("setup", 0), ("device", 2)]
    assert not (tmp_path / "kernel_tests.log").exists()


@pytest.mark.skipif(ON_GPU, reason="bench/gpu_check.sh runs this file on the GPU; it must not run itself")
def test_gpu_check_dry_run_runs_every_step_that_needs_no_gpu(tmp_path):
    """The model writer, both fan-out steps (tiny sizes, this machine's libllama) and the
    JSON layout, so the script has run end to end before it meets the GPU machine."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(PYTHON=sys.executable)
    proc = subprocess.run(["bash", GPU_CHECK, "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "steps.json").read_text())
    assert report["dry_run"] is True
    assert [s["step"] for s in report["steps"]] == [
        "setup", "device", "kernel_tests", "streamer_default", "streamer_balance", "llama_cuda_build",
        "model", "fanout", "fanout_exact", "batched_bench"]
    ran = {s["step"]: s for s in report["steps"] if s["note"] != "skipped (dry run)"}
    assert set(ran) == {"setup", "model", "fanout", "fanout_exact"} and all(s["exit"] == 0 for s in ran.values())
    fanout = json.loads((tmp_path / "fanout.json").read_text())
    assert [(r["mode"], r["n"]) for r in fanout["runs"]] == [("shared", 1), ("copy", 1), ("shared", 4), ("copy", 4)]
    assert all(r["generated_tokens"] > 0 and r["total_ms"] > 0 for r in fanout["runs"])
    assert fanout["build"]["llama_cpp_commit"] and fanout["settings"]["options"]["doc_tokens"] == 128
    exact = json.loads((tmp_path / "fanout_exact.json").read_text())
    assert exact["exact_shared_equals_copy"] is True and exact["settings"]["options"]["exact"] is True


def test_without_gpu_or_simulator_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = demo("--n-layers", "1", env=env)
    if proc.returncode == 0:
        pytest.skip("a CUDA device is present")
    assert proc.returncode == 2 and "NUMBA_ENABLE_CUDASIM=1" in proc.stderr


# ---- the schedule: every ordering the streamer relies on, proven from its own log ----------
SCHEDULE_PROBE = """
import json
import numpy as np
from swarmkv_ffi.kernels.streamer import LayerStreamer
from swarmkv_ffi.kernels.schedule import violations
from swarmkv_ffi.kernels.demo import trials
s = LayerStreamer(n_layers=5, bytes_per_layer=1024, compute_iters=2)
over, serial = s.run_overlapped(), s.run_serial()
out = {"overlapped": violations(over.schedule_log), "serial": violations(serial.schedule_log),
       "ops": [str(op) for op in over.schedule_log.ops],
       "without_wait": {}, "without_transfer_sync": {},
       "check_clean": s.check(over) + s.check(serial)}
for i, op in enumerate(over.schedule_log.ops):
    if op.kind == "wait":
        out["without_wait"][i] = violations(over.schedule_log.without(i))
for i, op in enumerate(serial.schedule_log.ops):
    if op.kind == "sync" and op.stream == "transfer":
        out["without_transfer_sync"][i] = violations(serial.schedule_log.without(i))
s.expected_samples()
s.host[2] *= 2          # a layer corrupted on its way to the device
out["check_corrupted"] = s.check(s.run_overlapped())
best, failures, checked = trials(s, {"warmup": 0, "trials": 2})
out["trial_failures"] = [f for kind in failures.values() for f in kind]
out["trials_checked"] = checked
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def schedule_probe():
    proc = subprocess.run([sys.executable, "-c", SCHEDULE_PROBE], capture_output=True, text=True,
                          env=SIM, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_issued_schedules_are_race_free(schedule_probe):
    assert schedule_probe["overlapped"] == [] and schedule_probe["serial"] == []
    kinds = {op.split()[0] for op in schedule_probe["ops"]}
    assert {"copy", "kernel", "record", "wait", "sync"} <= kinds


def test_deleting_any_wait_is_caught(schedule_probe):
    waits = schedule_probe["without_wait"]
    assert len(waits) == 5 + 3  # one per compute, one per copy into a reused slot
    for index, problems in waits.items():
        assert problems, f"deleting op {index} ({schedule_probe['ops'][int(index)]}) went unnoticed"


def test_deleting_a_host_sync_in_the_serial_schedule_is_caught(schedule_probe):
    syncs = schedule_probe["without_transfer_sync"]
    assert len(syncs) == 5
    assert all(syncs.values())


def test_every_run_is_checked_and_a_corrupted_layer_fails(schedule_probe):
    assert schedule_probe["check_clean"] == []
    assert schedule_probe["check_corrupted"] == [2, 3, 4]   # the layer and all that follow
    assert schedule_probe["trials_checked"] == 4
    assert len(schedule_probe["trial_failures"]) == 4       # 2 trials x serial and overlapped
    assert all("differ from NumPy" in f for f in schedule_probe["trial_failures"])


def test_checker_on_hand_written_schedules():
    """Plain Python, no Numba: the rules themselves."""
    from swarmkv_ffi.kernels.schedule import Schedule, violations
    good = Schedule()
    good.add("copy", "transfer", layer=0, slot=0)
    good.add("record", "transfer", event=0)
    good.add("wait", "compute", event=0)
    good.add("kernel", "compute", layer=0, slot=0)
    assert violations(good) == []
    assert any("may start before the copy" in v for v in violations(good.without(2)))
    racy = Schedule()
    racy.ops = list(good.ops)
    racy.add("copy", "transfer", layer=2, slot=0)    # overwrites slot 0 with no wait on the kernel
    racy.add("record", "transfer", event=1)
    racy.add("wait", "compute", event=1)
    racy.add("kernel", "compute", layer=2, slot=0)
    assert any("may overwrite layer 0" in v for v in violations(racy))


@pytest.mark.slow
def test_balance_mode_reports_both_headlines():
    proc = demo(*SMALL, "--balance")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^HEADLINE: serial=", proc.stdout, re.M)
    assert re.search(r"^HEADLINE \(balanced, compute_iters=\d+\): serial=", proc.stdout, re.M)
    assert "ideal speedup" in proc.stdout
