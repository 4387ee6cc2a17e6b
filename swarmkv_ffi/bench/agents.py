"""`swarmkv bench agents`: N agents of one model on lmxd against llama-server's N slots.

N agents each send one DECODE of --gen tokens (a story prompt each, greedy), all at once,
to a fresh lmxd (one agent per client connection), and the same N prompts go to
llama.cpp's own stock llama-server started with `-np N --kv-unified` (its N slots in one
KV cache: its way of serving N agents of one model), all at once and one after another.
Reported: wall time from the first request to the last reply, each side's mean reply
time, tokens generated, and what lmxd moved between agents (the DECODE replies'
kv_swap_evicted / kv_swap_restored) and the largest batch a DECODE was stepped in. This
machine's timings drift by 10-15 % between runs: --repeat R alternates R runs of each
side and reports the medians.

--mixed A,B adds a row with agents of two models (--mixed-agents of each) sending
--mixed-rounds rounds of DECODEs at once, interleaved: lmxd's pools must switch between
the models, and every swap must be between models (none within one).

    swarmkv bench agents --n 8,16 --gen 32 --mixed smollm2-135m,gemma3-270m --out bench/results/X/agents
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


def lmxd_run(args, texts: list[str], models: list[str] | None = None, rounds: int = 1) -> dict:
    """Register an agent per text (agent i of models[i], default --model), then send
    their DECODEs at once, one connection each, `rounds` times."""
    from ..lmxd.client import LmxClient
    models = models or [args.model] * len(texts)
    tmp = Path(tempfile.mkdtemp(prefix="lmxd-agents-"))
    sock = tmp / "lmx.sock"
    proc = start_lmxd(sock, "--threads", str(args.threads), log=tmp / "lmxd.log")
    try:
        with LmxClient(str(sock)) as c:
            for i, model in enumerate(models):
                c.register(f"a{i}", model, n_ctx=args.n_ctx)
        clients = [LmxClient(str(sock), timeout=3600) for _ in texts]

        def call(i, text):
            t = time.perf_counter()
            reply = clients[i].decode(f"a{i}", args.gen, text)
            return {**reply["fields"], "text": reply.get("text", ""), "wall_ms": (time.perf_counter() - t) * 1e3}
        walls, replies = [], []
        for r in range(rounds):
            wall, got = at_once([lambda i=i: call(i, texts[i] if r == 0 else " Then") for i in range(len(texts))])
            walls.append(wall)
            replies += got
        for c in clients:
            c.close()
    finally:
        stop_lmxd(proc)
    model_of = {f"a{i}": m for i, m in enumerate(models)}
    evicted = [(model_of[r["agent_id"]], model_of.get(r.get("kv_swap_evicted"))) for r in replies
               if r.get("kv_swap_evicted", "-") not in ("-", "", None)]
    return {"total_ms": sum(walls), "round_ms": walls,
            "mean_reply_ms": statistics.mean(r["wall_ms"] for r in replies),
            "generated_tokens": sum(int(r.get("generated_tokens", 0)) for r in replies),
            "kv_swaps_evicted": len(evicted),
            "kv_swaps_within_a_model": sum(a == b for a, b in evicted),
            "kv_swaps_restored": sum(str(r.get("kv_swap_restored", "false")).lower() == "true" for r in replies),
            "batch_max": max(int(r.get("batch", 0)) for r in replies),
            "swap_ms": sum(float(r.get("swap_ms", 0)) for r in replies),
            "texts": [r["text"] for r in replies]}


def median_run(got: list[dict]) -> dict:
    """The run of median total time, with every run's total beside it."""
    chosen = sorted(got, key=lambda r: r["total_ms"])[len(got) // 2]
    return {**chosen, "total_ms_runs": [r["total_ms"] for r in got]}


def mixed_row(args) -> dict:
    """Agents of two models, interleaved (agent i of model i % 2), DECODEs at once."""
    names = args.mixed.split(",")
    models = [names[i % len(names)] for i in range(args.mixed_agents * len(names))]
    row = {"models": names, "agents_per_model": args.mixed_agents, "rounds": args.mixed_rounds,
           "gen": args.gen, "lmxd": lmxd_run(args, prompts(len(models)), models, args.mixed_rounds)}
    m = row["lmxd"]
    print(f"mixed {'+'.join(names)}, {args.mixed_agents} agents each, {args.mixed_rounds} rounds x {args.gen}: "
          f"lmxd {m['total_ms'] / 1e3:.2f} s, {m['kv_swaps_evicted']} swaps out "
          f"({m['kv_swaps_within_a_model']} within a model), largest batch {m['batch_max']}",
          file=sys.stderr, flush=True)
    return row


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
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each side per N, alternated; the median is reported (default 1)")
    ap.add_argument("--mixed", default=None, metavar="A,B",
                    help="also run agents of these two packaged models interleaved (lmxd only)")
    ap.add_argument("--mixed-agents", type=int, default=4, help="agents of each model in --mixed (default 4)")
    ap.add_argument("--mixed-rounds", type=int, default=2, help="rounds of DECODEs in --mixed (default 2)")
    ap.add_argument("--out", type=Path, default=None, help="folder for agents.json")
    args = ap.parse_args(argv)
    args.server = server_binary(args.server, "swarmkv bench agents")
    if args.server is None:
        return 2
    args.model_path = catalog.resolve(args.model)
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        texts = prompts(n)
        runs = {"lmxd": [], "server_conc": [], "server_seq": []}
        for _ in range(args.repeat):          # alternated, so drift on the machine hits all three
            runs["lmxd"].append(lmxd_run(args, texts))
            runs["server_conc"].append(server_run(args, texts, concurrent=True))
            runs["server_seq"].append(server_run(args, texts, concurrent=False))
        row = {"n": n, "gen": args.gen, **{side: median_run(got) for side, got in runs.items()}}
        row["lmxd_vs_server_conc"] = row["lmxd"]["total_ms"] / row["server_conc"]["total_ms"]
        row["lmxd_vs_server_seq"] = row["lmxd"]["total_ms"] / row["server_seq"]["total_ms"]
        row["same_text_as_server"] = sum(a.strip() == b.strip() for a, b in
                                         zip(row["lmxd"]["texts"], row["server_conc"]["texts"]))
        print(f"N={n:>2} x {args.gen}: lmxd {row['lmxd']['total_ms'] / 1e3:.2f} s "
              f"({row['lmxd']['kv_swaps_evicted']} swaps out, largest batch {row['lmxd']['batch_max']}), "
              f"llama-server at once "
              f"{row['server_conc']['total_ms'] / 1e3:.2f} s, one after another "
              f"{row['server_seq']['total_ms'] / 1e3:.2f} s | lmxd / server at once "
              f"{row['lmxd_vs_server_conc']:.2f}x", file=sys.stderr, flush=True)
        rows.append(row)
    mixed = mixed_row(args) if args.mixed else None
    report = {"benchmark": "agents", "model": args.model,
              "server_flags": f"-np N --kv-unified -c {args.n_ctx}*N -t {args.threads} (its defaults otherwise)",
              "rows": rows, "mixed": mixed}
    shown = {"rows": [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]}
    if mixed:
        shown["mixed"] = {k: v for k, v in mixed["lmxd"].items() if k != "texts"}
    report_json(report, args.out / "agents.json" if args.out else None, settings_of(args), shown=shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
