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
from pathlib import Path

import numpy as np

from .errors import SwarmKVError
from .fanout.config import FanoutConfig
from .fanout.types import BranchResult, FanoutResult

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

    def answer(self, snapshot_bytes: np.ndarray, document: str, specs: list[dict]) -> dict:
        """Check the snapshot on arrival, restore it, answer `specs` together; returns the
        group's FanoutResult as a dict plus the time the snapshot took to arrive."""
        from .fanout import BranchSpec, run_fanout
        from .snapshot import Snapshot
        t = time.perf_counter_ns()
        snap = Snapshot.from_bytes(snapshot_bytes)  # raises SnapshotCorruptError on a bad checksum
        fetch_ms = (time.perf_counter_ns() - t) / 1e6
        result = run_fanout(self.model, document, [BranchSpec(**s) for s in specs], mode="shared",
                            snapshot_in=snap, **self.opts)
        return {**result.to_dict(), "snapshot_fetch_ms": fetch_ms}


def run_fanout_ray(model_path: str, document: str, specs, *, address: str | None = None,
                   n_actors: int = 2, branches_per_actor: int | None = None, timeout: float = 600.0,
                   use_gpu: bool | None = None, cpus_per_actor: int = 1, **opts) -> FanoutResult:
    """Fan out over Ray. Returns a FanoutResult (mode "ray") whose `extras` hold what only
    Ray has: actors used, retries, and per branch the snapshot's fetch time and its
    actor's own end-to-end time.

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
    if opts.get("n_threads") is None:      # None or absent: the CPUs each worker was granted
        opts["n_threads"] = cpus_per_actor
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
    results: dict[int, BranchResult] = {}
    groups_out: dict[int, dict] = {}
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
                group = r.get(ref, timeout=max(1.0, deadline - time.time()))
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
            for i, b in zip(idx, group["branches"]):
                results[i] = BranchResult.from_dict({**b, "index": i})
                groups_out[i] = group
    return _result(model_path, results, groups_out, prefill_ms, ms(), len(groups), retries)


def _result(model_path: str, results: dict, groups: dict, prefill_ms: float, total_ms: float,
            n_actors: int, retries: int) -> FanoutResult:
    """One FanoutResult from the actors' groups; prefill_ms is until the snapshot was stored."""
    first = groups[0]
    order = range(len(results))
    return FanoutResult(
        mode="ray", model=Path(model_path).name, n_prefix=first["n_prefix"], n_ctx=first["n_ctx"],
        prefill_ms=prefill_ms, prefill_skipped=False, snapshot_bytes=first["snapshot_bytes"],
        total_ms=total_ms, branches=[results[i] for i in order],
        extras={"n_actors": n_actors, "retries": retries,
                "snapshot_fetch_ms": [groups[i]["snapshot_fetch_ms"] for i in order],
                "actor_total_ms": [groups[i]["total_ms"] for i in order]})


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
