#!/usr/bin/env python3
"""Local copy mode against Ray (one node, two actors) for the same N branches.

Reports the time to put and fetch the snapshot, per-branch activation, end-to-end, and
Ray's overhead per branch ((ray e2e - local e2e) / N). Writes fanout_ray.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import ray

from swarmkv_ffi import Model, catalog
from swarmkv_ffi.bench.measure import QUESTIONS, cpu_name, document_of
from swarmkv_ffi.distributed import run_fanout_ray
from swarmkv_ffi.fanout import BranchSpec, run_fanout
from swarmkv_ffi.snapshot import Snapshot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=catalog.DEFAULT_MODEL)
    p.add_argument("--doc-tokens", type=int, default=3500)
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/results/{cpu_name()}-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    path = catalog.resolve(args.model)
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.gen_tokens) for i in range(args.branches)]
    with Model(path) as model:
        document = document_of(model, args.doc_tokens)
        local = run_fanout(model, document, specs, mode="copy", n_threads=args.actors, cache=False)
        saved = []
        run_fanout(model, document, specs[:1], mode="copy", snapshot_out=saved.append, cache=False)
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
        "command": " ".join(["bench/fanout_ray.py"] + (sys.argv[1:] if argv is None else argv)), "cpu": cpu_name(),
        "doc_tokens": local.n_prefix, "branches": args.branches, "actors": args.actors,
        "snapshot_bytes": saved[0].nbytes, "ray_put_ms": put_ms, "ray_fetch_and_verify_ms": fetch_ms,
        "local_copy_e2e_ms": local.total_ms, "ray_e2e_ms": remote["total_ms"],
        "ray_prefill_ms": remote["prefill_ms"], "local_prefill_ms": local.prefill_ms,
        "ray_overhead_per_branch_ms": (remote["total_ms"] - local.total_ms) / args.branches,
        "local_activation_ms": [b.activation_ms for b in local.branches],
        "ray_activation_ms": [b["activation_ms"] for b in remote["branches"]],
        "same_tokens": [b.token_ids for b in local.branches] == [b["token_ids"] for b in remote["branches"]],
    }
    (out / "fanout_ray.json").write_text(json.dumps(report, indent=2))
    for k, v in report.items():
        if not isinstance(v, list):
            print(f"{k:>28}: {v:.1f}" if isinstance(v, float) else f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
