"""What the prefix cache saves: one process, one loaded model, a private cache folder.

    cold      first `swarmkv fanout` over the document (prefill + branches; fills the cache)
    warm      the same document again (restore + branches)
    extended  the document with ~10 % more text appended (restore the shared start,
              prefill the rest, branches)
    extended_cold  the extended document with the cache off (what it would cost without)

Answers are compared with a cache-off run of the same document. Model load is timed
apart from every run. Writes JSON with --out.

    swarmkv bench prefix-cache --tokens 3500 --out bench/results/X/prefix_cache.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .. import catalog
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from ..kvcache.files import PrefixCache
from .measure import add_threads, document_of, report_json, settings_of

QUESTIONS = ["What is this document about?", "Who may use it?", "What must be kept?", "What is excluded?"]


def run(model, document, specs, config, cache, label):
    t0 = time.perf_counter()
    res = run_fanout(model, document, specs, config, cache=cache)
    wall = (time.perf_counter() - t0) * 1e3
    print(f"{label:>14}: {wall:8.0f} ms end-to-end ({res.cached_tokens}/{res.n_prefix} tokens from the "
          f"cache, prefill {res.prefill_ms:.0f} ms, cache writes {res.cache_store_ms:.0f} ms)", file=sys.stderr)
    return {"end_to_end_ms": res.total_ms, "wall_ms": wall, "prefill_ms": res.prefill_ms,
            "cached_tokens": res.cached_tokens, "n_prefix": res.n_prefix,
            "cache_store_ms": res.cache_store_ms, "answers": [b.token_ids for b in res.branches]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench prefix-cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=3500, help="document length in tokens (default 3500)")
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    add_threads(ap)
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args(argv)
    config = FanoutConfig(n_threads=args.threads)

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
        runs = {"cold": run(model, document, specs, config, cache, "cold"),
                "warm": run(model, document, specs, config, cache, "warm"),
                "extended": run(model, extended, specs, config, cache, "extended"),
                "extended_cold": run(model, extended, specs, config, False, "extended_cold"),
                "uncached": run(model, document, specs, config, False, "cache off")}
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
    report_json(report, args.out, settings_of(args, config), shown={k: v for k, v in report.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
