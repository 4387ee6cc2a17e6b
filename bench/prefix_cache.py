#!/usr/bin/env python3
"""What the prefix cache saves: one process, one loaded model, a private cache folder.

    cold      first `swarmkv fanout` over the document (prefill + branches; fills the cache)
    warm      the same document again (restore + branches)
    extended  the document with ~10 % more text appended (restore the shared start,
              prefill the rest, branches)
    extended_cold  the extended document with the cache off (what it would cost without)

Answers are compared with a cache-off run of the same document. Model load is timed
apart from every run. Writes JSON with --out.

    .venv/bin/python bench/prefix_cache.py --tokens 3500 --out bench/results/X/prefix_cache.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from swarmkv_ffi import Model, catalog
from swarmkv_ffi.bench.measure import document_of, report_json
from swarmkv_ffi.fanout import BranchSpec, run_fanout
from swarmkv_ffi.prefix_cache import PrefixCache

QUESTIONS = ["What is this document about?", "Who may use it?", "What must be kept?", "What is excluded?"]


def run(model, document, specs, cache, label):
    t0 = time.perf_counter()
    res = run_fanout(model, document, specs, cache=cache)
    wall = (time.perf_counter() - t0) * 1e3
    print(f"{label:>14}: {wall:8.0f} ms end-to-end ({res.cached_tokens}/{res.n_prefix} tokens from the "
          f"cache, prefill {res.prefill_ms:.0f} ms, cache writes {res.cache_store_ms:.0f} ms)", file=sys.stderr)
    return {"end_to_end_ms": res.total_ms, "wall_ms": wall, "prefill_ms": res.prefill_ms,
            "cached_tokens": res.cached_tokens, "n_prefix": res.n_prefix,
            "cache_store_ms": res.cache_store_ms, "answers": [b.token_ids for b in res.branches]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=3500, help="document length in tokens (default 3500)")
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = Model(catalog.resolve(args.model))
    model.fingerprint
    load_ms = (time.perf_counter() - t0) * 1e3
    document = document_of(model, args.tokens)
    extended = document_of(model, int(args.tokens * 1.1))
    assert extended.startswith(document[: len(document) - 50])
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=args.max_tokens) for i in range(args.branches)]
    with tempfile.TemporaryDirectory(prefix="swarmkv-bench-cache-") as folder:
        cache = PrefixCache(folder)
        runs = {"cold": run(model, document, specs, cache, "cold"),
                "warm": run(model, document, specs, cache, "warm"),
                "extended": run(model, extended, specs, cache, "extended"),
                "extended_cold": run(model, extended, specs, False, "extended_cold"),
                "uncached": run(model, document, specs, False, "cache off")}
        cache_bytes = cache.total_bytes()
    report = {
        "model": args.model, "model_load_ms": load_ms, "document_tokens": runs["cold"]["n_prefix"],
        "extended_tokens": runs["extended"]["n_prefix"], "branches": args.branches,
        "max_tokens": args.max_tokens, "cache_bytes_after": cache_bytes,
        "warm_speedup": runs["cold"]["end_to_end_ms"] / runs["warm"]["end_to_end_ms"],
        "extended_speedup_vs_cold": runs["extended_cold"]["end_to_end_ms"] / runs["extended"]["end_to_end_ms"],
        "answers_equal_uncached": runs["warm"]["answers"] == runs["cold"]["answers"] == runs["uncached"]["answers"],
        "extended_answers_equal_uncached": runs["extended"]["answers"] == runs["extended_cold"]["answers"],
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "answers"} for k, v in runs.items()},
    }
    report_json(report, args.out, shown={k: v for k, v in report.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
