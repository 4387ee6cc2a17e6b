"""The benchmark harnesses run end to end on a tiny configuration (CI's smoke run) and
write every artefact. They assert nothing about speed."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from swarmkv_ffi.bench import conductor, fanout
from swarmkv_ffi.cli import BENCHMARKS


@pytest.mark.slow
def test_fanout_bench_smoke(tmp_path):
    rc = fanout.main(["--doc-tokens", "100", "--n-ctx", "384", "--trials", "2", "--runs", "2:1",
                      "--sweeps", "branches,doc-length,decode", "--sweep-ns", "1,2", "--doc-lengths", "80",
                      "--decode-n", "2", "--sweep-gen", "4", "--baseline-max-n", "1", "--out", str(tmp_path)])
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
    assert_records_its_settings(report)
    assert report["settings"]["fanout"]["n_ctx"] == 384 and report["settings"]["fanout"]["n_threads"] >= 1
    rows = list(csv.DictReader((tmp_path / "all_trials.csv").open()))
    assert len(rows) == 2 * 3 * 2  # trials x modes x branches
    for name in ("end_to_end_latency", "prefill_cost_breakdown", "trial_consistency",
                 "activation_latency", "scaling"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


@pytest.mark.slow
def test_conductor_bench_smoke(tmp_path):
    rc = conductor.main(["--histories", "200", "--repeats", "1", "--clients", "2", "--decoders", "1",
                         "--seconds", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "conductor.json").read_text())
    swap = report["swap"][0]
    assert swap["swap_ms"] > 0 and swap["reprefill_ms"] > 0 and swap["snapshot_bytes"] > 0
    assert report["status"]["requests"] > 0 and report["status"]["p99_ms"] >= report["status"]["p50_ms"]
    assert_records_its_settings(report)


def assert_records_its_settings(report: dict) -> None:
    """Every result file says what produced it: options, build, machine."""
    assert report["settings"]["options"]
    assert report["build"]["llama_cpp_commit"] and report["build"]["patch_set"]
    assert isinstance(report["build"]["cpu_features"], list) and report["build"]["ggml_system_info"]
    assert report["machine"]["cpu"] and report["machine"]["cores"] >= 1


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_runs_under_swarmkv_bench(name, capsys):
    """One way to run each benchmark: `swarmkv bench NAME`, with its own --help."""
    import importlib
    module = importlib.import_module(f"swarmkv_ffi.bench.{BENCHMARKS[name][0]}")
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    assert f"swarmkv bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["peer", "agents", "serve"])
def test_a_bench_without_llama_server_says_how_to_build_it(tmp_path, name):
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "bench", name, "--server",
                           str(tmp_path / "llama-server"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"swarmkv bench {name}: {tmp_path / 'llama-server'} not found" in proc.stderr
    assert "./build_llama.sh --tools" in proc.stderr


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    """The scenarios that need no llama-server, tiny: the JSON holds their figures."""
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "bench", "serve", "--scenarios", "exact,overhead",
                           "--n", "2", "--gen", "4", "--doc-tokens", "64", "--overhead-requests", "2",
                           "--threads", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r["scenario"]: r for r in json.loads((tmp_path / "serve.json").read_text())["rows"]}
    assert rows["exact"]["same_as_alone"] == 2 == rows["exact"]["answers"]
    assert rows["overhead"]["http_s"] > 0 and rows["overhead"]["generate_s"] > 0
    assert "16/16" not in proc.stderr and "2/2 answers" in proc.stderr


def test_grammar_bench_smoke(tmp_path):
    """llguidance alone (xgrammar is not a dependency): every schema's valid answers are
    written whole under the masks, its broken one is not, no raw control byte gets into a
    string, and the JSON says so."""
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "bench", "grammar", "--repeat", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "grammar.json").read_text())
    assert_records_its_settings(report)
    rows = {r["schema"]: r["llguidance"] for r in report["rows"]}
    assert sorted(rows) == ["nested", "response", "tool_call"]
    for r in rows.values():
        assert r["accepts"] and r["rejects"] and not r["control_bytes_in_strings"] and r["mask_us"] > 0


@pytest.mark.slow
def test_cluster_bench_smoke(tmp_path):
    """The fan-out scenario on a tiny configuration (two simulated clusters), JSON written.
    Its serve scenario (a cluster and two servers, 2 minutes here) is left to
    tests/serve/test_cluster.py, which routes the same server by prefix: CI's time is short."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the distributed extra)")
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "bench", "cluster", "--scenarios", "fanout",
                           "--doc-tokens", "300", "--gen", "2", "--branches", "2", "--actors", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert [row["nodes"] for row in report["fanout"]] == [1, 2]
    assert sorted(e["snapshot_bytes_pulled"] > 0 for e in report["fanout"][1]["per_node"]) == [False, True]


