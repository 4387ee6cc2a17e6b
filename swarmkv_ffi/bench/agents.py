"""`swarmkv bench agents`: N agents of one model on lmxd against llama-server's N slots.

N agents each send one DECODE of --gen tokens (a story prompt each, greedy), all at once,
to a fresh lmxd (one agent per client connection), and the same N prompts go to
llama.cpp's own stock llama-server started with `-np N --kv-unified` (its N slots in one
KV cache: its way of serving N agents of one model), all at once and one after another.
Reported: wall time from the first request to the last reply, each side's mean reply
time, tokens generated, and what lmxd moved between agents (the DECODE replies'
kv_swap_evicted / kv_swap_restored). Today lmxd decodes one agent at a time and swaps
the others' KV out and in; this is the yardstick for batching them.

    swarmkv bench agents --n 8,16 --gen 32 --out bench/results/X/agents
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .. import catalog
from .daemon import start_lmxd, stop_lmxd
from .measure import at_once, report_json, settings_of
from .peer import Server, server_binary

ANIMALS = ["fox", "owl", "whale", "tiger", "crow", "otter", "moth", "bear",
           "heron", "lynx", "eel", "wolf", "hare", "seal", "wren", "toad"]


def prompts(n: int) -> list[str]:
    """N different one-line story openings."""
    return [f"Once upon a time, a {ANIMALS[i % len(ANIMALS)]} number {i + 1} found a map that"
            for i in range(n)]


def lmxd_run(args, texts: list[str]) -> dict:
    """Register N agents, then send their N DECODEs at once, one connection each."""
    from ..conductor.client import LmxClient
    tmp = Path(tempfile.mkdtemp(prefix="lmxd-agents-"))
    sock = tmp / "lmx.sock"
    proc = start_lmxd(sock, "--threads", str(args.threads), log=tmp / "lmxd.log")
    try:
        with LmxClient(str(sock)) as c:
            for i in range(len(texts)):
                c.register(f"a{i}", args.model, n_ctx=args.n_ctx)
        clients = [LmxClient(str(sock), timeout=3600) for _ in texts]

        def call(i):
            t = time.perf_counter()
            reply = clients[i].decode(f"a{i}", args.gen, texts[i])
            return {**reply["fields"], "text": reply.get("text", ""), "wall_ms": (time.perf_counter() - t) * 1e3}
        wall, replies = at_once([lambda i=i: call(i) for i in range(len(texts))])
        for c in clients:
            c.close()
    finally:
        stop_lmxd(proc)
    return {"total_ms": wall, "mean_reply_ms": statistics.mean(r["wall_ms"] for r in replies),
            "generated_tokens": sum(int(r.get("generated_tokens", 0)) for r in replies),
            "kv_swaps_evicted": sum(r.get("kv_swap_evicted", "-") not in ("-", "", None) for r in replies),
            "kv_swaps_restored": sum(str(r.get("kv_swap_restored", "false")).lower() == "true" for r in replies),
            "texts": [r["text"] for r in replies]}


def server_run(args, texts: list[str], concurrent: bool) -> dict:
    server = Server(args.server, args.model_path, args.threads,
                    ["-np", str(len(texts)), "--kv-unified", "-c", str(args.n_ctx * len(texts))])
    try:
        wall, replies = server.completions(texts, args.gen, concurrent)
    finally:
        server.close()
    return {"total_ms": wall, "mean_reply_ms": statistics.mean(r["wall_ms"] for r in replies),
            "generated_tokens": sum(r["timings"]["predicted_n"] for r in replies),
            "texts": [r["content"] for r in replies]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench agents", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a packaged short name (default: %(default)s)")
    ap.add_argument("--n", default="8,16", help="agents (default 8,16)")
    ap.add_argument("--gen", type=int, default=32, help="tokens per DECODE (default 32)")
    ap.add_argument("--n-ctx", type=int, default=256, help="context per agent / per server slot (default 256)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads, both sides")
    ap.add_argument("--server", type=Path, default=None,
                    help="llama-server binary (default: the stock one from ./build_llama.sh --tools)")
    ap.add_argument("--out", type=Path, default=None, help="folder for agents.json")
    args = ap.parse_args(argv)
    args.server = server_binary(args.server, "swarmkv bench agents")
    if args.server is None:
        return 2
    args.model_path = catalog.resolve(args.model)
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        texts = prompts(n)
        row = {"n": n, "gen": args.gen, "lmxd": lmxd_run(args, texts),
               "server_conc": server_run(args, texts, concurrent=True),
               "server_seq": server_run(args, texts, concurrent=False)}
        row["lmxd_vs_server_conc"] = row["lmxd"]["total_ms"] / row["server_conc"]["total_ms"]
        row["lmxd_vs_server_seq"] = row["lmxd"]["total_ms"] / row["server_seq"]["total_ms"]
        row["same_text_as_server"] = sum(a.strip() == b.strip() for a, b in
                                         zip(row["lmxd"]["texts"], row["server_conc"]["texts"]))
        print(f"N={n:>2} x {args.gen}: lmxd {row['lmxd']['total_ms'] / 1e3:.2f} s "
              f"({row['lmxd']['kv_swaps_evicted']} swaps out), llama-server at once "
              f"{row['server_conc']['total_ms'] / 1e3:.2f} s, one after another "
              f"{row['server_seq']['total_ms'] / 1e3:.2f} s | lmxd / server at once "
              f"{row['lmxd_vs_server_conc']:.2f}x", file=sys.stderr, flush=True)
        rows.append(row)
    report = {"benchmark": "agents", "model": args.model,
              "server_flags": f"-np N --kv-unified -c {args.n_ctx}*N -t {args.threads} (its defaults otherwise)",
              "rows": rows}
    report_json(report, args.out / "agents.json" if args.out else None, settings_of(args),
                shown={"rows": [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
