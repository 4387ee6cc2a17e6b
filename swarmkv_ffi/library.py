"""Find libllama, load it with cffi (ABI mode), check it against the pin, route its log.

Everything that touches the shared library starts here: `ffi` and `lib()` are the only
handles the rest of the package uses. The library is loaded lazily, once per process, so
importing swarmkv_ffi never fails just because libllama has not been built yet.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import deque
from pathlib import Path

from cffi import FFI

from . import _cdef, calibration, cpu
from .errors import CpuMismatchError, LibraryNotFoundError, PinMismatchError

log = logging.getLogger("swarmkv_ffi.llama")

ffi = FFI()
ffi.cdef(_cdef.cdef_source())


def enum(name: str) -> dict[str, int]:
    """An enum of the cdef by C name ("ggml_type"), as {constant: value}: the one place
    enum values come from, so no integer is copied from llama.h twice."""
    return ffi.typeof(f"enum {name}").relements


ENV_LIBRARY = "SWARMKV_LIBLLAMA"
ENV_ALLOW_UNPINNED = "SWARMKV_ALLOW_UNPINNED"
REPO_ROOT = Path(__file__).resolve().parent.parent

_lock = threading.Lock()
_lib = None
_lib_path: Path | None = None
_manifest: dict = {}         # the loaded library's manifest.json, read once at load
_backend_ready = False
_log_callback = None  # kept alive for as long as libllama may call it
# libllama logs on the thread that made the call, so each thread keeps its own error lines:
# concurrent loads and decodes (lmxd, copy-mode workers, Ray actors) never read or clear
# each other's messages.
_thread_log = threading.local()


def candidate_paths() -> list[Path]:
    """Where libllama is looked for, in order."""
    found = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        p = Path(env)
        found.append(p / "libllama.so" if p.is_dir() else p)
    # Only the package's own build (never the current directory: a libllama.so planted
    # in whatever folder a user runs from must not be loaded).
    found.append(REPO_ROOT / "libllama" / "lib" / "libllama.so")
    return found


def find_library() -> Path:
    """The first existing candidate, or an error that says how to get one."""
    env = os.environ.get(ENV_LIBRARY)
    candidates = candidate_paths()
    if env and not candidates[0].exists():
        raise LibraryNotFoundError(
            f"{ENV_LIBRARY}={env} does not point at an existing libllama.so")
    for path in candidates:
        if path.exists():
            return path
    tried = "\n  ".join(str(p) for p in candidates)
    raise LibraryNotFoundError(
        "libllama.so not found. Build it with ./build_llama.sh (from the swarmkv-ffi "
        f"repository), or set {ENV_LIBRARY} to its path. Looked in:\n  {tried}")


def cache_dir() -> Path:
    """build_llama.sh's cache folder (pinned sources, builds, tools' inputs):
    $SWARMKV_CACHE, else $XDG_CACHE_HOME/swarmkv-ffi, else ~/.cache/swarmkv-ffi."""
    env = os.environ.get("SWARMKV_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarmkv-ffi"


def install_root(lib_path: Path) -> Path:
    """build_llama.sh's install folder: lib/ and include/ and manifest.json side by side."""
    return lib_path.resolve().parent.parent


def tool_path(name: str, build: str = "stock") -> Path:
    """Where `./build_llama.sh --tools` puts llama.cpp's own tools (llama-server,
    llama-bench, llama-batched-bench) for the library we load, beside its lib/: built
    from the stock pin (tools-stock/, the yardstick every comparison uses) or with our
    ggml patches applied (tools/, for stock-vs-patched runs of llama.cpp's benchmarks)."""
    folders = {"stock": "tools-stock", "patched": "tools"}
    if build not in folders:
        raise ValueError(f"build must be one of {sorted(folders)}, not {build!r}")
    return install_root(find_library()) / folders[build] / name


def read_manifest(lib_path: Path | None = None) -> dict | None:
    """The build manifest written by build_llama.sh, if the library has one."""
    root = install_root(lib_path or find_library())
    try:
        return json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def header_sha256(lib_path: Path) -> str | None:
    """sha256 of the llama.h installed next to the library, or None if there is none."""
    header = install_root(lib_path) / "include" / "llama.h"
    if not header.exists():
        return None
    return hashlib.sha256(header.read_bytes()).hexdigest()


def check_pin(lib_path: Path) -> None:
    """Refuse a libllama whose llama.h is not the one our declarations describe.

    A wrong header means wrong struct layouts, which means silent memory corruption, so
    this is an error unless SWARMKV_ALLOW_UNPINNED=1 says the caller takes that risk.
    """
    if os.environ.get(ENV_ALLOW_UNPINNED) == "1":
        return
    got = header_sha256(lib_path)
    if got is None:
        manifest = read_manifest(lib_path) or {}
        got = manifest.get("llama_h_sha256")
    if got is None:
        raise PinMismatchError(
            f"cannot verify {lib_path}: no include/llama.h or manifest.json beside it. "
            f"Build with ./build_llama.sh, or set {ENV_ALLOW_UNPINNED}=1 to skip the check.")
    if got != _cdef.LLAMA_H_SHA256:
        raise PinMismatchError(
            f"{lib_path} was built from a llama.h with sha256 {got}, but swarmkv_ffi's "
            f"declarations were copied from {_cdef.LLAMA_H_SHA256} (llama.cpp "
            f"{_cdef.LLAMA_CPP_COMMIT}, {_cdef.SOURCE}). Rebuild with ./build_llama.sh.")


