"""Past one machine, measured on a simulated Ray cluster (ray.cluster_utils, every node on
127.0.0.1, each with its own raylet and object store).

serve: D documents x N agents, all at once, against `swarmkv serve --ray` with R replicas
routed by prefix (Ray's PrefixCacheAffinityRouter) and by load alone (Serve's default
router), alternated --repeat times: the wall time, how many times each document was
prefilled (a reply with fewer cached tokens than the document prefilled it) and on which
replicas each document was answered.

fanout: run_fanout_ray with --actors actors on one node of that many CPUs, then on that
many nodes of one CPU each: the time, which node answered which branches and the
snapshot bytes each node pulled.

    swarmkv bench cluster --docs 4 --agents 8 --replicas 2 --repeat 3 --out bench/results/X/cluster
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from .. import catalog
from .measure import at_once, document_of, report_json, settings_of

QUESTIONS = ["Who may use the work?", "Is there a warranty?", "What is a Contribution?", "Can I sell copies?",
             "Who is a Contributor?", "What is a Derivative Work?", "Are trademarks granted?",
             "When does the patent license end?"]


class SimulatedCluster:
    """`nodes` Ray nodes of `cpus` CPUs on this machine, 127.0.0.1 only; the driver joined."""

    def __init__(self, nodes: int, cpus: int):
        import ray
        from ray.cluster_utils import Cluster

        from ..distributed import connect, loopback_only
        loopback_only()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": cpus, "node_ip_address": "127.0.0.1", "include_dashboard": False})
        for _ in range(nodes - 1):
            self.cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1")
        connect(self.cluster.address)
        self.ray = ray

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ray.shutdown()
        self.cluster.shutdown()


def serve_side(args, address: str, route: str, docs: list[str]) -> dict:
    """One run: a fresh `swarmkv serve --ray` routed by `route`, every agent at once."""
    from .peer import HttpServer
    from .servers import client_of
    command = lambda port: [sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--ray", address,  # noqa: E731
                            "--port", str(port), "--replicas", str(args.replicas), "--threads", "1",
                            "--route", route, "--model", args.model, "--ctx-size", str(args.ctx_size),
                            "--parallel", "64"]
    with HttpServer(command, f"swarmkv serve --ray --route {route}") as server:
        client = client_of(server, args.model)
        jobs = [(d, QUESTIONS[a % len(QUESTIONS)]) for a in range(args.agents) for d in range(len(docs))]

        def ask(d: int, question: str):
            raw = client.chat.completions.with_raw_response.create(
                model=args.model, max_tokens=args.gen, temperature=0,
                messages=[{"role": "system", "content": docs[d]}, {"role": "user", "content": question}])
            return d, raw.parse(), raw.headers.get("x-swarmkv-replica")
        ms, replies = at_once([lambda job=job: ask(*job) for job in jobs])
    n_doc = min(r.usage.prompt_tokens for _, r, _ in replies) - 40
    per_doc = []
    for d in range(len(docs)):
        mine = [(r, replica) for dd, r, replica in replies if dd == d]
        per_doc.append({"prefills": sum(r.usage.prompt_tokens_details.cached_tokens < n_doc for r, _ in mine),
                        "replicas": len({replica for _, replica in mine})})
    return {"route": route, "total_s": ms / 1e3, "documents": per_doc,
            "prefills": sum(d["prefills"] for d in per_doc)}


def serve_rows(args) -> dict:
    from ..model import Model
    with Model(catalog.resolve(args.model)) as model:
        base = document_of(model, args.doc_tokens)
    docs = [f"Document {d + 1} of {args.docs}.\n{base}" for d in range(args.docs)]
    runs = {"prefix": [], "load": []}
    with SimulatedCluster(args.replicas, 1) as cluster:
        for _ in range(args.repeat):
            for route in ("prefix", "load"):                  # alternated: drift hits both alike
                runs[route].append(serve_side(args, cluster.cluster.address, route, docs))
                print(f"  {route}: {runs[route][-1]['total_s']:.1f} s, "
                      f"{runs[route][-1]['prefills']} prefills", file=sys.stderr, flush=True)
    median = {route: statistics.median(r["total_s"] for r in rs) for route, rs in runs.items()}
    return {"scenario": f"{args.docs} documents x {args.agents} agents at once, {args.replicas} replicas",
            "prefix_s": median["prefix"], "load_s": median["load"], "speedup": median["load"] / median["prefix"],
            "prefills_prefix": [r["prefills"] for r in runs["prefix"]],
            "prefills_load": [r["prefills"] for r in runs["load"]], "runs": runs}


def fanout_rows(args) -> list[dict]:
    from ..distributed import run_fanout_ray
    from ..fanout import BranchSpec
    from ..model import Model
    path = str(catalog.resolve(args.model))
    with Model(path) as model:
        doc = document_of(model, args.doc_tokens)
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.gen) for i in range(args.branches)]
    rows = []
    for nodes, cpus in ((1, args.actors), (args.actors, 1)):
        with SimulatedCluster(nodes, cpus):
            t0 = time.perf_counter()
            out = run_fanout_ray(path, doc, specs, n_actors=args.actors, exact=True)
            rows.append({"nodes": nodes, "cpus_per_node": cpus, "actors": args.actors, "total_s": time.perf_counter() - t0,
                         "snapshot_bytes": out.snapshot_bytes, "retries": out.extras["retries"],
                         "per_node": [{"branches": e["branches"], "snapshot_bytes_pulled": e["snapshot_bytes_pulled"]}
                                      for e in out.extras["nodes"].values()]})
            print(f"  fanout on {nodes} node(s): {rows[-1]['total_s']:.1f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        print("swarmkv bench cluster: Ray Serve is not installed: pip install 'swarmkv-ffi[distributed]'",
              file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="swarmkv bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a packaged short name (default: %(default)s)")
    ap.add_argument("--docs", type=int, default=4, help="documents in serve (default 4)")
    ap.add_argument("--agents", type=int, default=8, help="agents per document in serve (default 8)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas in serve, one node each (default 2)")
    ap.add_argument("--doc-tokens", type=int, default=1600, help="each document's length (default 1600)")
    ap.add_argument("--gen", type=int, default=16, help="max_tokens of every request and branch (default 16)")
    ap.add_argument("--branches", type=int, default=6, help="branches in fanout (default 6)")
    ap.add_argument("--actors", type=int, default=3, help="actors (and nodes) in fanout (default 3)")
    ap.add_argument("--repeat", type=int, default=1, help="alternated runs of each router; medians (default 1)")
    ap.add_argument("--scenarios", default="serve,fanout", help="which to run (default: serve,fanout)")
    ap.add_argument("--out", type=Path, default=None, help="folder for cluster.json")
    args = ap.parse_args(argv)
    args.ctx_size = max(4096, (args.doc_tokens + 64 + args.gen) * (args.docs + 2))
    wanted = set(args.scenarios.split(","))
    if wanted - {"serve", "fanout"}:
        ap.error(f"unknown scenarios: {', '.join(sorted(wanted - {'serve', 'fanout'}))}")
    report = {"benchmark": "cluster", "model": args.model,
              "cluster": "ray.cluster_utils.Cluster on this machine, every node on 127.0.0.1"}
    if "serve" in wanted:
        report["serve"] = serve_rows(args)
    if "fanout" in wanted:
        report["fanout"] = fanout_rows(args)
    shown = {k: v for k, v in report.items() if k != "serve"}
    if "serve" in report:
        shown["serve"] = {k: v for k, v in report["serve"].items() if k != "runs"}
    report_json(report, args.out / "cluster.json" if args.out else None, settings_of(args), shown=shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
