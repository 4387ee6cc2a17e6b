"""The fast mode's kernel rule (kernels/ggml/0003) and its calibration on this CPU.

The rule is a table the patch looks up per op (head size, KV type, query tokens -> the
fewest cells from which the shared-prefix kernel runs). These tests set tables and watch
which kernel computed an op: the two kernels round differently, so the output of the
default mode equals, bit for bit, that of the kernel the table chose. Then the whole
path: `swarmkv calibrate` measures, records in the manifest, and a fresh process on this
CPU follows it; a calibration from another CPU is ignored; the environment wins.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from swarmkv_ffi import calibration, cpu, fattn, library

NEVER, ALWAYS = -1, 0
HEAD_CLASS = {64: 0, 128: 1, 256: 2, 512: 3}
BUCKET = {1: 0, 2: 1, 4: 2, 16: 3, 64: 4, 512: 5}
KV_CLASS = {"GGML_TYPE_F16": 0, "GGML_TYPE_Q8_0": 1, "f16": 0, "q8_0": 1}
MASK_CLASS = {"prefix": 0, "window": 1}


def index(head: int, kv_type: str, tokens: int, mask: str = "prefix") -> int:
    return calibration.index(HEAD_CLASS[head], KV_CLASS[kv_type], MASK_CLASS[mask], BUCKET[tokens])


@pytest.fixture
def rule_table():
    """Set a table for the test; the library's own (calibrated or built-in) after it."""
    library.lib()
    fns = calibration._rule_functions()
    ffi = calibration._ffi
    saved = calibration.in_force()

    def set_rule(rule):
        if rule is None:
            return bool(fns.ggml_cpu_set_fa_shared_rule(ffi.NULL, 0))
        return bool(fns.ggml_cpu_set_fa_shared_rule(ffi.new("int32_t[]", rule), len(rule)))
    yield set_rule
    assert set_rule(saved["rule"] if saved["source"] == "calibrated" else None)
    assert calibration.in_force() == saved


@pytest.mark.parametrize("n_tok,n_kv,dk,want", [(2, 600, 256, "shared"), (1, 600, 64, "shared"),
                                               (64, 600, 64, "shared"), (1, 600, 256, "stock"),
                                               (64, 600, 256, "stock"), (1, 64, 64, "stock")])
def test_the_built_in_table_is_the_rule_the_patch_header_names(rule_table, n_tok, n_kv, dk, want):
    """Without a calibration: with head size <= 128 the new kernel for >= 2 query tokens
    and for one over >= 128 cells; with larger heads for 2..63 query tokens; stock otherwise."""
    if os.environ.get(calibration.ENV_RULE):
        pytest.skip(f"{calibration.ENV_RULE} is set: the built-in table is not in force")
    assert rule_table(None) and calibration.in_force()["source"] == "built-in"
    rng = np.random.default_rng(23)
    q = rng.standard_normal((1, 4, n_tok, dk), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, n_kv, dk), dtype=np.float32).astype(np.float16).astype(np.float32)
            for _ in range(2))
    cells, rows = np.arange(n_kv)[None, :], (n_kv - n_tok + np.arange(n_tok))[:, None]
    mask = np.where(cells <= rows, 0.0, -np.inf).astype(np.float32)[None]
    kw = {"scale": dk ** -0.5, "n_threads": 2}
    auto = fattn.flash_attn(q, k, v, mask, kernel="auto", **kw)
    assert np.array_equal(auto, fattn.flash_attn(q, k, v, mask, kernel=want, **kw))
    other = "stock" if want == "shared" else "shared"
    assert not np.array_equal(auto, fattn.flash_attn(q, k, v, mask, kernel=other, **kw))


def op(head, kv_type, tokens, cells, rows_without_cell0=0, seed=0):
    """The fan-out's decode mask (shared cells, then one cell per row), where the first
    `rows_without_cell0` rows see only a window of 100 cells ending at their own."""
    rng = np.random.default_rng(seed)
    n_head, n_kv_head = (4, 1) if head >= 256 else (6, 2)
    q = rng.standard_normal((1, n_head, tokens, head), dtype=np.float32)
    k = rng.standard_normal((1, n_kv_head, cells, head), dtype=np.float32)
    v = rng.standard_normal((1, n_kv_head, cells, head), dtype=np.float32)
    shared = cells - tokens
    mask = np.zeros((1, tokens, cells), np.float32)
    mask[0, :, shared:] = -np.inf
    mask[0, np.arange(tokens), shared + np.arange(tokens)] = 0.0
    mask[0, :rows_without_cell0, :shared - 100] = -np.inf
    return (q, k, v, mask), {"scale": head ** -0.5, "kv_type": kv_type, "n_threads": 2}


