"""Our prefill and batched decode against llama.cpp's llama-bench and llama-batched-bench.

Same pinned source, same flags (`./build_llama.sh --tools`), same model, same threads, one
process run, one after another:
  prefill     llama-bench -p P (flash attention on and off, f16 KV; its best) vs our
              prefill of a P-token document in 512-token chunks (our defaults)
  decode      llama-batched-bench -npp P -ntg G -npl N -pps -kvu (the prompt shared by
              the N sequences in one unified KV cache, as in our fan-out) vs our shared
              mode's decode loop at N (tokens after each branch's first / time from
              the last first token to the last token; the whole generation phase with
              the branches' prompts is reported beside it)

    python bench/tools.py --tokens 1565 --n 16 --gen 32 --out bench/results/latest/tools.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .. import library
from ..catalog import DEFAULT_MODEL, resolve
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from .defaults import single_sequence
from .measure import QUESTIONS, cpu_name, decode_loop, decode_tps, document_of, report_json


def tool(name: str) -> Path:
    path = library.install_root(library.find_library()) / "tools" / name
    if not path.exists():
        raise SystemExit(f"{path} not found: build the peers with ./build_llama.sh --tools")
    return path


def run_json_lines(cmd: list[str]) -> list[dict]:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
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


def llama_bench_prefill(model: Path, p: int, threads: int) -> dict:
    rows = run_json_lines([str(tool("llama-bench")), "-m", str(model), "-p", str(p), "-n", "0", "-fa", "0,1",
                           "-ctk", "f16", "-ctv", "f16", "-t", str(threads), "-r", "3", "-o", "jsonl"])
    return {f"fa_{'on' if r['flash_attn'] else 'off'}": r["avg_ts"] for r in rows}


def batched_bench(model: Path, p: int, g: int, n: int, threads: int) -> dict:
    rows = run_json_lines([str(tool("llama-batched-bench")), "-m", str(model), "-c", str(p + n * (g + 8) + 64),
                           "-b", "512", "-ub", "512", "-npp", str(p), "-ntg", str(g), "-npl", str(n), "-pps", "-kvu",
                           "-fa", "on", "-t", str(threads), "--output-format", "jsonl"])
    return rows[-1]


def our_decode(model: Model, document: str, n: int, g: int, threads: int) -> dict:
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=g) for i in range(n)]
    res = run_fanout(model, document, specs, n_threads=threads, cache=False)
    return {"generated": sum(len(b.token_ids) for b in res.branches), "decode_tps": decode_tps(res),
            "decode_loop": decode_loop(res.branches), "total_ms": res.total_ms, "prefill_ms": res.prefill_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--tokens", type=int, default=1565, help="document / prompt length (default 1565)")
    ap.add_argument("--n", type=int, default=16, help="parallel sequences (default 16)")
    ap.add_argument("--gen", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    path = resolve(args.model)
    with Model(path) as model:
        document = document_of(model, args.tokens)
        tokens = model.tokenize(document)
        ours_pp = single_sequence(model, tokens, FanoutConfig.kv_type, FanoutConfig.flash_attn,
                                  args.threads)["pp_tps"]
        ours_tg = our_decode(model, document, args.n, args.gen, args.threads)
    peer_pp = llama_bench_prefill(path, len(tokens), args.threads)
    peer_tg = batched_bench(path, len(tokens), args.gen, args.n, args.threads)
    report = {
        "machine": cpu_name(), "model": path.name, "tokens": len(tokens), "n": args.n, "gen": args.gen,
        "threads": args.threads,
        "prefill_tps": {"ours": ours_pp, "llama_bench": peer_pp,
                        "ratio_vs_best": ours_pp / max(peer_pp.values())},
        # Like for like: batched-bench's tg phase is N-token decodes only, our decode loop
        # too. Our whole generation phase (branch prompts included) is reported beside it.
        "decode_tps": {"ours": ours_tg["decode_loop"]["tokens_per_s"],
                       "llama_batched_bench": peer_tg["speed_tg"],
                       "ratio": ours_tg["decode_loop"]["tokens_per_s"] / peer_tg["speed_tg"],
                       "ours_incl_prompts": ours_tg["decode_tps"],
                       "ours_generated": ours_tg["generated"], "expected": args.n * args.gen},
        "llama_batched_bench_row": peer_tg,
    }
    report_json(report, args.out, {k: report[k] for k in ("prefill_tps", "decode_tps")})
    return 0
