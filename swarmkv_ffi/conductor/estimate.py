"""How many bytes an agent needs, derived from its GGUF before anything is loaded.

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
from .modelfile import ModelFile, read_header

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


def _facts(path: Path) -> dict:
    """Architecture facts and tensor bytes from the GGUF header (the `gguf` package)."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {path}: {exc}") from exc

    def get(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF has no general.architecture")
    n_embd = get(f"{arch}.embedding_length")
    n_head = get(f"{arch}.attention.head_count")
    n_layer = get(f"{arch}.block_count")
    if None in (n_embd, n_head, n_layer):
        raise ModelLoadError(f"{path}: GGUF lacks embedding_length, head_count or block_count for {arch}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "arch": arch, "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer,
        "n_head_kv": get(f"{arch}.attention.head_count_kv", n_head),
        "key_length": get(f"{arch}.attention.key_length", n_embd // n_head),
        "value_length": get(f"{arch}.attention.value_length", n_embd // n_head),
        "n_vocab": len(tokens.data) if tokens is not None else 32000,
        "weights": sum(int(t.n_bytes) for t in reader.tensors),
        "header_bytes": int(reader.data_offset),
    }


def estimate(mf: ModelFile, fd: int, n_ctx: int, facts: dict | None = None) -> Estimate:
    """The GGUF-derived estimate for an opened, checked model file (modelfile.py); the
    facts are cached per file identity, since reading a vocabulary is slow. `facts`: the
    header facts the sandbox read from an untrusted file (the daemon never parses it)."""
    if facts is None:
        facts = _trusted_facts(mf, fd)
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
            facts = read_header(mf, fd, _facts)
            with _lock:
                _cache[mf.identity] = facts
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