def run(kernel, shape):
    arrays, kw = shape
    return fattn.flash_attn(*arrays, kernel=kernel, **kw)


# head, KV type, query tokens, cells, rows that do not see cell 0 -> the mask class
SHAPES = [(64, "GGML_TYPE_F16", 1, 512, 0, "prefix"), (64, "GGML_TYPE_Q8_0", 16, 256, 0, "prefix"),
          (128, "GGML_TYPE_F16", 4, 384, 0, "prefix"), (256, "GGML_TYPE_F16", 64, 640, 0, "prefix"),
          (256, "GGML_TYPE_Q8_0", 2, 256, 0, "prefix"), (512, "GGML_TYPE_F16", 512, 768, 0, "prefix"),
          (64, "GGML_TYPE_F16", 1, 512, 1, "window"), (256, "GGML_TYPE_F16", 64, 640, 64, "window"),
          (64, "GGML_TYPE_F16", 16, 512, 8, "prefix"), (64, "GGML_TYPE_F16", 16, 512, 9, "window")]


@pytest.mark.parametrize("head,kv_type,tokens,cells,windowed,mask", SHAPES)
def test_the_table_entry_of_an_ops_shape_decides_its_kernel(rule_table, head, kv_type, tokens, cells, windowed, mask):
    shape = op(head, kv_type, tokens, cells, windowed)
    entry = index(head, kv_type, tokens, mask)
    stock, shared = run("stock", shape), run("shared", shape)
    assert not np.array_equal(stock, shared), "the two kernels must round apart for this test to see anything"
    only_here = [NEVER] * calibration.RULE_LEN
    only_here[entry] = ALWAYS
    assert rule_table(only_here)
    assert np.array_equal(run("auto", shape), shared)
    everywhere_else = [ALWAYS] * calibration.RULE_LEN
    everywhere_else[entry] = NEVER
    assert rule_table(everywhere_else)
    assert np.array_equal(run("auto", shape), stock)
    threshold = [NEVER] * calibration.RULE_LEN         # from `cells` on: here, not one cell before
    threshold[entry] = cells
    assert rule_table(threshold)
    assert np.array_equal(run("auto", shape), shared)
    threshold[entry] = cells + 1
    assert rule_table(threshold)
    assert np.array_equal(run("auto", shape), stock)


@pytest.mark.fidelity
def test_exact_mode_takes_the_batch_invariant_kernel_whatever_the_table(rule_table):
    shape = op(64, "GGML_TYPE_F16", 16, 512)
    assert rule_table([NEVER] * calibration.RULE_LEN)
    assert np.array_equal(run("exact", shape), run("shared", shape))


def test_the_library_refuses_a_malformed_table(rule_table):
    before = calibration.in_force()
    assert not rule_table([0] * (calibration.RULE_LEN - 1))
    assert not rule_table([0] * (calibration.RULE_LEN - 1) + [-2])
    assert calibration.in_force() == before


