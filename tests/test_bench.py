"""The benchmark harnesses run end to end on a tiny configuration (CI's smoke run) and
write every artefact. They assert nothing about speed."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

from swarmkv_ffi.bench import conductor, fanout


def test_fanout_bench_smoke(tmp_path):
    rc = fanout.main(["--doc-tokens", "200", "--n-ctx", "512", "--trials", "2", "--runs", "2:1",
                      "--sweeps", "branches,doc-length,decode", "--sweep-ns", "1,2", "--doc-lengths", "150",
                      "--decode-n", "2", "--baseline-max-n", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "best_run.json").read_text())
    comp = report["comparisons"][0]
    assert len(comp["trials"]) == 2 and comp["best_rule"]
    for mode in ("baseline", "shared", "copy"):
        run = comp["trials"][comp["best_trial"]]["runs"][mode]
        assert run["total_ms"] > 0 and isinstance(run["peak_rss_delta_bytes"], int)
    assert comp["best"]["shared_prefill_ms"] > 0
    assert comp["best"]["shared_redundant_prefill_eliminated_ms"] > 0
    assert "n2_gen1_e2e_speedup" in report["targets"]
    rows = list(csv.DictReader((tmp_path / "all_trials.csv").open()))
    assert len(rows) == 2 * 3 * 2  # trials x modes x branches
    for name in ("end_to_end_latency", "prefill_cost_breakdown", "trial_consistency",
                 "activation_latency", "scaling"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_conductor_bench_smoke(tmp_path):
    rc = conductor.main(["--histories", "200", "--repeats", "1", "--clients", "2", "--decoders", "1",
                         "--seconds", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "conductor.json").read_text())
    swap = report["swap"][0]
    assert swap["swap_ms"] > 0 and swap["reprefill_ms"] > 0 and swap["snapshot_bytes"] > 0
    assert report["status"]["requests"] > 0 and report["status"]["p99_ms"] >= report["status"]["p50_ms"]


def test_peer_bench_without_llama_server_says_how_to_build_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "bench", "peer", "--server",
                           str(tmp_path / "llama-server"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "./build_llama.sh --tools" in proc.stderr


def test_peak_rss_sees_memory_freed_before_the_block_ends():
    """The peak, not the end: 64 MiB touched and freed inside the block still count."""
    import numpy as np

    from swarmkv_ffi.bench.measure import PeakRSS
    with PeakRSS(interval=0.001) as mem:
        block = np.ones(64 << 20, dtype=np.uint8)
        deadline = time.monotonic() + 30
        while mem.peak_delta < 48 << 20:   # wait for the sampler to see it, however slow
            assert time.monotonic() < deadline, f"sampler never saw the block: {mem.peak_delta}"
            time.sleep(0.001)
        del block
    assert mem.peak_delta >= 48 << 20
    with PeakRSS() as idle:
        pass
    assert idle.peak_delta < 48 << 20
