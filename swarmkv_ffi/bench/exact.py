"""Exact mode vs the fast default: fidelity and cost, on the benchmark document.

For each mode (fast = our defaults, exact = batch-invariant kernels) the same workload runs
twice in this process: copy mode as the plain run (each branch alone in a fresh context
restored from the document's snapshot, one token per decode: bit-identical to the N-agent
baseline, tests/fanout/test_fanout.py, without its N prefills) and shared mode (one prefill, N
branches decoded together). Fidelity: for every branch, whether its tokens and the digest
of every row of logits equal the plain run's, and the first token where they do not. Cost: end-to-end, prefill and decode tokens/s of
shared mode in exact vs fast mode (ratios from one run, same machine, same minute).

    swarmkv bench exact --doc-tokens 3500 --n 16 --gen 64 --out bench/results/latest/exact.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..catalog import DEFAULT_MODEL, resolve
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from .measure import QUESTIONS, add_threads, decode_tps, document_of, report_json, settings_of


def first_difference(a: list[str], b: list[str]) -> int | None:
    """Index of the first differing digest (or the shorter length), None when equal."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def fidelity(shared, plain) -> dict:
    """How many shared-mode branches equal their plain run, and where the others part."""
    parted = {}
    for s, p in zip(shared.branches, plain.branches):
        k = first_difference(s.logit_digests, p.logit_digests)
        if k is not None or s.token_ids != p.token_ids:
            parted[s.index] = {"first_logits_diff_at": k, "same_tokens": s.token_ids == p.token_ids,
                               "first_token_diff_at": first_difference([str(t) for t in s.token_ids],
                                                                       [str(t) for t in p.token_ids])}
    return {"branches": len(shared.branches), "equal": len(shared.branches) - len(parted), "differ": parted}


def run_mode(model: Model, document: str, specs: list[BranchSpec], config: FanoutConfig) -> dict:
    plain = run_fanout(model, document, specs, config, mode="copy", trace_logits=True, cache=False)
    shared = run_fanout(model, document, specs, config, trace_logits=True, cache=False)
    return {
        "config": config.as_dict(),
        "n_prefix": shared.n_prefix,
        "shared_total_ms": shared.total_ms,
        "shared_prefill_ms": shared.prefill_ms,
        "shared_prefill_tps": shared.n_prefix / (shared.prefill_ms / 1e3),
        "shared_decode_tps": decode_tps(shared),
        "copy_total_ms": plain.total_ms,
        "fidelity": fidelity(shared, plain),
        "answers": [b.text for b in shared.branches],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench exact", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--doc-tokens", type=int, default=3500, help="document length in tokens (default 3500)")
    ap.add_argument("--n", type=int, default=16, help="branches (default 16)")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens per branch (default 64)")
    ap.add_argument("--kv-type", default=FanoutConfig.kv_type, help="KV cache type for both modes")
    add_threads(ap)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.n < 1 or args.gen < 1 or args.doc_tokens < 16:
        ap.error("--n and --gen must be >= 1, --doc-tokens >= 16")
    with Model(resolve(args.model)) as model:
        document = document_of(model, args.doc_tokens)
        specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.gen) for i in range(args.n)]
        report = {"model": model.path.name, "n": args.n, "gen": args.gen}
        for name, exact in (("fast", False), ("exact", True)):
            print(f"{name} mode: copy (the plain runs) and shared...", file=sys.stderr, flush=True)
            report[name] = run_mode(model, document, specs, FanoutConfig(kv_type=args.kv_type, exact=exact,
                                                                                 n_threads=args.threads))
    fast, exact = report["fast"], report["exact"]
    report["exact_vs_fast"] = {
        "end_to_end_slowdown": exact["shared_total_ms"] / fast["shared_total_ms"],
        "prefill_tps_ratio": exact["shared_prefill_tps"] / fast["shared_prefill_tps"],
        "decode_tps_ratio": exact["shared_decode_tps"] / fast["shared_decode_tps"],
    }
    shown = {k: report[k] for k in ("model", "n", "gen", "exact_vs_fast")}
    shown.update({f"{m}_fidelity": {"equal": report[m]["fidelity"]["equal"], "of": args.n,
                                    "differ": report[m]["fidelity"]["differ"]} for m in ("fast", "exact")})
    report_json(report, args.out, settings_of(args, FanoutConfig(kv_type=args.kv_type, n_threads=args.threads)),
                shown)
    return 0
