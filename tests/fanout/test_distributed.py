"""The fan-out on a local Ray cluster: same greedy tokens as local copy mode (both in
exact mode), bad snapshots rejected on arrival, a dead actor's branches retried
elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'swarmkv-ffi[distributed]')")

from swarmkv_ffi import catalog, errors  # noqa: E402
from swarmkv_ffi.distributed import BranchWorker, prefill_snapshot, run_fanout_ray  # noqa: E402
from swarmkv_ffi.fanout import BranchSpec, run_fanout  # noqa: E402
from corpus import DOC, QUESTIONS  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]   # a Ray cluster starts
OPTS = dict(n_batch=64)


@pytest.fixture(scope="module")
def cluster():
    from swarmkv_ffi.distributed import loopback_only
    loopback_only()
    # address="local": a Ray of its own, never one already running on the machine (a
    # user's, or another test run's: attaching to it failed with "num_cpus must not be provided")
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_path():
    return str(catalog.resolve("smollm2-135m"))


def specs(n=4):
    return [BranchSpec(q, max_tokens=8) for q in QUESTIONS[:n]]


def test_ray_branches_match_local_copy_mode(cluster, model_path, smol):
    # A Ray actor decodes its branches together, copy mode decodes each alone: only exact
    # mode's batch-invariant kernels make that the same computation on every CPU.
    out = run_fanout_ray(model_path, DOC, specs(), n_actors=2, exact=True, **OPTS)
    local = run_fanout(smol, DOC, specs(), mode="copy", exact=True, **OPTS)
    assert out.mode == "ray" and out.n_prefix == local.n_prefix
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in local.branches]
    assert [b.index for b in out.branches] == [0, 1, 2, 3]
    assert out.extras["n_actors"] == 2 and out.extras["retries"] == 0
    assert all(ms > 0 for ms in out.extras["snapshot_fetch_ms"])


def test_corrupt_snapshot_is_rejected_on_arrival(cluster, model_path):
    snap = ray.get(ray.remote(prefill_snapshot).remote(model_path, DOC, [{"question": "q?"}], OPTS),
                   timeout=600)
    bad = np.array(snap, copy=True)
    bad[-10] ^= 0xFF
    worker = ray.remote(BranchWorker).remote(model_path, OPTS)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(worker.answer.remote(ray.put(bad), DOC, [{"question": "q?", "max_tokens": 2}]), timeout=600)
    assert isinstance(info.value.as_instanceof_cause(), errors.SnapshotCorruptError)
    assert "checksum" in str(info.value)
    ray.kill(worker)


def test_dead_actor_branches_are_retried(cluster, model_path, smol, monkeypatch):
    """Kill the first actor as soon as work is submitted to it: its branches must be
    answered by the other one, with the same tokens."""
    import swarmkv_ffi.distributed as dist
    real_remote = ray.remote
    killed = []

    class KillFirst:
        """The actor class, but the first actor placed is killed at once."""
        def __init__(self, actor_cls):
            self.actor_cls = actor_cls

        def options(self, **placement):
            return KillFirst(self.actor_cls.options(**placement))

        def remote(self, *a, **k):
            handle = self.actor_cls.remote(*a, **k)
            if not killed:
                killed.append(handle)
                ray.kill(handle, no_restart=True)
            return handle

    monkeypatch.setattr(dist, "_actor_class", lambda resources: KillFirst(real_remote(**resources)(BranchWorker)))
    out = run_fanout_ray(model_path, DOC, specs(2), n_actors=2, exact=True, **OPTS)
    assert killed and out.extras["retries"] >= 1
    local = run_fanout(smol, DOC, specs(2), mode="copy", exact=True, **OPTS)  # the reference, without Ray
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in local.branches]


def test_timeout_names_what_it_waited_for(cluster, model_path):
    with pytest.raises(dist_error()) as info:
        run_fanout_ray(model_path, DOC, specs(1), timeout=0.01, **OPTS)
    assert "prefill" in str(info.value)


def dist_error():
    from swarmkv_ffi.distributed import RayFanoutError
    return RayFanoutError
