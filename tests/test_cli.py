"""The `swarmkv` command line, run as a user would (subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def swarmkv(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", *args],
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"swarmkv {args} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def test_info_json():
    report = json.loads(swarmkv("info", "--json").stdout)
    assert report["library"].endswith("libllama.so")
    assert report["manifest"]["llama_h_sha256"] == report["pin"]["llama_h_sha256"]
    assert any(d["type"] == "cpu" for d in report["devices"])
    assert {m["name"] for m in report["models"]} >= {"smollm2-135m", "gemma3-270m"}


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
