"""Prefill and decode speed of two libllama builds on this machine, e.g. the native build
against `./build_llama.sh --portable --prefix /tmp/libllama-portable`.

Each measurement runs in a child process (a process loads one libllama), A and B
alternate, and the ratio of medians is reported, so machine noise hits both alike.

    swarmkv bench builds --a libllama --b /tmp/libllama-portable --out bench/results/X/builds.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .measure import report_json, settings_of

CHILD = r"""
import json, sys, time
from swarmkv_ffi import Model, catalog, library
from swarmkv_ffi.bench.measure import document_of
from swarmkv_ffi.context import Context
n_prompt, n_gen, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
with Model(catalog.resolve("smollm2-135m")) as model:
    tokens = model.tokenize(document_of(model, n_prompt), add_special=True)[:n_prompt]
    with Context(model, n_ctx=n_prompt + n_gen + 16, n_batch=512, n_threads=threads) as ctx:
        t0 = time.perf_counter()
        row = ctx.decode_tokens(tokens)
        t1 = time.perf_counter()
        token = int(ctx.logits(row).argmax())
        for i in range(n_gen):
            ctx.decode_tokens([token], pos0=len(tokens) + i)
            token = int(ctx.logits(-1).argmax())
        t2 = time.perf_counter()
    print(json.dumps({"pp_tps": len(tokens) / (t1 - t0), "tg_tps": n_gen / (t2 - t1),
                      "manifest": library.read_manifest()}))
"""


def measure(prefix: Path, args) -> dict:
    env = {**os.environ, "SWARMKV_LIBLLAMA": str(prefix / "lib")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(args.prompt), str(args.gen), str(args.threads)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"measuring {prefix} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench builds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, default=Path("libllama"), help="install folder of build A (default ./libllama)")
    ap.add_argument("--b", type=Path, required=True, help="install folder of build B")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    ap.add_argument("--gen", type=int, default=32, help="single-token decodes after it (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each build, alternating (default 3)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    runs = {"a": [], "b": []}
    for r in range(args.repeats):
        for name in ("a", "b"):
            result = measure(getattr(args, name), args)
            runs[name].append(result)
            print(f"run {r + 1}/{args.repeats} {name}: prefill {result['pp_tps']:.1f} t/s, "
                  f"decode {result['tg_tps']:.1f} t/s", file=sys.stderr)
    summary = {}
    for name in ("a", "b"):
        m = runs[name][0]["manifest"] or {}
        summary[name] = {"prefix": str(getattr(args, name)), "cpu_target": m.get("cpu_target"),
                         "cpu_features": m.get("cpu_features"),
                         "pp_tps_median": statistics.median(x["pp_tps"] for x in runs[name]),
                         "tg_tps_median": statistics.median(x["tg_tps"] for x in runs[name])}
    report = {"prompt_tokens": args.prompt, "gen_tokens": args.gen, "threads": args.threads,
              "repeats": args.repeats, "builds": summary,
              "b_over_a_prefill": summary["b"]["pp_tps_median"] / summary["a"]["pp_tps_median"],
              "b_over_a_decode": summary["b"]["tg_tps_median"] / summary["a"]["tg_tps_median"]}
    report_json(report, args.out, settings_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
