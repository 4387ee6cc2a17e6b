"""Local copy mode against Ray (one node, two actors) for the same N branches.

Reports the time to put and fetch the snapshot, per-branch activation, end-to-end, and
Ray's overhead per branch ((ray e2e - local e2e) / N). Writes fanout_ray.json. Needs the
`distributed` extra.

    swarmkv bench ray --doc-tokens 3500 --branches 8 --actors 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .. import catalog
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from ..snapshot import Snapshot
from .measure import QUESTIONS, cpu_name, document_of, report_json, settings_of


def main(argv=None) -> int:
    try:
        import ray
    except ImportError:
        print("swarmkv bench ray: Ray is not installed: pip install 'swarmkv-ffi[distributed]'", file=sys.stderr)
        return 2
    from ..distributed import run_fanout_ray
    p = argparse.ArgumentParser(prog="swarmkv bench ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=catalog.DEFAULT_MODEL)
    p.add_argument("--doc-tokens", type=int, default=3500)
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--out", default=None, help="output folder (default: bench/results/<cpu>-<date>)")
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/results/{cpu_name()}-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    path = catalog.resolve(args.model)
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.gen_tokens) for i in range(args.branches)]
    with Model(path) as model:
        document = document_of(model, args.doc_tokens)
        # Local copy mode gets as many threads as the Ray side's actors have CPUs together.
        config = FanoutConfig(n_threads=args.actors)
        saved = []
        local = run_fanout(model, document, specs, config, mode="copy", snapshot_out=saved.append, cache=False)
    ray.init(num_cpus=args.actors + 1, include_dashboard=False, log_to_driver=False)
    blob = np.frombuffer(saved[0].to_bytes(), dtype=np.uint8)
    t = time.perf_counter_ns()
    ref = ray.put(blob)
    put_ms = (time.perf_counter_ns() - t) / 1e6
    t = time.perf_counter_ns()
    Snapshot.from_bytes(ray.get(ref, timeout=600))
    fetch_ms = (time.perf_counter_ns() - t) / 1e6
    remote = run_fanout_ray(str(path), document, specs, n_actors=args.actors)
    ray.shutdown()
    report = {
        "command": " ".join(["swarmkv bench ray"] + (sys.argv[1:] if argv is None else argv)),
        "doc_tokens": local.n_prefix, "branches": args.branches, "actors": args.actors,
        "snapshot_bytes": saved[0].nbytes, "ray_put_ms": put_ms, "ray_fetch_and_verify_ms": fetch_ms,
        "local_copy_e2e_ms": local.total_ms, "ray_e2e_ms": remote.total_ms,
        "ray_prefill_ms": remote.prefill_ms, "local_prefill_ms": local.prefill_ms,
        "ray_overhead_per_branch_ms": (remote.total_ms - local.total_ms) / args.branches,
        "local_activation_ms": [b.activation_ms for b in local.branches],
        "ray_activation_ms": [b.activation_ms for b in remote.branches],
        "ray_snapshot_fetch_ms": remote.extras["snapshot_fetch_ms"],
        # fast kernels: equal tokens here are likely, not guaranteed (batched vs alone)
        "same_tokens": [b.token_ids for b in local.branches] == [b.token_ids for b in remote.branches],
    }
    report_json(report, out / "fanout_ray.json", settings_of(args, config),
                shown={k: v for k, v in report.items() if not isinstance(v, list)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
