"""Our prefill and batched decode against llama.cpp's llama-bench and llama-batched-bench.

Same pinned source, same flags (`./build_llama.sh --tools`), same model, same threads, one
process run, after a warm-up; ours are medians of --repeats runs:
  prefill     llama-bench -p P (flash attention on and off, f16 KV; its best) vs our
              prefill of a P-token document in 512-token chunks (our defaults)
  decode      llama-batched-bench -npp P -ntg G -npl N -pps -kvu (the prompt shared by
              the N sequences in one unified KV cache, as in our fan-out) vs
                full batch   shared mode's steps that decode all N branches (N tokens per
                             step, like every batched-bench tg step), tokens/s
                loop         every step after the branches' prompts (fewer tokens per
                             step once some branches have stopped at end-of-generation)
                with prompts the whole generation phase, the branches' prompts included
                binding      batched-bench's own loop (N sequences, one token each per
                             step, no sampling) written against our binding: what our
                             cffi layer costs, with nothing of the fan-out around it

    swarmkv bench tools --tokens 1565 --n 16 --gen 32 --out bench/results/latest/tools.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .. import library
from ..batch import Batch
from ..catalog import DEFAULT_MODEL, resolve
from ..context import Context, ContextParams
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..fanout.shared import together
from ..model import Model
from .defaults import single_sequence
from .measure import QUESTIONS, decode_loop, decode_tps, document_of, report_json, settings_of


def tool(name: str) -> Path:
    path = library.tool_path(name)
    if not path.exists():
        raise SystemExit(f"{path} not found: build the peers with ./build_llama.sh --tools")
    return path


def run_json_lines(cmd: list[str], env: dict | None = None) -> list[dict]:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = []  # llama-bench prints its rows on stdout, llama-batched-bench through its log (stderr)
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"{cmd[0]} printed no JSON rows: {out.stderr[-2000:]}")
    return rows


def llama_bench_prefill(model: Path, p: int, threads: int, repeats: int) -> dict:
    rows = run_json_lines([str(tool("llama-bench")), "-m", str(model), "-p", str(p), "-n", "0", "-fa", "0,1",
                           "-ctk", "f16", "-ctv", "f16", "-t", str(threads), "-r", str(repeats), "-o", "jsonl"])
    return {f"fa_{'on' if r['flash_attn'] else 'off'}": r["avg_ts"] for r in rows}


def batched_bench(model: Path, p: int, g: int, n: int, threads: int) -> dict:
    rows = run_json_lines([str(tool("llama-batched-bench")), "-m", str(model), "-c", str(p + n * (g + 8) + 64),
                           "-b", "512", "-ub", "512", "-npp", str(p), "-ntg", str(g), "-npl", str(n), "-pps", "-kvu",
                           "-fa", "on", "-t", str(threads), "--output-format", "jsonl"])
    return rows[-1]


def our_decode(model: Model, document: str, n: int, g: int, threads: int) -> dict:
    """One shared-mode fan-out, with each step's decode timed through the schedule hook."""
    steps: list[tuple[float, int, bool]] = []   # (start, branches, with a prefill chunk)

    def timed(chunk, branches):
        steps.append((time.perf_counter(), len(branches), chunk is not None))
        return together(chunk, branches)

    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=g) for i in range(n)]
    res = run_fanout(model, document, specs, n_threads=threads, cache=False, schedule=timed)
    steps.append((time.perf_counter(), 0, False))
    # Steps of N single tokens: all N branches live, no prefill chunk, not their prompt step.
    full = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[1] == n and not a[2]][1:]
    return {"generated": sum(len(b.token_ids) for b in res.branches),
            "full_batch_tps": n * len(full) / sum(full) if full else 0.0, "full_batch_steps": len(full),
            "loop_tps": decode_loop(res.branches)["tokens_per_s"], "incl_prompts_tps": decode_tps(res)}


def binding_loop(model: Model, tokens, n: int, g: int, threads: int) -> float:
    """llama-batched-bench's tg loop through our binding: the prompt once in sequence 0,
    copied to 1..n-1, then g steps of one token per sequence with logits. Tokens/s."""
    params = ContextParams(n_ctx=len(tokens) + n * g + 64, n_batch=512, n_ubatch=512, n_seq_max=n,
                           kv_unified=True, flash_attn="on", n_threads=threads)
    with Context(model, params) as ctx:
        ctx.decode_tokens(tokens, logits_last=False)
        for i in range(1, n):
            ctx.seq_cp(0, i)
        step, t = Batch(n), time.perf_counter()
        for k in range(g):
            step.clear()
            for i in range(n):
                step.add(0, len(tokens) + k, (i,), logits=True)
            ctx.decode(step)
        return n * g / (time.perf_counter() - t)


def ours(model: Model, document: str, args) -> dict:
    """Medians over --repeats of our prefill, fan-out decode and binding loop."""
    tokens = model.tokenize(document)
    single_sequence(model, tokens[:512], FanoutConfig.kv_type, FanoutConfig.flash_attn, args.threads)  # warm-up
    pp, runs, loops = [], [], []
    for r in range(args.repeats):
        print(f"ours: repeat {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
        pp.append(single_sequence(model, tokens, FanoutConfig.kv_type, FanoutConfig.flash_attn,
                                  args.threads)["pp_tps"])
        runs.append(our_decode(model, document, args.n, args.gen, args.threads))
        loops.append(binding_loop(model, tokens, args.n, args.gen, args.threads))
    tg = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"tokens": len(tokens), "pp_tps": statistics.median(pp), "pp_runs": pp,
            "tg": tg, "tg_runs": runs, "binding_tps": statistics.median(loops), "binding_runs": loops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench tools", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--tokens", type=int, default=1565, help="document / prompt length (default 1565)")
    ap.add_argument("--n", type=int, default=16, help="parallel sequences (default 16)")
    ap.add_argument("--gen", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; medians reported (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    path = resolve(args.model)
    with Model(path) as model:
        mine = ours(model, document_of(model, args.tokens), args)
    peer_pp = llama_bench_prefill(path, mine["tokens"], args.threads, args.repeats)
    peer_runs = [batched_bench(path, mine["tokens"], args.gen, args.n, args.threads) for _ in range(args.repeats)]
    peer_tg = statistics.median(r["speed_tg"] for r in peer_runs)
    tg = mine["tg"]
    report = {
        "model": path.name, "tokens": mine["tokens"],
        "prefill_tps": {"ours": mine["pp_tps"], "ours_runs": mine["pp_runs"], "llama_bench": peer_pp,
                        "ratio_vs_best": mine["pp_tps"] / max(peer_pp.values())},
        # Like for like: every batched-bench tg step decodes N tokens; so do our full-batch steps.
        "decode_tps": {"ours_full_batch": tg["full_batch_tps"], "llama_batched_bench": peer_tg,
                       "ratio": tg["full_batch_tps"] / peer_tg,
                       "ours_loop": tg["loop_tps"], "ours_incl_prompts": tg["incl_prompts_tps"],
                       "ours_binding_loop": mine["binding_tps"],
                       "binding_ratio": mine["binding_tps"] / peer_tg,
                       "ours_generated": tg["generated"], "expected": args.n * args.gen},
        "ours_decode_runs": mine["tg_runs"], "ours_binding_runs": mine["binding_runs"],
        "llama_batched_bench_rows": peer_runs,
    }
    report_json(report, args.out, settings_of(args, FanoutConfig(n_threads=args.threads)), {k: report[k] for k in ("prefill_tps", "decode_tps")})
    return 0