def test_kernels_bench_checks_its_arguments_and_names_the_missing_tools(tmp_path):
    from swarmkv_ffi import library
    root = library.install_root(library.find_library())
    bare = tmp_path / "libllama"           # the same library, without ./build_llama.sh --tools
    for part in ("lib", "include"):
        shutil.copytree(root / part, bare / part, symlinks=True)
    shutil.copy(root / "manifest.json", bare / "manifest.json")
    env = {**os.environ, "SWARMKV_LIBLLAMA": str(bare / "lib")}
    cmd = [sys.executable, "-m", "swarmkv_ffi.cli", "bench", "kernels"]
    bad = subprocess.run(cmd + ["--npp", "128,x"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    bad = subprocess.run(cmd + ["--types", ","], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "llama-quantize type names" in bad.stderr
    proc = subprocess.run(cmd + ["--repeats", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "tools-stock/llama-batched-bench not found" in proc.stderr and "./build_llama.sh --tools" in proc.stderr


def test_shaped_gguf_writes_a_model_libllama_loads_and_decodes(tmp_path):
    from swarmkv_ffi import shaped_gguf
    from swarmkv_ffi.context import Context, ContextParams
    from swarmkv_ffi.model import Model
    shape = shaped_gguf.Shape(n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_layer=2, n_vocab=400, n_ctx=256)
    path = shaped_gguf.write_f16(tmp_path / "m.gguf", shape)
    with Model(path) as m:
        assert (m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab) == (2, 128, 4, 2, 400)
        with Context(m, ContextParams(n_ctx=64, n_threads=1)) as ctx:
            ctx.decode_tokens(m.tokenize("w1 w2 w3"), logits_last=True)


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


def test_llama_suite_shim_maps_llama_servers_flags():
    """llama.cpp's suite starts llama-server's command line; the shim gives both servers the
    one model file, passes on to ours the flags it has (renamed where the name differs)
    and drops the rest, --parallel included (slots there, sequences here); ours' /metrics is
    turned off unless --metrics is given, as llama-server's is."""
    from swarmkv_ffi.bench.llama_suite import command_for
    argv = ["--port", "8080", "--temp", "0.8", "--hf-repo", "ggml-org/models", "--hf-file", "x.gguf",
            "--alias", "tinyllama-2", "--ctx-size", "256", "--parallel", "2", "--n-predict", "64", "--no-jinja",
            "--api-key", "k1234567", "--chat-template-file", "t.jinja"]
    cmd, dropped = command_for("ours", "/m.gguf", argv)
    assert cmd[cmd.index("serve"):] == ["serve", "--model", "/m.gguf", "--port", "8080", "--temp", "0.8",
                                        "--name", "tinyllama-2",
                                        "--ctx-size", "256", "--default-max-tokens", "64", "--api-key", "k1234567",
                                        "--chat-template-file", "t.jinja", "--no-metrics"]
    assert dropped == ["--parallel", "--no-jinja"]
    assert "--no-metrics" not in command_for("ours", "/m.gguf", argv + ["--metrics"])[0]
    theirs, none = command_for("llama-server", "/m.gguf", argv)
    assert theirs[1:3] == ["--model", "/m.gguf"] and "--hf-repo" not in theirs and "--parallel" in theirs
    assert none == []
