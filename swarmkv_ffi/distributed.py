"""Scale-out: the fan-out on Ray (the `distributed` extra). Nothing else imports ray.

    prefill task (one worker) ──snapshot bytes──▶ Ray object store (stored once)
        ──▶ BranchWorker actors: each loads the model once, restores the snapshot into its
            own context and answers its share of the branches together (shared mode)

The snapshot travels in the copy-mode format, header and checksum included, as a NumPy
uint8 array, so actors on the prefill's node read it from the object store without a copy;
each actor checks the checksum on arrival. Actors are placed by a SPREAD placement group,
one bundle each, so they land on as many nodes as the cluster has (a scheduling strategy,
not luck); Ray's object store pulls the snapshot once per node, whatever the number of
actors there (the result's extras say which node ran what and what was pulled where). An
actor that dies, or whose node is lost, has its branches retried on another actor. Every
wait has a timeout that names what it waited for.

On one machine everything binds 127.0.0.1 (connect()): a local start, and a cluster
address on loopback, which Ray would otherwise rewrite to the machine's network address.
"""
from __future__ import annotations

import ipaddress
import os
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


#: Ray's own switch to take 127.0.0.1 as this machine's address (its name says Windows and
#: macOS, where it is the default; on Linux it does the same).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(address: str | None) -> bool:
    """A local start (None) or a HOST:PORT whose host is a loopback address."""
    if address is None:
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_only() -> None:
    """Make this process, and the Ray processes it starts, take 127.0.0.1 as the node's
    address: nothing this project starts on one machine listens on a network interface."""
    os.environ[LOOPBACK_ENV] = "0"
    from ray._private import ray_constants
    ray_constants.ENABLE_RAY_CLUSTER = False


def connect(address: str | None = None) -> None:
    """ray.init for the fan-out and the server: a local instance or a loopback cluster on
    127.0.0.1 only; a remote cluster's address as given (`ray start --head` prints it)."""
    r = _require_ray()
    if r.is_initialized():
        return
    if is_loopback(address):
        loopback_only()
        r.init(address=address, _node_ip_address="127.0.0.1", include_dashboard=False,
               log_to_driver=False, ignore_reinit_error=True)
    else:
        r.init(address=address, log_to_driver=False, ignore_reinit_error=True)


def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


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


def _prefill_where(model_path: str, document: str, specs: list[dict], opts: dict) -> tuple[str, np.ndarray]:
    """prefill_snapshot, and the node it ran on: the node whose object store holds the
    snapshot (two returns, so the snapshot stays an object of its own)."""
    return node_id(), prefill_snapshot(model_path, document, specs, opts)


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
                            snapshot_in=snap, cache=False, **self.opts)
        return {**result.to_dict(), "snapshot_fetch_ms": fetch_ms, "node": node_id(),
                "snapshot_file_bytes": int(snapshot_bytes.nbytes)}

    def node(self) -> str:
        return node_id()


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
    connect(address)
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

    task = r.remote(num_returns=2, **resources)(_prefill_where)
    payload = [asdict(s) for s in specs]
    home_ref, snapshot_ref = task.remote(model_path, document, payload, opts)
    _wait(r, [snapshot_ref], timeout, "the prefill task (document snapshot)")
    prefill_ms = ms()  # the snapshot now sits in the object store of the node that made it
    home = r.get(home_ref)      # now: were that node lost later, Ray would re-run the prefill to say it

    actor_cls = _actor_class(resources)
    group, spread = _spread(r, min(n_actors, len(specs)), resources, timeout)
    try:
        actors = [actor_cls.options(scheduling_strategy=place).remote(model_path, opts) for place in spread]
        per = branches_per_actor or -(-len(specs) // len(actors))
        groups = [list(range(i, min(i + per, len(specs)))) for i in range(0, len(specs), per)]
        ask = lambda actor, idx: actor.answer.remote(snapshot_ref, document, [payload[i] for i in idx])  # noqa: E731
        results, groups_out, retries = _answer_all(r, actors, groups, ask, lambda: actor_cls.remote(model_path, opts),
                                                   time.time() + timeout, timeout)
    finally:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(group)
    return _result(model_path, results, groups_out, prefill_ms, ms(), len(groups), retries, home)


def _answer_all(r, actors: list, groups: list[list[int]], ask, spare, deadline: float, timeout: float):
    """Hand branch group g to actor g mod n (ask(actor, indices) -> ref); a group whose
    actor dies (or whose node is lost) goes to another actor (spare() makes one when
    none is left), three tries at most. Returns results, each branch's group, retries."""
    results: dict[int, BranchResult] = {}
    groups_out: dict[int, dict] = {}
    pending = {ask(actors[g % len(actors)], idx): (idx, actors[g % len(actors)], 0) for g, idx in enumerate(groups)}
    retries = 0
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
                actors = [a for a in actors if a is not actor] or [spare()]
                if tries >= 2:
                    raise RayFanoutError(f"branches {idx}: actors died 3 times") from None
                retries += 1
                other = actors[retries % len(actors)]
                pending[ask(other, idx)] = (idx, other, tries + 1)
                continue
            except r.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            for i, b in zip(idx, group["branches"]):
                results[i] = BranchResult.from_dict({**b, "index": i})
                groups_out[i] = group
    return results, groups_out, retries


def _result(model_path: str, results: dict, groups: dict, prefill_ms: float, total_ms: float,
            n_actors: int, retries: int, home: str) -> FanoutResult:
    """One FanoutResult from the actors' groups; prefill_ms is until the snapshot was stored."""
    first = groups[0]
    order = range(len(results))
    return FanoutResult(
        mode="ray", model=Path(model_path).name, n_prefix=first["n_prefix"], n_ctx=first["n_ctx"],
        prefill_ms=prefill_ms, prefill_skipped=False, snapshot_bytes=first["snapshot_bytes"],
        total_ms=total_ms, branches=[results[i] for i in order],
        extras={"n_actors": n_actors, "retries": retries,
                "snapshot_fetch_ms": [groups[i]["snapshot_fetch_ms"] for i in order],
                "actor_total_ms": [groups[i]["total_ms"] for i in order],
                "branch_nodes": [groups[i]["node"] for i in order],
                "nodes": _nodes_used(groups, order, home)})


def _nodes_used(groups: dict, order, home: str) -> dict:
    """Per node that answered: its branches, and the snapshot bytes pulled to it (none on
    the node that made it; one copy on any other, however many actors there read it)."""
    nodes: dict[str, dict] = {}
    for i in order:
        node = groups[i]["node"]
        entry = nodes.setdefault(node, {"branches": [], "snapshot_bytes_pulled": 0})
        entry["branches"].append(i)
        if node != home:
            entry["snapshot_bytes_pulled"] = groups[i]["snapshot_file_bytes"]
    return nodes


def _spread(r, n: int, resources: dict, timeout: float) -> list:
    """n placements on as many distinct nodes as the cluster has (SPREAD: best effort
    across nodes, packed only where nodes run out)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    bundle = {"GPU": 1} if "num_gpus" in resources else {"CPU": resources["num_cpus"]}
    group = placement_group([bundle] * n, strategy="SPREAD")
    ready, _ = r.wait([group.ready()], timeout=timeout)
    if not ready:
        raise RayFanoutError(f"timed out after {timeout} s placing {n} branch actors ({bundle} each)")
    return group, [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(n)]


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
