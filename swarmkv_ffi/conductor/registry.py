"""Models refcounted by file identity: two agents on one GGUF share one loaded model, and
the last release hands it back to be freed.

The key is the file's identity (modelfile.ModelFile.key), never a path resolved again
later, so a symlink retargeted after REGISTER cannot make UNREGISTER free another model.
Callers hold `gate(key)` around deciding whether a model is loaded and acting on it, so
that decision cannot race with the last release of the same model.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..model import Model
from ..procmem import rss_bytes


@dataclass
class Loaded:
    model: Model
    refs: int = 0
    measured_bytes: int = 0       # memory the load took (weights as really loaded)
    agents: set = field(default_factory=set)
    name: str = ""                # the path the first client named, for STATUS
    context_bytes: tuple[int, int, int] | None = None   # (cells, KV bytes, compute bytes) of a measured context


class ModelRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._models: dict[str, Loaded] = {}
        self._gates: dict[str, threading.RLock] = {}

    def gate(self, key: str) -> threading.RLock:
        """The per-model lock: loads of different models proceed in parallel."""
        with self._lock:
            return self._gates.setdefault(key, threading.RLock())

    def loaded(self, key: str) -> Loaded | None:
        with self._lock:
            return self._models.get(key)

    def acquire(self, key: str, open_path: str, agent_id: str, name: str = "") -> tuple[Loaded, bool]:
        """The loaded model for `key` (loading `open_path` on first use); returns
        (entry, newly_loaded)."""
        with self.gate(key):
            entry = self.loaded(key)
            if entry is not None:
                with self._lock:
                    entry.refs += 1
                    entry.agents.add(agent_id)
                return entry, False
            before = rss_bytes()
            model = Model(open_path, use_mmap=False)  # anonymous memory: RSS shows the real cost
            try:
                model.fingerprint  # hash the file now, while open_path still names it
            except BaseException:
                model.close()
                raise
            entry = Loaded(model, refs=1, measured_bytes=max(model.size_bytes, rss_bytes() - before),
                           agents={agent_id}, name=name or open_path)
            with self._lock:
                self._models[key] = entry
            return entry, True

    def release(self, key: str, agent_id: str) -> Loaded | None:
        """Drop one reference. The last one takes the model out of the registry and returns
        it, for the caller to close once every context over it is freed (a REGISTER of the
        same file meanwhile loads it afresh); else None."""
        with self.gate(key):
            with self._lock:
                entry = self._models.get(key)
                if entry is None:
                    return None
                entry.refs -= 1
                entry.agents.discard(agent_id)
                if entry.refs > 0:
                    return None
                del self._models[key]
            return entry

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(path, refcount, measured bytes) for STATUS."""
        with self._lock:
            return [(e.name, e.refs, e.measured_bytes) for e in self._models.values()]
