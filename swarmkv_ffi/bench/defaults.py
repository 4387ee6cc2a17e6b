"""Which KV type and flash-attention setting should be the default? Measure, per backend.

For each candidate (KV type x flash attention) on this machine, in one process:
  pp     prefill tokens/s of a --doc-tokens document in 512-token chunks (one sequence)
  tg     single-token decodes/s right after it (decode at depth)
  e2e    shared-mode fan-out end-to-end at each N in --n (32 greedy tokens, no cache)
The candidate with the lowest geometric mean of the fan-out end-to-end times is the one
the fan-out's job wants; the report says how much each other candidate loses.
q8_0 V needs flash attention in libllama, so (q8_0, off) is not a candidate.

    swarmkv bench defaults --doc-tokens 1600 --n 1,4,16 --out bench/results/latest/defaults.json
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from ..batch import Batch
from ..catalog import DEFAULT_MODEL, resolve
from ..context import Context, ContextParams
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from .measure import QUESTIONS, add_threads, document_of, report_json, settings_of

CANDIDATES = [("q8_0", "on"), ("f16", "on"), ("f16", "off")]


def single_sequence(model: Model, tokens, kv: str, fa: str, n_threads: int | None = None) -> dict:
    """Prefill tokens/s, then 16 single-token decodes/s at that depth."""
    params = ContextParams(n_ctx=len(tokens) + 64, n_batch=512, n_ubatch=512, flash_attn=fa,
                           type_k=kv, type_v=kv)
    if n_threads:
        params.n_threads = n_threads
    with Context(model, params) as ctx:
        t = time.perf_counter()
        ctx.decode_tokens(tokens, logits_last=False)
        pp = len(tokens) / (time.perf_counter() - t)
        step, t = Batch(1), time.perf_counter()
        for i in range(16):
            step.clear()
            step.add(int(tokens[i]), len(tokens) + i, (0,), logits=True)
            ctx.decode(step)
        tg = 16 / (time.perf_counter() - t)
    return {"pp_tps": pp, "tg_tps": tg}


def fanout_e2e(model: Model, document: str, n: int, kv: str, fa: str, n_threads: int | None = None) -> dict:
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=32) for i in range(n)]
    res = run_fanout(model, document, specs, FanoutConfig(kv_type=kv, flash_attn=fa, n_threads=n_threads),
                     cache=False)
    return {"total_ms": res.total_ms, "prefill_ms": res.prefill_ms,
            "answers": [b.text for b in res.branches]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench defaults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--doc-tokens", type=int, default=1600, help="document length in tokens (default 1600)")
    ap.add_argument("--n", default="1,4,16", help="fan-out sizes (default 1,4,16)")
    add_threads(ap)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.n.split(",")]
    with Model(resolve(args.model)) as model:
        document = document_of(model, args.doc_tokens)
        tokens = model.tokenize(document)
        rows = []
        for kv, fa in CANDIDATES:
            print(f"{kv} KV, flash attention {fa}...", file=sys.stderr, flush=True)
            row = {"kv_type": kv, "flash_attn": fa, **single_sequence(model, tokens, kv, fa, args.threads)}
            row["fanout"] = {str(n): fanout_e2e(model, document, n, kv, fa, args.threads) for n in ns}
            row["e2e_geomean_ms"] = math.exp(sum(math.log(f["total_ms"]) for f in row["fanout"].values()) / len(ns))
            rows.append(row)
    best = min(rows, key=lambda r: r["e2e_geomean_ms"])
    for r in rows:
        r["vs_best"] = r["e2e_geomean_ms"] / best["e2e_geomean_ms"]
    report = {"model": args.model, "doc_tokens": len(tokens), "n": ns,
              "best": {"kv_type": best["kv_type"], "flash_attn": best["flash_attn"]}, "candidates": rows}
    shown = {"best": report["best"], "candidates": [
        {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "fanout"}
        | {f"e2e_ms_n{n}": round(f["total_ms"]) for n, f in r["fanout"].items()} for r in rows]}
    report_json(report, args.out, settings_of(args, FanoutConfig(n_threads=args.threads)), shown)
    return 0
