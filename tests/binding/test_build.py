"""The build proves itself: CPU key in the manifest, refusal on a foreign CPU, the smoke
decode and its failure paths, and no AMX tile instructions in the default CPU build."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corpus import ROOT
from swarmkv_ffi import Model, cpu, errors, library, tiny_gguf

SMOKE = ROOT / "tools" / "smoke_check.sh"
AMX_MNEMONICS = ("tileloadd", "tdpbusd", "tdpbssd", "tdpbf16ps", "ldtilecfg")


@pytest.fixture(scope="module")
def installed() -> Path:
    """The install folder build_llama.sh wrote (lib/, include/, manifest.json)."""
    return library.install_root(library.find_library())


@pytest.fixture(scope="module")
def manifest(installed) -> dict:
    return json.loads((installed / "manifest.json").read_text())


def run_smoke(prefix: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "SWARMKV_SMOKE_PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SMOKE), str(prefix)], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_manifest_records_the_cpu_features_the_compiler_used(manifest):
    assert manifest["cpu_target"] in ("native", "portable")
    features = manifest["cpu_features"]
    assert features, "a CPU build on x86-64 or arm64 always needs some SIMD features"
    assert cpu.missing_features(features) == [], "the build needs features this CPU lacks"
    if manifest["cpu_target"] == "native" and platform.machine() == "x86_64":
        flags = "-march=native" + ("" if manifest["amx"] else " -mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
        macros = subprocess.run(f"cc {flags} -dM -E - </dev/null", shell=True, check=True,
                                capture_output=True, text=True).stdout
        assert features == cpu.features_from_macros(macros)
        assert "avx2" in features or "avx" not in cpu.host_features()


def test_features_from_macros_maps_names_to_cpuinfo_flags():
    text = "#define __AVX2__ 1\n#define __SSE3__ 1\n#define __AMX_INT8__ 1\n#define __x86_64__ 1\n"
    assert cpu.features_from_macros(text) == ["amx_int8", "avx2", "pni"]
    assert cpu.missing_features(["avx2", "amx_int8"], host={"avx2"}) == ["amx_int8"]


def forged_copy(installed: Path, tmp_path: Path, extra_feature: str) -> Path:
    """A copy of the installed library whose manifest claims one more CPU feature."""
    copy = tmp_path / "libllama"
    shutil.copytree(installed, copy, symlinks=True)
    m = json.loads((copy / "manifest.json").read_text())
    m["cpu_features"] = sorted(m["cpu_features"] + [extra_feature])
    m["built_on"] = "a forged CPU"
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy


def absent_feature() -> str:
    host = cpu.host_features() or set()
    table = cpu.X86_MACROS if platform.machine() == "x86_64" else cpu.ARM_MACROS
    candidates = [f for f in table.values() if f not in host]
    if not candidates:
        pytest.skip("this CPU has every feature we know of")
    return candidates[0]


def test_a_build_for_other_cpu_features_is_refused(installed, tmp_path):
    feature = absent_feature()
    copy = forged_copy(installed, tmp_path, feature)
    with pytest.raises(errors.CpuMismatchError, match=feature) as info:
        library.check_cpu(copy / "lib" / "libllama.so")
    assert "--portable" in str(info.value) and "a forged CPU" in str(info.value)


def test_model_load_on_a_foreign_build_is_a_clear_error_not_sigill(installed, tmp_path):
    feature = absent_feature()
    copy = forged_copy(installed, tmp_path, feature)
    model = tmp_path / "tiny.gguf"
    tiny_gguf.write(str(model))
    code = f"from swarmkv_ffi import Model\nModel({str(model)!r})\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "SWARMKV_LIBLLAMA": str(copy / "lib")}, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "CpuMismatchError" in proc.stderr and feature in proc.stderr


def test_smoke_decode_passes_on_the_installed_build(installed):
    proc = run_smoke(installed)
    assert proc.returncode == 0, proc.stderr


def test_smoke_decode_names_the_signal_that_killed_the_child(installed, tmp_path):
    """A libllama whose llama_decode dies by SIGILL, as the AMX build did on Sapphire Rapids."""
    shim_c = tmp_path / "sigill.c"
    shim_c.write_text("#include <signal.h>\nint llama_decode(void *c, ...) { raise(SIGILL); return 0; }\n")
    shim = tmp_path / "libsigill.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(shim_c)], check=True)
    proc = run_smoke(installed, LD_PRELOAD=str(shim))
    assert proc.returncode != 0
    assert "died by SIGILL" in proc.stderr and "--portable" in proc.stderr


def test_smoke_check_fails_cleanly_on_a_library_that_cannot_load(installed, tmp_path):
    broken = tmp_path / "broken"
    (broken / "lib").mkdir(parents=True)
    shutil.copytree(installed / "include", broken / "include")
    (broken / "lib" / "libllama.so").write_bytes(b"not an ELF file")
    proc = run_smoke(broken)
    assert proc.returncode != 0
    assert "smoke check: error" in proc.stderr


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="AMX exists only on x86-64; needs objdump")
def test_default_cpu_build_has_no_amx_tile_instructions(installed, manifest):
    if manifest["amx"]:
        pytest.skip("this build was made with --amx on purpose")
    libs = sorted((installed / "lib").glob("libggml-cpu*.so*"))
    assert libs, "no ggml CPU library installed"
    text = subprocess.run(["objdump", "-d", str(libs[0])], capture_output=True, text=True,
                          check=True).stdout
    assert len(text) > 100_000, "objdump produced no disassembly"
    found = [m for m in AMX_MNEMONICS if f"\t{m} " in text or f"\t{m}\n" in text]
    assert found == []


def test_the_tiny_model_loads_and_decodes(tmp_path):
    """The model the build's smoke decode uses also works through our own binding."""
    import numpy as np
    from swarmkv_ffi.context import Context
    path = tiny_gguf.write(str(tmp_path / "tiny.gguf"))
    with Model(path) as model, Context(model, n_ctx=128) as ctx:
        tokens = model.tokenize("hello world", add_special=True)
        assert tokens[0] == 1 and len(tokens) > 2
        logits = ctx.logits(ctx.decode_tokens(tokens))
        assert logits.shape == (320,) and np.isfinite(logits).all()