def _in_child(code: str, env: dict) -> dict:
    """Run `code` (which prints JSON) in a fresh interpreter: the rule is process-wide."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


STATUS = "import json; from swarmkv_ffi import library; print(json.dumps(library.kernel_rule()))"


def test_the_environment_sets_the_table_and_a_malformed_one_is_ignored():
    env = {k: v for k, v in os.environ.items() if k != calibration.ENV_RULE}
    rule = [(i * 37) % 600 - 1 for i in range(calibration.RULE_LEN)]
    got = _in_child(STATUS, {**env, calibration.ENV_RULE: ",".join(map(str, rule))})
    assert got["source"] == "environment" and got["rule"] == rule
    n = calibration.RULE_LEN
    for bad in ("1,2,3", ",".join(["0"] * (n - 1) + ["-5"]), ",".join(["0"] * n) + ",7", "x" * 10):
        got = _in_child(STATUS, {**env, calibration.ENV_RULE: bad})
        assert got["source"] == "built-in" and "malformed" in got["note"], bad


def expected_rule(measured: list[dict], built_in: list[int]) -> tuple[list[int], set[int]]:
    """The calibrator's decision, restated: per (head, kv, mask, tokens), the fewest
    measured cells from which shared was faster at that size and every larger one; 0 when
    that is the smallest size measured (one token keeps its floor); -1 when it lost at
    the largest. Entries never measured (head sizes above 256) keep the built-in ones.
    Also the entries this cannot restate: a size whose two times tie in the report's 0.1
    µs (the calibrator compared them unrounded)."""
    rule = list(built_in)
    ties = set()
    groups: dict = {}
    for m in measured:
        groups.setdefault((m["head"], m["kv"], m["mask"], m["tokens"]), []).append(m)
    for (head, kv, mask, tokens), rows in groups.items():
        rows.sort(key=lambda m: m["cells"])
        won = [m["shared_us"] < m["stock_us"] for m in rows]
        value = NEVER
        for i in range(len(rows) - 1, -1, -1):
            if not won[i]:
                break
            value = rows[i]["cells"]
        if value == rows[0]["cells"] and tokens > 1:
            value = ALWAYS
        rule[index(head, kv, tokens, mask)] = value
        if any(abs(m["shared_us"] - m["stock_us"]) <= 0.1 for m in rows):
            ties.add(index(head, kv, tokens, mask))
    return rule, ties


@pytest.mark.slow
def test_calibrate_records_a_rule_this_cpu_follows_and_another_cpu_ignores(tmp_path):
    root = library.install_root(library.find_library())
    if not calibration.calibrator(root).exists():
        pytest.skip("this libllama was built before calibration (no bin/fa_calibrate): ./build_llama.sh")
    copy = tmp_path / "libllama"
    for part in ("lib", "include", "bin"):
        shutil.copytree(root / part, copy / part, symlinks=True)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.pop(calibration.KEY, None)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    env = {k: v for k, v in os.environ.items() if k not in (calibration.ENV_RULE, "GGML_FA_SHARED")}
    env["SWARMKV_LIBLLAMA"] = str(copy / "lib")
    cli = [sys.executable, "-m", "swarmkv_ffi.cli"]

    uncalibrated = _in_child(STATUS, env)
    assert uncalibrated["source"] == "built-in" and "no calibration" in uncalibrated["note"]

    proc = subprocess.run(cli + ["calibrate", "--repeat", "1", "--max-cells", "2048", "--check-cells", "1024"],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = json.loads((copy / "manifest.json").read_text())[calibration.KEY]
    assert "recorded in" in proc.stdout and calibration.table(entry["rule"]) in proc.stdout
    # heads x kv x ((tokens, tokens <= cells <= 2048) with the prefix mask + (tokens, 2048) with the window)
    assert len(entry["measured"]) == 3 * 2 * ((5 * 3 + 2) + 6)
    expected, ties = expected_rule(entry["measured"], uncalibrated["rule"])
    assert [r for i, r in enumerate(entry["op_rule"]) if i not in ties] == [r for i, r in enumerate(expected) if i not in ties]
    assert len(ties) < len(expected) // 4
    # the end-to-end check: the packaged model at 1, 4 and 16 branches; the recorded
    # table is the op timings' one but where a row corrected it
    check = entry["check"]
    assert [r["npl"] for r in check["rows"]] == [1, 4, 16] and check["cells"] == 1024 and check["head_dim"] == 64
    assert all(r["rule_tps"] > 0 and r["ggml_tps"] > 0 and r["ours_tps"] > 0 for r in check["rows"])
    corrected = {r["table_entry"]: r["now"] for r in check["rows"] if r["verdict"].startswith("corrected")}
    assert entry["rule"] == [corrected.get(i, x) for i, x in enumerate(entry["op_rule"])]
    assert "checked end to end on SmolLM2" in proc.stdout
    assert cpu.same_identity(entry["cpu"], cpu.identity()) and entry["threads"] == os.cpu_count()

    follows = _in_child(STATUS, env)
    assert follows["source"] == "calibrated" and follows["rule"] == entry["rule"]
    info = subprocess.run(cli + ["info"], capture_output=True, text=True, timeout=120, env=env)
    assert "fast mode's attention rule: calibrated" in info.stdout, info.stdout
    assert "checked end to end" in info.stdout and "16 branches" in info.stdout, info.stdout
    overridden = _in_child(STATUS, {**env, calibration.ENV_RULE: ",".join(["0"] * calibration.RULE_LEN)})
    assert overridden["source"] == "environment" and overridden["rule"] == [0] * calibration.RULE_LEN

    elsewhere = json.loads((copy / "manifest.json").read_text())
    elsewhere[calibration.KEY]["cpu"]["id"] = "GenuineIntel/6/143/8//"
    (copy / "manifest.json").write_text(json.dumps(elsewhere))
    ignored = _in_child(STATUS, env)
    assert ignored["source"] == "built-in" and "another CPU" in ignored["note"]
    assert ignored["rule"] == uncalibrated["rule"]

    damaged = json.loads((copy / "manifest.json").read_text())
    damaged[calibration.KEY]["cpu"] = cpu.identity()
    damaged[calibration.KEY]["rule"] = damaged[calibration.KEY]["rule"][:48]      # e.g. an older layout
    (copy / "manifest.json").write_text(json.dumps(damaged))
    refused = _in_child(STATUS, env)
    assert refused["source"] == "built-in" and "not usable" in refused["note"]

    reset = subprocess.run(cli + ["calibrate", "--reset"], capture_output=True, text=True, timeout=120, env=env)
    assert reset.returncode == 0 and calibration.KEY not in json.loads((copy / "manifest.json").read_text())


def test_calibrate_says_what_is_missing_on_a_build_without_the_calibrator(tmp_path):
    root = library.install_root(library.find_library())
    copy = tmp_path / "libllama"
    for part in ("lib", "include"):
        shutil.copytree(root / part, copy / part, symlinks=True)
    shutil.copy(root / "manifest.json", copy / "manifest.json")
    env = {**os.environ, "SWARMKV_LIBLLAMA": str(copy / "lib")}
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", "calibrate"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2
    assert "bin/fa_calibrate not found" in proc.stderr and "./build_llama.sh" in proc.stderr
    assert "Traceback" not in proc.stderr


def checked(rows, cells=2048, head_dim=64):
    """An end-to-end check's result as fa_check prints it (decode t/s per npl)."""
    return {"cells": cells, "head_dim": head_dim, "rows": [
        {"npl": n, "rule_tps": r, "ggml_tps": g, "ours_tps": o} for n, r, g, o in rows]}


