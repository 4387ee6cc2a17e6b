"""Our ggml patches against stock ggml, measured with llama.cpp's own llama-batched-bench.

`./build_llama.sh --tools` builds llama-batched-bench twice from the same pin and flags:
PREFIX/tools-stock/ from the pristine sources, PREFIX/tools/ with kernels/ggml/*.patch
applied. This runs both on the same model, the same threads, in one process run,
alternating stock and patched on each repeat, and reports the medians and their ratio:

  llama-batched-bench -npp P -ntg G -npl N -pps -kvu -fa on -b 2048 -ub 512

-pps prefills the prompt once and shares it among the N sequences in one unified KV
cache: the fan-out's workload (S_TG is decode tokens/s over all N sequences, S_PP the
prefill). --op also times the flash-attention op alone (swarmkv_ffi.fattn) for the same
shapes: stock kernels vs the shared-prefix kernel, on random data.

    swarmkv bench kernels --npp 128,1600,3500 --npl 1,4,16 --out bench/results/latest/kernels.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from .. import library
from ..catalog import DEFAULT_MODEL, resolve
from .measure import report_json, settings_of
from .tools import run_json_lines

BUILDS = ("stock", "patched")


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def batched_bench(build: str, model: Path, args) -> list[dict]:
    exe = library.tool_path("llama-batched-bench", build=build)
    if not exe.exists():
        raise SystemExit(f"{exe} not found: build both sets of tools with ./build_llama.sh --tools")
    n_ctx = max(args.npp) + max(args.npl) * (args.ntg + 8) + 64
    return run_json_lines([str(exe), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
                           "-npp", ",".join(map(str, args.npp)), "-ntg", str(args.ntg),
                           "-npl", ",".join(map(str, args.npl)), "-pps", "-kvu", "-fa", "on",
                           "-ctk", args.kv_type, "-ctv", args.kv_type, "-t", str(args.threads),
                           "--output-format", "jsonl"])


def table(runs: dict[str, list[list[dict]]], args) -> list[dict]:
    """One row per (npp, npl): medians of S_TG and S_PP per build, and patched/stock."""
    rows = []
    for npp in args.npp:
        for npl in args.npl:
            row = {"npp": npp, "npl": npl}
            for build in BUILDS:
                hits = [[r for r in run if r["pp"] == npp and r["pl"] == npl][0] for run in runs[build]]
                row[f"{build}_tg_tps"] = statistics.median(r["speed_tg"] for r in hits)
                row[f"{build}_pp_tps"] = statistics.median(r["speed_pp"] for r in hits)
                row[f"{build}_tg_runs"] = [r["speed_tg"] for r in hits]
            row["tg_ratio"] = row["patched_tg_tps"] / row["stock_tg_tps"]
            row["pp_ratio"] = row["patched_pp_tps"] / row["stock_pp_tps"]
            rows.append(row)
    return rows


def op_timings(args, model: Path) -> list[dict]:
    """The flash-attention op alone at the model's attention shapes, fan-out mask."""
    import numpy as np

    from .. import fattn
    from ..model import Model
    with Model(model) as m:
        n_head, n_head_kv = m.n_head, m.n_head_kv
        arch = m.meta("general.architecture")
        dk = int(m.meta(f"{arch}.attention.key_length") or m.n_embd // n_head)
    rng = np.random.default_rng(0)
    rows = []
    for npp in args.npp:
        for npl in args.npl:
            n_kv = npp + npl * args.ntg
            q = rng.standard_normal((1, n_head, npl, dk), dtype=np.float32)
            k = rng.standard_normal((1, n_head_kv, n_kv, dk), dtype=np.float32)
            v = rng.standard_normal((1, n_head_kv, n_kv, dk), dtype=np.float32)
            mask = np.full((1, npl, n_kv), -np.inf, np.float32)
            mask[0, :, :npp] = 0.0
            for b in range(npl):
                mask[0, b, npp + b::npl] = 0.0
            ms = {kern: 1e3 * statistics.median(fattn.time_flash_attn(
                q, k, v, mask, scale=dk ** -0.5, kernel=kern, n_threads=args.threads, repeat=9))
                for kern in ("stock", "shared", "auto")}
            rows.append({"npp": npp, "npl": npl, "n_kv": n_kv, **{f"{k}_ms": v for k, v in ms.items()},
                         "shared_speedup": ms["stock"] / ms["shared"]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'npp':>6} {'N':>3} | {'S_TG stock':>10} {'patched':>9} {'ratio':>6} | "
          f"{'S_PP stock':>10} {'patched':>9} {'ratio':>6}", file=sys.stderr)
    for r in rows:
        print(f"{r['npp']:>6} {r['npl']:>3} | {r['stock_tg_tps']:>10.1f} {r['patched_tg_tps']:>9.1f} "
              f"{r['tg_ratio']:>5.2f}x | {r['stock_pp_tps']:>10.1f} {r['patched_pp_tps']:>9.1f} "
              f"{r['pp_ratio']:>5.2f}x", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--npp", type=ints, default=[128, 1600, 3500], help="prompt lengths (default 128,1600,3500)")
    ap.add_argument("--npl", type=ints, default=[1, 4, 16], help="parallel sequences (default 1,4,16)")
    ap.add_argument("--ntg", type=int, default=32, help="tokens generated per sequence (default 32)")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="KV cache type (default f16)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each build; medians reported (default 3)")
    ap.add_argument("--op", action="store_true", help="also time the flash-attention op alone")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.ntg < 1:
        ap.error("--repeats and --ntg must be >= 1")
    model = resolve(args.model)
    runs: dict[str, list[list[dict]]] = {b: [] for b in BUILDS}
    for r in range(args.repeats):
        for build in BUILDS:
            print(f"repeat {r + 1}/{args.repeats}: {build}", file=sys.stderr, flush=True)
            runs[build].append(batched_bench(build, model, args))
    rows = table(runs, args)
    print_table(rows)
    settings = {**settings_of(args), "llama_batched_bench": {
        "kv_type": args.kv_type, "flash_attn": "on", "n_batch": 2048, "n_ubatch": 512, "threads": args.threads,
        "pps": True, "kv_unified": True}}
    report = {
        "benchmark": "kernels", "model": model.name,
        "rows": rows,
        "raw": runs,
    }
    if args.op:
        report["op"] = op_timings(args, model)
    report_json(report, args.out, settings, {"rows": [{k: v for k, v in r.items() if not k.endswith("_runs")}
                                            for r in rows], "op": report.get("op")})
    return 0