def test_the_current_directory_is_never_searched_for_libllama(tmp_path, monkeypatch):
    planted = tmp_path / "libllama" / "lib" / "libllama.so"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"planted")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(library.ENV_LIBRARY, raising=False)
    assert planted not in library.candidate_paths()
    assert library.find_library() != planted


def test_manifest_lists_the_applied_patches(manifest):
    names = sorted(p.name for p in (ROOT / "kernels" / "ggml").glob("*.patch"))
    assert names and manifest["patches"] == names
    assert len(manifest["patch_set"]) == 16


def test_a_patch_that_does_not_apply_fails_the_build_clearly(tmp_path):
    """A copy of the build script's world with one broken patch: the build stops before
    configuring, names the patch, and installs nothing."""
    root = tmp_path / "repo"
    for part in ("build_llama.sh", "kernels", "tools", "swarmkv_ffi/cpu.py"):
        dst = root / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy2)(ROOT / part, dst)
    (root / "kernels/ggml/0099-broken.patch").write_text(
        "--- a/include/llama.h\n+++ b/include/llama.h\n@@ -1,1 +1,1 @@\n-no such line here\n+nor here\n")
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarmkv-ffi"
    tarballs = list((Path(os.environ.get("SWARMKV_CACHE") or home_cache) / "sdist").glob("*.tar.gz"))
    assert tarballs, "the llama.cpp sdist is not in the build cache; run ./build_llama.sh first"
    for tarball in tarballs:  # no download: the build's own cached copy
        (cache / "sdist" / tarball.name).symlink_to(tarball)
    out = subprocess.run(["bash", str(root / "build_llama.sh"), "--prefix", str(tmp_path / "prefix")],
                         capture_output=True, text=True, env={**os.environ, "SWARMKV_CACHE": str(cache)},
                         timeout=600)
    assert out.returncode != 0
    assert "0099-broken.patch does not apply" in out.stderr
    assert not (tmp_path / "prefix").exists()
    assert not list(cache.glob("build-*"))
