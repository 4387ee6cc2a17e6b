"""gpu_check.sh's fan-out step: one model, one document, shared and copy mode at each N.

    python bench/gpu_fanout.py MODEL.gguf OUT.json [--ns 1,4,16] [--doc-tokens 1000] [--max-tokens 32]
    python bench/gpu_fanout.py MODEL.gguf OUT.json --exact [--ns 4]

Fast mode (the default) times shared and copy mode at every N with whatever backend
libllama has (the GPU in a CUDA build). --exact runs exact shared and exact copy mode and
checks that every branch's tokens are equal, which exact mode guarantees; it needs the
CPU backend (run it with CUDA_VISIBLE_DEVICES= on a CUDA build). The JSON records the
settings, the build, the backend's devices and each run's timings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def run(model, doc: str, n: int, mode: str, max_tokens: int, exact: bool) -> dict:
    from swarmkv_ffi.bench.measure import QUESTIONS
    from swarmkv_ffi.fanout import BranchSpec, run_fanout
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens) for i in range(n)]
    res = run_fanout(model, doc, specs, mode=mode, exact=exact, cache=False, chat=False)
    tokens = sum(len(b.token_ids) for b in res.branches)
    decode_ms = max(b.decode_ms for b in res.branches)
    return {"mode": mode, "n": n, "exact": exact, "prefill_ms": res.prefill_ms, "total_ms": res.total_ms,
            "n_prefix": res.n_prefix, "generated_tokens": tokens, "decode_ms_longest_branch": decode_ms,
            "token_ids": [b.token_ids for b in res.branches]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_fanout.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ns", default="1,4,16", help="branch counts (default 1,4,16)")
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--exact", action="store_true", help="exact shared vs exact copy, tokens compared")
    args = ap.parse_args(argv)
    from swarmkv_ffi.bench.measure import document_of, settings_of, write_result
    from swarmkv_ffi.model import Model
    t0 = time.perf_counter()
    model = Model(args.model)
    doc = document_of(model, args.doc_tokens)
    ns = [int(x) for x in args.ns.split(",")]
    runs = [run(model, doc, n, mode, args.max_tokens, args.exact) for n in ns for mode in ("shared", "copy")]
    report = {"step": "fanout_exact" if args.exact else "fanout", "model": str(args.model), "runs": runs,
              "seconds": time.perf_counter() - t0}
    if args.exact:
        pairs = [(r, c) for r in runs for c in runs if r["mode"] == "shared" and c["mode"] == "copy"
                 and r["n"] == c["n"]]
        report["exact_shared_equals_copy"] = all(r["token_ids"] == c["token_ids"] for r, c in pairs)
    write_result(args.out, report, settings_of(args))
    for r in runs:
        print(f"{r['mode']:>6} N={r['n']:>2} prefill {r['prefill_ms']:8.1f} ms  total {r['total_ms']:8.1f} ms")
    if args.exact and not report["exact_shared_equals_copy"]:
        print("gpu_fanout: exact shared and exact copy differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