def test_the_check_takes_the_faster_kernel_where_the_table_is_more_than_3_percent_behind():
    rule = [0] * calibration.RULE_LEN
    rule[index(64, "f16", 1)] = 128                      # ours at one token
    rule[index(64, "f16", 16)] = NEVER                   # ggml's at 16
    fixed, rows = calibration.correct(rule, checked([(1, 50.0, 70.0, 50.0),     # ggml's faster: correct
                                                     (4, 99.0, 80.0, 100.0),    # 1 % behind: ok
                                                     (16, 100.0, 100.0, 190.0)]))  # ours faster: correct
    assert [r["verdict"].split(":")[0] for r in rows] == ["corrected", "ok", "corrected"]
    assert fixed[index(64, "f16", 1)] == NEVER and fixed[index(64, "f16", 16)] == 2048
    assert [i for i, (a, b) in enumerate(zip(rule, fixed)) if a != b] == [index(64, "f16", 1), index(64, "f16", 16)]
    assert rows[0]["picks"] == "ours" and rows[0]["faster"] == "ggml" and rows[0]["vs_faster"] == pytest.approx(50 / 70, abs=1e-3)


def test_a_gap_while_the_tables_kernel_keeps_up_when_forced_is_noise():
    rule = [0] * calibration.RULE_LEN                     # ours everywhere
    fixed, rows = calibration.correct(rule, checked([(16, 150.0, 100.0, 190.0),   # the table's kernel is the faster
                                                     (4, 90.0, 100.0, 98.0)]))    # ours forced is 2 % behind ggml's
    assert fixed == rule and [r["verdict"].split(":")[0] for r in rows] == ["noise", "noise"]


