"""Scale-out: the fan-out on Ray (the `distributed` extra). Nothing else imports ray.

    prefill task (one worker) ──snapshot bytes──▶ Ray object store (stored once)
        ──▶ BranchWorker actors: each loads the model once, restores the snapshot into its
            own context and answers its share of the branches together (shared mode)

The snapshot travels in the copy-mode format, header and checksum included, as a NumPy
uint8 array, so actors on the prefill's node read it from the object store without a copy;
each actor checks the checksum on arrival. An actor that dies has its branches retried on
another actor. Every wait has a timeout that names what it waited for.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from .errors import SwarmKVError
from .fanout.config import FanoutConfig

try:
    import ray
except ImportError:  # the core package never needs it
    ray = None


class RayFanoutError(SwarmKVError):
    """A Ray fan-out could not finish (timeouts, every actor lost)."""


def _require_ray():
    if ray is None:
        raise RayFanoutError("Ray is not installed: pip install 'swarmkv-ffi[distributed]'")
    return ray


def prefill_snapshot(model_path: str, document: str, specs: list[dict], opts: dict) -> np.ndarray:
    """Runs on one Ray worker: prefill the document once (copy mode's prefill, which hands
    its snapshot to snapshot_out); return the snapshot's file bytes."""
    from .fanout import BranchSpec, run_fanout
    from .model import Model

    saved = []
    with Model(model_path) as model:
        # max_tokens=1 per branch: only the prefill and its snapshot matter here
        one = [BranchSpec(**{**s, "max_tokens": 1}) for s in specs[:1]]
        run_fanout(model, document, one, mode="copy", snapshot_out=saved.append, **opts)
    return np.frombuffer(saved[0].to_bytes(), dtype=np.uint8)


class BranchWorker:
    """A Ray actor: one model, reused for every branch group it is given."""

    def __init__(self, model_path: str, opts: dict):
        from .model import Model
        self.model = Model(model_path)
        self.model.fingerprint  # hash once, before the first restore
        self.opts = opts

    def answer(self, snapshot_bytes: np.ndarray, document: str, specs: list[dict]) -> list[dict]:
        """Check the snapshot on arrival, restore it, answer `specs` together."""
        from .fanout import BranchSpec, run_fanout
        from .snapshot import Snapshot
        t = time.perf_counter_ns()
        snap = Snapshot.from_bytes(snapshot_bytes)  # raises SnapshotCorruptError on a bad checksum
        fetch_ms = (time.perf_counter_ns() - t) / 1e6
        result = run_fanout(self.model, document, [BranchSpec(**s) for s in specs], mode="shared",
                            snapshot_in=snap, **self.opts)
        out = []
        for b in result.branches:
            d = b.to_dict()
            d["snapshot_fetch_ms"] = fetch_ms
            d["actor_total_ms"] = result.total_ms
            out.append(d)
        return out


def run_fanout_ray(model_path: str, document: str, specs, *, address: str | None = None,
                   n_actors: int = 2, branches_per_actor: int | None = None, timeout: float = 600.0,
                   use_gpu: bool | None = None, cpus_per_actor: int = 1, **opts) -> dict:
    """Fan out over Ray. Returns a dict like FanoutResult.to_dict() plus Ray timings.

    Each worker asks Ray for one GPU (CUDA clusters) or `cpus_per_actor` CPUs and runs
    that many compute threads: more threads than granted CPUs make ggml's spinning
    threads fight each other."""
    r = _require_ray()
    if not r.is_initialized():
        r.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    if n_actors < 1:
        raise ValueError(f"n_actors must be >= 1, got {n_actors}")
    specs = list(specs)
    if use_gpu is None:
        use_gpu = bool(r.cluster_resources().get("GPU", 0))
    resources = {"num_gpus": 1} if use_gpu else {"num_cpus": cpus_per_actor}
    opts.setdefault("n_threads", cpus_per_actor)
    opts = FanoutConfig.of(**opts).as_dict()  # checked here, not on a worker
    t0 = time.perf_counter_ns()

    def ms() -> float:
        return (time.perf_counter_ns() - t0) / 1e6

    task = r.remote(**resources)(prefill_snapshot)
    payload = [asdict(s) for s in specs]
    snapshot_ref = task.remote(model_path, document, payload, opts)
    _wait(r, [snapshot_ref], timeout, "the prefill task (document snapshot)")
    prefill_ms = ms()  # the snapshot now sits in the object store, stored once

    actor_cls = _actor_class(resources)
    actors = [actor_cls.remote(model_path, opts) for _ in range(min(n_actors, len(specs)))]
    per = branches_per_actor or -(-len(specs) // len(actors))
    groups = [list(range(i, min(i + per, len(specs)))) for i in range(0, len(specs), per)]
    results: dict[int, dict] = {}
    pending = {}
    for g, idx in enumerate(groups):
        actor = actors[g % len(actors)]
        pending[actor.answer.remote(snapshot_ref, document, [payload[i] for i in idx])] = (idx, actor, 0)
    retries = 0
    deadline = time.time() + timeout
    while pending:
        left = deadline - time.time()
        if left <= 0:
            raise RayFanoutError(f"timed out after {timeout} s waiting for branch groups "
                                 f"{[v[0] for v in pending.values()]} on Ray actors")
        ready, _ = r.wait(list(pending), num_returns=1, timeout=left)
        for ref in ready:
            idx, actor, tries = pending.pop(ref)
            try:
                answers = r.get(ref, timeout=max(1.0, deadline - time.time()))
            except r.exceptions.RayActorError:
                actors = [a for a in actors if a is not actor]
                if not actors:
                    actors = [actor_cls.remote(model_path, opts)]
                if tries >= 2:
                    raise RayFanoutError(f"branches {idx}: actors died 3 times") from None
                retries += 1
                other = actors[retries % len(actors)]
                pending[other.answer.remote(snapshot_ref, document, [payload[i] for i in idx])] = (idx, other, tries + 1)
                continue
            except r.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            for i, a in zip(idx, answers):
                a["index"] = i
                results[i] = a
    branches = [results[i] for i in range(len(specs))]
    return {"mode": "ray", "model": model_path, "prefill_ms": prefill_ms, "total_ms": ms(),
            "n_actors": len(groups), "retries": retries, "branches": branches}


def _actor_class(resources: dict):
    """The Ray actor class for branch workers (a seam the tests use to kill actors)."""
    return ray.remote(**resources)(BranchWorker)


def _wait(r, refs, timeout: float, what: str) -> None:
    ready, _ = r.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        raise RayFanoutError(f"timed out after {timeout} s waiting for {what}")
    try:
        r.get(refs, timeout=timeout)
    except r.exceptions.RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
