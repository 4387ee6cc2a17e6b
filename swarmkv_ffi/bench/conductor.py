"""Conductor benchmark: what a KV swap costs, and how fast STATUS stays under load.

    swap       an agent with H tokens of history: evict (snapshot to host RAM, free the
               context) + restore (new context, set state), against rebuilding the same
               KV by re-prefilling the history in a new context; H in --histories.
    status     a real lmxd on a temporary socket; --clients concurrent clients send
               STATUS in a loop while other clients run DECODEs; p50/p95/p99 latency.

Writes conductor.json into --out and prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..catalog import DEFAULT_MODEL, resolve
from ..context import Context
from ..model import Model
from ..snapshot import Snapshot
from .daemon import start_lmxd, stop_lmxd
from .measure import cpu_name, document_of, settings_of, write_result


def ms_since(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e6


def swap_vs_prefill(model: Model, history: int, repeats: int) -> dict:
    tokens = model.tokenize(document_of(model, history))[:history]
    n_ctx = max(512, -(-(history + 64) // 256) * 256)
    params = dict(n_ctx=n_ctx, n_batch=512, flash_attn="on")
    evict, restore, prefill = [], [], []
    model.fingerprint  # hashed once per model (the daemon does it at load), not per swap
    ctx = Context(model, **params)
    ctx.decode_tokens(tokens, logits_last=False)
    for _ in range(repeats):
        t = time.perf_counter_ns()
        snap = Snapshot.capture(ctx, 0, tokens)
        ctx.close()
        evict.append(ms_since(t))
        t = time.perf_counter_ns()
        ctx = Context(model, **params)
        snap.restore(ctx, 0)
        restore.append(ms_since(t))
        t = time.perf_counter_ns()
        with Context(model, **params) as fresh:
            fresh.decode_tokens(tokens, logits_last=False)
        prefill.append(ms_since(t))
    ctx.close()
    swap = [e + r for e, r in zip(evict, restore)]
    return {"history_tokens": len(tokens), "snapshot_bytes": snap.nbytes,
            "evict_ms": min(evict), "restore_ms": min(restore), "swap_ms": min(swap),
            "reprefill_ms": min(prefill), "swap_speedup": min(prefill) / min(swap), "repeats": repeats}


def status_latency(model_name: str, clients: int, seconds: float, decoders: int) -> dict:
    from ..lmxd.client import LmxClient
    tmp = Path(tempfile.mkdtemp(prefix="lmxd-bench-"))
    sock = tmp / "lmx.sock"
    proc = start_lmxd(sock)
    try:
        with LmxClient(str(sock)) as c:
            for k in range(decoders):
                c.register(f"d{k}", model_name, n_ctx=1024)
        stop = threading.Event()
        latencies: list[float] = []
        decodes = [0]
        lock = threading.Lock()

        def decoder(k):
            with LmxClient(str(sock)) as c:
                while not stop.is_set():
                    c.decode(f"d{k}", 16, "Tell me about foxes.")
                    c.reset(f"d{k}")
                    with lock:
                        decodes[0] += 1

        def poller():
            mine = []
            with LmxClient(str(sock)) as c:
                while not stop.is_set():
                    t = time.perf_counter_ns()
                    c.status()
                    mine.append(ms_since(t))
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=decoder, args=(k,)) for k in range(decoders)]
        threads += [threading.Thread(target=poller) for _ in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        stop_lmxd(proc)
    q = np.percentile(latencies, [50, 95, 99]) if latencies else [float("nan")] * 3
    return {"clients": clients, "decoders": decoders, "seconds": seconds, "requests": len(latencies),
            "decodes_completed": decodes[0], "p50_ms": float(q[0]), "p95_ms": float(q[1]),
            "p99_ms": float(q[2]), "mean_ms": statistics.fmean(latencies) if latencies else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarmkv bench conductor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--histories", default="512,2048", help="history lengths for the swap measure")
    p.add_argument("--repeats", type=int, default=3, help="repeats per history (best kept)")
    p.add_argument("--clients", type=int, default=32, help="concurrent STATUS clients")
    p.add_argument("--decoders", type=int, default=2, help="clients running DECODEs meanwhile")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the STATUS measure")
    p.add_argument("--out", default=None, help="output folder (default: bench/results/<cpu>-<date>)")
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/results/{cpu_name()}-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    with Model(resolve(args.model)) as model:
        swaps = [swap_vs_prefill(model, int(h), args.repeats) for h in args.histories.split(",")]
    status = status_latency(args.model, args.clients, args.seconds, args.decoders)
    report = {"command": " ".join(["swarmkv bench conductor"] + (sys.argv[1:] if argv is None else argv)),
              "model": args.model, "swap": swaps, "status": status, "target_swap_speedup_at_2k": 10.0}
    write_result(out / "conductor.json", report, settings_of(args))
    print(f"{'history':>8} {'snapshot MiB':>13} {'evict ms':>9} {'restore ms':>11} {'swap ms':>8} "
          f"{'re-prefill ms':>14} {'swap is':>8}")
    for s in swaps:
        print(f"{s['history_tokens']:8} {s['snapshot_bytes'] / 2**20:13.1f} {s['evict_ms']:9.1f} "
              f"{s['restore_ms']:11.1f} {s['swap_ms']:8.1f} {s['reprefill_ms']:14.1f} {s['swap_speedup']:7.1f}x")
    print(f"STATUS with {status['clients']} clients and {status['decoders']} decoding: "
          f"p50 {status['p50_ms']:.2f} ms, p95 {status['p95_ms']:.2f} ms, p99 {status['p99_ms']:.2f} ms "
          f"({status['requests']} requests, {status['decodes_completed']} decodes)")
    print(f"wrote {out}/conductor.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
