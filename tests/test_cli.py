"""The `swarmkv` command line, run as a user would (subprocess)."""
from __future__ import annotations

import json

import pytest

from commands import swarmkv


def test_info_json():
    report = json.loads(swarmkv("info", "--json").stdout)
    assert report["library"].endswith("libllama.so")
    assert report["manifest"]["llama_h_sha256"] == report["pin"]["llama_h_sha256"]
    assert any(d["type"] == "cpu" for d in report["devices"])
    assert {m["name"] for m in report["models"]} >= {"smollm2-135m", "gemma3-270m"}
    rule = report["fa_shared_rule"]          # the fast mode's kernel table and where it came from
    assert rule["source"] in ("calibrated", "environment", "built-in") and len(rule["rule"]) == 96


@pytest.mark.parametrize("model,chat", [("smollm2-135m", True), ("gemma3-270m", False)])
def test_generate_greedy_is_repeatable(model, chat):
    args = ["generate", "--model", model, "--prompt", "The capital of France is",
            "--max-tokens", "12", "--json"] + (["--chat"] if chat else [])
    a = json.loads(swarmkv(*args).stdout)
    b = json.loads(swarmkv(*args).stdout)
    assert a["generated_token_ids"] == b["generated_token_ids"]
    assert a["generated_token_ids"] and a["text"]
    assert a["timings"]["prompt_eval_ms"] > 0 and a["timings"]["load_ms"] > 0


def test_generate_streams_text():
    proc = swarmkv("generate", "--chat", "--prompt", "Say hello.", "--max-tokens", "8")
    assert proc.stdout.strip()
    assert "tokens/s" in proc.stderr


def test_bad_model_is_a_clear_error(tmp_path):
    proc = swarmkv("generate", "--model", str(tmp_path / "x.gguf"), "--prompt", "hi", check=False)
    assert proc.returncode == 2
    assert "neither a known short name" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_explains_commands():
    out = swarmkv("--help").stdout
    assert "generate" in out and "info" in out


@pytest.fixture(scope="module")
def short_doc(tmp_path_factory):
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "examples" / "apache-2.0.txt").read_text()[:1200]
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_fanout_json_and_snapshot_roundtrip(short_doc, tmp_path):
    snap = tmp_path / "doc.swkv"
    # --exact: the second run decodes each branch alone (copy mode), the first both
    # together; only exact mode makes those the same computation on every CPU.
    args = ["fanout", "--doc", str(short_doc), "--ask", "What is this?", "--ask", "Who is the Licensor?",
            "--max-tokens", "6", "--json", "--exact", "--threads", "1"]
    first = json.loads(swarmkv(*args, "--snapshot-out", str(snap)).stdout)
    assert snap.exists() and first["prefill_ms"] > 0 and not first["prefill_skipped"]
    # The result says what it ran with, so two result files can be compared.
    assert first["settings"] | {"mode": "shared", "kv_type": "f16", "flash_attn": "on", "n_batch": 512,
                                "n_threads": 1, "exact": True} == first["settings"]
    assert first["build"]["llama_cpp_commit"] and first["build"]["patch_set"]
    assert isinstance(first["build"]["cpu_features"], list)
    assert len(first["branches"]) == 2
    for b in first["branches"]:
        assert b["prompt_token_ids"] and b["prompt_text"].endswith("assistant\n")
        assert b["token_ids"] and b["text"]
        for key in ("fork_ms", "activation_ms", "decode_ms", "tokens_per_s"):
            assert key in b
    again = json.loads(swarmkv(*args, "--snapshot-in", str(snap), "--mode", "copy").stdout)
    assert again["prefill_skipped"] and again["prefill_ms"] == 0
    assert [b["token_ids"] for b in again["branches"]] == [b["token_ids"] for b in first["branches"]]


def test_fanout_json_resolves_the_threads_it_used(short_doc):
    import os
    out = json.loads(swarmkv("fanout", "--doc", str(short_doc), "--ask", "What is this?", "--max-tokens", "2",
                             "--no-cache", "--json").stdout)
    assert out["settings"]["n_threads"] == os.cpu_count() and out["settings"]["mode"] == "shared"


def test_fanout_text_output(short_doc):
    out = swarmkv("fanout", "--doc", str(short_doc), "--ask", "What is this?", "--max-tokens", "4",
                  "--no-cache").stdout
    assert "prefilled once" in out and "[0] Q: What is this?" in out and "first token" in out


@pytest.mark.parametrize("extra,message", [
    (["--doc", "/no/such/file.txt", "--ask", "q"], "document not found"),
    (["--ask", "q", "--n-ctx", "300"], "context budget exceeded"),
    (["--ask", "q", "--snapshot-in", "/no/such.swkv"], "snapshot file not found"),
])
def test_fanout_bad_input_is_one_clear_line(short_doc, extra, message):
    args = ["fanout"] + (extra if "--doc" in extra else ["--doc", str(short_doc)] + extra)
    proc = swarmkv(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_one_printer_for_every_mode_ray_included(capsys):
    """`fanout --ray` prints through the same printer as the local modes (Ray's figures
    from FanoutResult.extras)."""
    from argparse import Namespace

    from swarmkv_ffi.cli import _print_fanout
    from swarmkv_ffi.fanout import BranchResult, FanoutResult
    branch = BranchResult(index=0, question="Who?", n_prefix_used=10, prompt_token_ids=[1, 2], prompt_text="p",
                          token_ids=[5, 6], text=" Nobody.", activation_ms=12.0)
    result = FanoutResult(mode="ray", model="m.gguf", n_prefix=10, n_ctx=256, prefill_ms=90.0,
                          prefill_skipped=False, snapshot_bytes=2**20, total_ms=150.0, branches=[branch],
                          extras={"n_actors": 2, "retries": 1, "snapshot_fetch_ms": [3.5], "actor_total_ms": [40.0]})
    _print_fanout(result, Namespace(doc="doc.txt"))
    out = capsys.readouterr().out
    assert "prefilled once on a Ray worker in 90 ms; 2 actors, 1 retries" in out
    assert "[0] Q: Who?" in out and "A: Nobody." in out and "snapshot fetch 3.5 ms" in out