def test_the_check_corrects_the_head_class_of_the_model_it_decoded():
    rule = [NEVER] * calibration.RULE_LEN
    fixed, _ = calibration.correct(rule, checked([(4, 60.0, 60.0, 120.0)], cells=1024, head_dim=256))
    assert fixed[index(256, "f16", 4)] == 1024 and fixed.count(NEVER) == calibration.RULE_LEN - 1


@pytest.mark.slow
def test_a_table_forced_to_the_losing_kernel_is_detected_and_corrected_end_to_end():
    """A real decode of the packaged model at 16 branches over 1,024 shared cells, with a
    table that never takes our kernel at 16 query tokens: ours is the faster one there on
    every CPU measured (1.9x on an AVX-512 Zen 5, 2-4x on AVX2), so the check must see the
    table behind and correct that bucket, leaving the rest."""
    root = library.install_root(library.find_library())
    if not calibration.checker(root).exists():
        pytest.skip("this libllama was built before the end-to-end check (no bin/fa_check): ./build_llama.sh")
    wrong = [0] * calibration.RULE_LEN
    wrong[index(64, "f16", 16)] = NEVER
    from swarmkv_ffi.catalog import resolve
    result = calibration.check(root, resolve("smollm2-135m"), wrong, cells=1024, npl=(16,), steps=8, repeat=3)
    fixed, rows = calibration.correct(wrong, result)
    assert rows[0]["picks"] == "ggml" and rows[0]["faster"] == "ours", rows
    assert rows[0]["verdict"].startswith("corrected"), rows
    assert fixed[index(64, "f16", 16)] == 1024
    assert [i for i, (a, b) in enumerate(zip(wrong, fixed)) if a != b] == [index(64, "f16", 16)]
    assert rows[0]["rule_tps"] < 0.97 * rows[0]["ours_tps"]      # the table really ran ggml's kernel


def test_a_build_whose_check_fails_still_records_the_op_timings_table(tmp_path, monkeypatch, capsys):
    """build_llama.sh's entry: the check cannot run (here: no model), so the op timings'
    table is recorded unchecked, with a warning, and the build goes on (exit 0)."""
    (tmp_path / "manifest.json").write_text("{}")
    op_table = [ALWAYS] * calibration.RULE_LEN
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: {"rule": op_table, "threads": 2, "seconds": 1.0})
    assert calibration.main([str(tmp_path), "--check-model", str(tmp_path / "missing.gguf")]) == 0
    entry = json.loads((tmp_path / "manifest.json").read_text())[calibration.KEY]
    assert entry["rule"] == op_table and "check" not in entry
    assert "end-to-end check failed" in capsys.readouterr().err


@pytest.mark.unit
def test_a_table_is_reused_only_for_the_cpu_and_core_count_that_measured_it(tmp_path):
    """build_llama.sh --reuse: installing a build again (a fresh checkout, CI) records the
    table kept in its cache instead of measuring for minutes, but only one measured on this
    CPU with as many cores; another CPU's, a damaged file or a missing one measure again."""
    rule = [0] * calibration.RULE_LEN
    mine = {"rule": rule, "cpu": {**cpu.identity(), "cpus": os.cpu_count() or 1}, "calibrated_at": "then"}
    kept = tmp_path / "calibration-key.json"
    kept.write_text(json.dumps(mine))
    assert calibration.reusable(kept) == mine
    for other in ({**mine, "cpu": {**mine["cpu"], "id": "GenuineIntel/6/143/8//"}},
                  {**mine, "cpu": {**mine["cpu"], "cpus": (os.cpu_count() or 1) + 2}},
                  {**mine, "rule": rule[:48]}):
        kept.write_text(json.dumps(other))
        assert calibration.reusable(kept) is None
    kept.write_text("{not json")
    assert calibration.reusable(kept) is None and calibration.reusable(tmp_path / "none.json") is None

    prefix = tmp_path / "libllama"
    prefix.mkdir()
    (prefix / "manifest.json").write_text(json.dumps({"build_key": "k"}))
    kept.write_text(json.dumps(mine))
    script = Path(calibration.__file__)
    proc = subprocess.run([sys.executable, str(script), str(prefix), "--reuse", str(kept)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "reused the table measured then" in proc.stderr, proc.stderr
    manifest = json.loads((prefix / "manifest.json").read_text())
    assert manifest["build_key"] == "k" and manifest[calibration.KEY] == mine
