"""How many bytes an agent needs, from its GGUF's facts, before its weights are booked.

    weights  the sum of the tensors' sizes in the file
    kv       n_ctx x n_layer x n_head_kv x (key_length + value_length) x 2 bytes (f16 cache)
    compute  the logits buffer (n_vocab x n_ubatch floats) plus activations
             (n_ubatch x (4 n_embd + n_head n_ctx) floats)

A table file (JSON: {"model name or path": bytes}) overrides the whole estimate, and the
daemon replaces each estimate with what it measured once the model is loaded.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .modelfile import ModelFile, check_unchanged, fd_path

N_UBATCH = 512
KV_BYTES = 2  # f16 cache

_cache: dict[tuple, dict] = {}
_parsing: dict[tuple, threading.Lock] = {}   # one parse per file; others wait for it
_lock = threading.Lock()


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv: int
    compute: int
    source: str = "gguf"

    @property
    def agent_bytes(self) -> int:
        """What each agent on the model needs beyond the shared weights."""
        return self.kv + self.compute

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def facts_of(model) -> dict:
    """The facts the estimate needs, as libllama read them from a loaded model: its C parser
    takes under a second where gguf-py spends 17 s on Gemma 3's 262k-token vocabulary."""
    arch = model.meta("general.architecture") or "?"
    n_embd, n_head = model.n_embd, max(1, model.n_head)

    def number(key: str, default: int) -> int:
        value = model.meta(f"{arch}.{key}")
        return int(value) if value and value.isdigit() else default
    return {"arch": arch, "n_embd": n_embd, "n_head": n_head, "n_layer": model.n_layer,
            "n_head_kv": model.n_head_kv, "key_length": number("attention.key_length", n_embd // n_head),
            "value_length": number("attention.value_length", n_embd // n_head),
            "n_vocab": model.n_vocab, "weights": model.size_bytes}


def estimate(mf: ModelFile, fd: int, n_ctx: int, facts: dict | None = None) -> Estimate:
    """The GGUF-derived estimate for an opened, checked model file (modelfile.py); the
    facts are cached per file identity. `facts`: those the sandbox read from an untrusted
    file (the daemon loads such a file only once the sandbox has survived it)."""
    if facts is None:
        facts = _trusted_facts(mf, fd)
    return of_facts(facts, n_ctx)


def of_facts(facts: dict, n_ctx: int) -> Estimate:
    """The estimate for a context of n_ctx cells of a model with these facts: its KV, and
    a compute buffer for one ubatch whose attention scores grow with n_ctx."""
    kv = n_ctx * facts["n_layer"] * facts["n_head_kv"] * (facts["key_length"] + facts["value_length"]) * KV_BYTES
    compute = 4 * N_UBATCH * (facts["n_vocab"] + 4 * facts["n_embd"] + facts["n_head"] * n_ctx)
    return Estimate(weights=facts["weights"], kv=kv, compute=compute)


def _trusted_facts(mf: ModelFile, fd: int) -> dict:
    with _lock:
        gate = _parsing.setdefault(mf.identity, threading.Lock())
    with gate:
        with _lock:
            facts = _cache.get(mf.identity)
        if facts is None:
            facts = _load_facts(mf, fd)
            with _lock:
                _cache[mf.identity] = facts
    return facts


def _load_facts(mf: ModelFile, fd: int) -> dict:
    """A trusted file's facts: libllama loads it here, on the CPU and without mmap (a file
    truncated under a mapping would kill the daemon with SIGBUS; a read just fails), and
    the file must not have changed meanwhile."""
    from ..model import Model
    try:
        with Model(fd_path(fd), n_gpu_layers=0, use_mmap=False) as model:
            facts = facts_of(model)
    except ModelLoadError:
        check_unchanged(mf, fd)          # a file cut short says so, not libllama's guess
        raise
    check_unchanged(mf, fd)
    return facts


def load_table(path: str | Path) -> dict[str, int]:
    """The override table: {"smollm2-135m" or "/path/model.gguf": bytes}."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read --vram-table {path}: {exc}") from exc
    if not isinstance(table, dict) or not all(isinstance(v, int) and v > 0 for v in table.values()):
        raise ValueError(f"--vram-table {path} must be a JSON object of positive byte counts")
    return table
