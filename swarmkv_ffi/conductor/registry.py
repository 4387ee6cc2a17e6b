"""Models refcounted by path: two agents on one GGUF share one loaded model, and the last
release frees it."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..model import Model
from ..procmem import rss_bytes


@dataclass
class Loaded:
    model: Model
    refs: int = 0
    measured_bytes: int = 0       # memory the load took (weights as really loaded)
    agents: set = field(default_factory=set)


class ModelRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._models: dict[str, Loaded] = {}
        self._loading: dict[str, threading.Lock] = {}

    def acquire(self, path: Path, agent_id: str) -> tuple[Loaded, bool]:
        """The loaded model for `path` (loading it on first use); returns (entry, newly_loaded).
        Loads of different models proceed in parallel; two loads of one model do not."""
        key = str(path.resolve())
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                entry = self._models.get(key)
                if entry is not None:
                    entry.refs += 1
                    entry.agents.add(agent_id)
                    return entry, False
            before = rss_bytes()
            model = Model(path, use_mmap=False)  # anonymous memory: RSS shows the real cost
            model.fingerprint  # hash the file now, not during the first KV swap
            entry = Loaded(model, refs=1, measured_bytes=max(model.size_bytes, rss_bytes() - before),
                           agents={agent_id})
            with self._lock:
                self._models[key] = entry
            return entry, True

    def release(self, path: Path, agent_id: str) -> bool:
        """Drop one reference; frees the model (returns True) when it was the last."""
        key = str(path.resolve())
        with self._lock:
            entry = self._models.get(key)
            if entry is None:
                return False
            entry.refs -= 1
            entry.agents.discard(agent_id)
            if entry.refs > 0:
                return False
            del self._models[key]
        entry.model.close()
        return True

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(path, refcount, measured bytes) for STATUS."""
        with self._lock:
            return [(k, e.refs, e.measured_bytes) for k, e in self._models.items()]
