"""What the server may serve: one ModelSpec per model id clients send, from `--model`,
`--models-dir` and `--models-preset`.

- `--model A` (repeatable) is loaded at start and pinned: it stays loaded, as it always has.
- `--models-dir DIR`: every `*.gguf` in DIR, named by its file name without `.gguf`,
  loaded on its first request and unloaded when idle memory is needed (loading.py); the
  folder must be writable by the server's user alone.
- `--models-preset FILE`: a TOML file, one table per model id, for per-model settings:

      ["smollm"]
      model = "smollm2-135m"      # a packaged short name or a path (relative: to the file)
      ctx_size = 8192             # else the server's --ctx-size rule
      parallel = 16
      exact = false
      keep_alive = "5m"           # idle this long, then unloaded ("-1": only for room)
      pinned = false              # true: never unloaded
      load = "demand"             # or "start"

Two ids of the same file and mode name one pool (an alias): its weights, cells and
cached prefixes are shared. TOML is read by the standard library's tomllib, so a typo
in the file is an error naming its line rather than a setting silently dropped.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .. import catalog
from ..conductor import MAX_SEQS, check_models_dir

FOREVER = math.inf

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}

#: The fewest KV cells a pool may have (llama-server's own tests run with 256).
MIN_CELLS = 128


def keep_alive_seconds(value: str | int | float) -> float:
    """Ollama's keep_alive: seconds as a number, or a duration ("500ms", "30s", "5m",
    "2h"); a negative one keeps the model until its memory is needed (FOREVER)."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', not {value!r}")
    match = _DURATION.match(str(value)) if isinstance(value, (str, int, float)) else None
    if match is None:
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', not {value!r}")
    seconds = float(match.group(1)) * _UNIT[match.group(2)]
    return FOREVER if seconds < 0 else seconds


@dataclass(frozen=True)
class ModelSpec:
    """One model id clients may send, and how its pool is made and kept."""
    name: str
    model: str                  # a packaged short name or a path
    ctx_size: int | None        # the pool's cells (None: sizing.py chooses)
    parallel: int               # the pool's sequences
    exact: bool
    keep_alive: float = FOREVER  # idle seconds before it is unloaded
    pinned: bool = False         # never unloaded
    at_start: bool = False       # loaded at start, else on its first request
    tags: tuple[str, ...] = ()   # --tags: words /v1/models shows on its card (llama-server's)

    def file(self) -> Path:
        """The GGUF it loads (ModelNotFoundError when there is none)."""
        return catalog.resolve(self.model)

    def same_pool(self) -> tuple:
        """Specs with equal keys name one pool: the same file in the same mode."""
        return (os.path.realpath(self.file()), self.exact)


PRESET_KEYS = {"model", "ctx_size", "parallel", "exact", "keep_alive", "pinned", "load"}
_KIND = {int: "an integer", str: "a string", bool: "true or false"}


def from_preset(path: Path, defaults: ModelSpec) -> list[ModelSpec]:
    """The models a preset file lists, each setting it leaves out from `defaults`."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--models-preset {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-preset {path}: {exc}") from None
    specs = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"--models-preset {path}: `{name}` must be a table ([\"{name}\"]) of settings")
        unknown = set(table) - PRESET_KEYS
        if unknown:
            raise ValueError(f"--models-preset {path}: [{name}] has unknown settings {sorted(unknown)} "
                             f"(known: {', '.join(sorted(PRESET_KEYS))})")
        specs.append(_preset_entry(path, name, table, defaults))
    return specs


def _preset_entry(path: Path, name: str, table: dict, defaults: ModelSpec) -> ModelSpec:
    def typed(key, kind, default):
        value = table.get(key, default)
        if key in table and (not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool)):
            raise ValueError(f"--models-preset {path}: [{name}] {key} must be {_KIND[kind]}, got {value!r}")
        return value
    model = typed("model", str, name)
    if model not in catalog.CATALOG and not os.path.isabs(os.path.expanduser(model)):
        model = str(path.parent / model)
    load = typed("load", str, "demand")
    if load not in ("start", "demand"):
        raise ValueError(f"--models-preset {path}: [{name}] load must be \"start\" or \"demand\", got {load!r}")
    try:
        keep = keep_alive_seconds(table["keep_alive"]) if "keep_alive" in table else defaults.keep_alive
    except ValueError as exc:
        raise ValueError(f"--models-preset {path}: [{name}] {exc}") from None
    return ModelSpec(name, model, typed("ctx_size", int, defaults.ctx_size),
                     typed("parallel", int, defaults.parallel), typed("exact", bool, defaults.exact),
                     keep, typed("pinned", bool, False), load == "start")


def from_dir(folder: Path, defaults: ModelSpec) -> list[ModelSpec]:
    """Every *.gguf in `folder`, loaded on demand, named by its file name. The folder
    must be the operator's alone (as lmxd's --models-dir): anyone who may write to it
    could plant a file for the server to load."""
    try:
        check_models_dir(folder)
    except FileNotFoundError:
        raise ValueError(f"--models-dir {folder} is not a folder") from None
    return [replace(defaults, name=p.name[:-len(".gguf")], model=str(p))
            for p in sorted(folder.iterdir()) if p.name.endswith(".gguf") and p.is_file()]


def check(specs: list[ModelSpec]) -> None:
    """A clear ValueError for a lineup that cannot work: no model, an id twice, a bad
    size, or two ids of one pool set apart."""
    if not specs:
        raise ValueError("no model to serve: give --model, --models-dir or --models-preset")
    seen: dict[str, ModelSpec] = {}
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"the model id `{spec.name}` is given twice")
        seen[spec.name] = spec
        if spec.ctx_size is not None and spec.ctx_size < MIN_CELLS:
            raise ValueError(f"{spec.name}: ctx_size must be at least {MIN_CELLS} cells, got {spec.ctx_size}")
        if not 2 <= spec.parallel <= MAX_SEQS - 1:
            raise ValueError(f"{spec.name}: parallel must be in 2..{MAX_SEQS - 1}, got {spec.parallel}")
    for group in pools(specs):
        first = group[0]
        for other in group[1:]:
            if {f.name: getattr(other, f.name) for f in fields(other) if f.name not in ("name", "model")} != \
               {f.name: getattr(first, f.name) for f in fields(first) if f.name not in ("name", "model")}:
                raise ValueError(f"`{first.name}` and `{other.name}` name one pool (the same file, "
                                 "both exact or both not): give them the same settings")


def pools(specs: list[ModelSpec]) -> list[list[ModelSpec]]:
    """The specs grouped by the pool they name, in order of first appearance."""
    groups: dict[tuple, list[ModelSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.same_pool(), []).append(spec)
    return list(groups.values())