def check_cpu(lib_path: Path) -> None:
    """Refuse a libllama compiled for instruction sets this CPU does not have.

    Loading it would work; its first matmul would kill the process with SIGILL. The
    manifest lists what the build was compiled for (build_llama.sh reads it from the
    compiler); a build without that list predates the check and is let through.
    """
    manifest = read_manifest(lib_path) or {}
    required = manifest.get("cpu_features") or []
    missing = cpu.missing_features(required)
    if missing:
        raise CpuMismatchError(
            f"{lib_path} was compiled for a CPU with {', '.join(missing)} "
            f"(built on: {manifest.get('built_on') or 'unknown'}, target "
            f"{manifest.get('cpu_target', 'native')}), which this CPU "
            f"({cpu.describe_host()}) lacks; it would die with SIGILL. Rebuild here with "
            "./build_llama.sh, or build once with ./build_llama.sh --portable for mixed machines.")


def system_info() -> str:
    """ggml's own list of the CPU features this build uses ("AVX2 = 1 | ...")."""
    return ffi.string(backend().llama_print_system_info()).decode()


_LEVELS = {enum("ggml_log_level")[f"GGML_LOG_LEVEL_{name}"]: level for name, level in
           (("DEBUG", logging.DEBUG), ("INFO", logging.INFO), ("WARN", logging.WARNING),
            ("ERROR", logging.ERROR))}
_CONT = enum("ggml_log_level")["GGML_LOG_LEVEL_CONT"]


def _on_llama_log(level: int, text, _user_data) -> None:
    """libllama's log, line by line, into Python logging (logger 'swarmkv_ffi.llama').

    libllama sends pieces of a line (GGML_LOG_LEVEL_CONT continues the previous one);
    we join them and emit complete lines so log records stay readable.
    """
    try:
        piece = ffi.string(text).decode("utf-8", "replace")
        mine = _this_thread()
        if level != _CONT:
            mine.level = _LEVELS.get(level, logging.DEBUG)
        mine.partial.append(piece)
        if not piece.endswith("\n"):
            return
        line = "".join(mine.partial).rstrip()
        mine.partial.clear()
        if mine.level >= logging.ERROR:
            mine.errors.append(line)
        log.log(mine.level, "%s", line)
    except Exception:  # a callback must never raise into C
        pass


def _this_thread():
    """This thread's log state: its last error lines, a line in pieces, its level."""
    if not hasattr(_thread_log, "errors"):
        _thread_log.errors, _thread_log.partial, _thread_log.level = deque(maxlen=8), [], logging.DEBUG
    return _thread_log


def recent_errors(clear: bool = True) -> list[str]:
    """The last error lines libllama logged on this thread: the library's own words for
    our exceptions."""
    errors = _this_thread().errors
    out = list(errors)
    if clear:
        errors.clear()
    return out


def take_error_text(default: str = "") -> str:
    """This thread's recent libllama error lines as one string (and forget them): what
    every exception about a failed libllama call appends."""
    return "; ".join(recent_errors()) or default


def lib():
    """The loaded libllama (loading, checking and initialising it on first use)."""
    global _lib, _lib_path, _log_callback, _manifest
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = find_library()
            check_pin(path)
            check_cpu(path)
            try:
                handle = ffi.dlopen(str(path))
            except OSError as exc:
                raise LibraryNotFoundError(f"could not load {path}: {exc}") from exc
            _log_callback = ffi.callback("ggml_log_callback", _on_llama_log)
            handle.llama_log_set(_log_callback, ffi.NULL)
            _lib_path, _manifest = path, read_manifest(path) or {}
            calibration.apply(_manifest, path)   # this CPU's kernel rule, if the build was calibrated here
            _lib = handle
    return _lib


def manifest() -> dict:
    """The loaded library's build manifest ({} for a build without one), read once: the
    files beside a loaded library do not change what was loaded."""
    lib()
    return _manifest


def build_info() -> dict:
    """What a result was measured on, for result files: the loaded library's path, its
    llama.cpp commit, backend, CPU target and compiled features, patch set and flags (from
    its manifest), ggml's own report of the features it uses, and the backend's devices."""
    m = manifest()
    keys = ("llama_cpp_commit", "backend", "cuda_arch", "cpu_target", "cpu_features", "patch_set", "patches",
            "build_flags", "built_at")
    rule = kernel_rule()
    return {"library": str(library_path()), **{k: m.get(k) for k in keys}, "ggml_system_info": system_info().strip(),
            "devices": [d["name"] for d in devices()],
            "fa_shared_rule": {"source": rule["source"], "rule": rule["rule"]}}


def kernel_rule() -> dict:
    """Which attention kernel the fast mode takes (calibration.py): the decision made when
    the library loaded and the rule table in force."""
    lib()
    return calibration.status()


def library_path() -> Path:
    lib()
    return _lib_path


def backend():
    """Initialise the llama + ggml backend once per process and return the library."""
    global _backend_ready
    handle = lib()
    if not _backend_ready:
        with _lock:
            if not _backend_ready:
                handle.llama_backend_init()
                _backend_ready = True
    return handle


def devices() -> list[dict]:
    """The backend devices ggml sees (CPU always; CUDA when built with it), with memory."""
    handle = backend()
    out = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    kinds = {v: k.rsplit("_", 1)[1].lower() for k, v in enum("ggml_backend_dev_type").items()}
    for i in range(handle.ggml_backend_dev_count()):
        dev = handle.ggml_backend_dev_get(i)
        handle.ggml_backend_dev_memory(dev, free, total)
        out.append({
            "name": ffi.string(handle.ggml_backend_dev_name(dev)).decode(),
            "description": ffi.string(handle.ggml_backend_dev_description(dev)).decode(),
            "type": kinds.get(int(handle.ggml_backend_dev_type(dev)), "unknown"),
            "memory_free": int(free[0]),
            "memory_total": int(total[0]),
        })
    return out


def version() -> str:
    return ffi.string(lib().llama_version()).decode()
