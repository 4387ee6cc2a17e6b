"""Our ggml patches against stock ggml, measured with llama.cpp's own llama-batched-bench.

`./build_llama.sh --tools` builds llama-batched-bench twice from the same pin and flags:
PREFIX/tools-stock/ from the pristine sources, PREFIX/tools/ with kernels/ggml/*.patch
applied. This runs them on the same model, the same threads, in one process run,
alternating the variants on each repeat (in an order rotated from one repeat to the
next), and reports the medians:

  stock       the pristine build: ggml's kernels, the yardstick users already have
  ggml        the patched build with GGML_FA_SHARED=off: ggml's kernels
  ours        the patched build with GGML_FA_SHARED=on: the shared-prefix kernel wherever
              it applies
  default     the patched build's default mode with the table the library uses: this
              CPU's calibration (`swarmkv calibrate`, handed over as GGML_FA_SHARED_RULE),
              else the table built into the patch
  builtin     (not run unless named) the default mode with the built-in table
  kx8         (not run unless named) the default mode with Q6_K and Q5_K on our kernels
              (GGML_KX8=on) where the build keeps ggml's (AVX-512 VNNI: docs/matmul.md)

  llama-batched-bench -npp P -ntg G -npl N -pps -kvu -fa on -b 2048 -ub 512

-pps prefills the prompt once and shares it among the N sequences in one unified KV
cache: the fan-out's workload (S_TG is decode tokens/s over all N sequences, S_PP the
prefill). "vs best" is the default over the faster of ggml and ours (the choice the
table had to make), "vs stock" the default over stock llama.cpp. --op also times the
flash-attention op alone (swarmkv_ffi.fattn) for the same shapes. --types also runs the
model requantized to other weight types (made once by the stock llama-quantize, kept under
build_llama.sh's cache folder in requantized/): each weight type has its own matmul kernels, ours
(Q4_1, Q6_K and Q5_K on x86, docs/matmul.md) or ggml's. K-quants need rows of a multiple of 256
values, which SmolLM2 (576 wide) mostly lacks: llama-quantize gives its other matrices
another type. A model of Llama-3.2-1B's shapes (random weights, written once by
swarmkv_ffi.shaped_gguf) takes K-quants everywhere:

    swarmkv bench kernels --npp 3500 --npl 1,4,16 --repeats 5 --out bench/results/latest/kernels.json
    swarmkv bench kernels --types file,q4_0,q8_0,q4_k_m --npp 256 --npl 1,16,64,128 --variants stock,default
    python -m swarmkv_ffi.shaped_gguf llama1b-f16.gguf --type F16
    swarmkv bench kernels --model llama1b-f16.gguf --types q6_k,q4_k_m --npp 256 --npl 1,16 \\
        --variants stock,ggml,default
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from .. import calibration, cpu, library
from ..catalog import DEFAULT_MODEL, resolve
from ..shaped_gguf import quantize
from .measure import report_json, settings_of
from .tools import run_json_lines

VARIANTS = ("stock", "ggml", "ours", "default", "builtin", "kx8")
DEFAULT_VARIANTS = VARIANTS[:4]
#: variant -> (tools build, environment for the kernel choice; None: the library's table)
_RUNS = {"stock": ("stock", {}), "ggml": ("patched", {"GGML_FA_SHARED": "off"}),
         "ours": ("patched", {"GGML_FA_SHARED": "on"}), "default": ("patched", None), "builtin": ("patched", {}),
         "kx8": ("patched", None)}
#: variant -> the K-quant matmul's choice (patch 0006's GGML_KX8), beside the attention's
_MATMUL = {"kx8": {"GGML_KX8": "on"}}


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def names(text: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"variants are {', '.join(VARIANTS)}; got {text!r}")
    return [v for v in VARIANTS if v in chosen]


def types(text: str) -> list[str]:
    chosen = [x.strip().upper() for x in text.split(",") if x.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError("expected llama-quantize type names (e.g. file,q4_0,q8_0,q4_k_m)")
    return ["file" if t == "FILE" else t for t in chosen]


def weight_files(model: Path, kinds: list[str], threads: int) -> dict[str, Path]:
    """{weight type: GGUF} for each of `kinds`: "file" is the model as it is, any other
    name a copy requantized by the stock llama-quantize, made once and kept."""
    folder = library.cache_dir() / "requantized"
    files = {}
    for kind in kinds:
        if kind == "file":
            files[kind] = model
            continue
        out = folder / f"{model.stem}.{kind}.gguf"
        if not out.exists():
            folder.mkdir(parents=True, exist_ok=True)
            print(f"requantizing {model.name} to {kind} (once; kept in {folder})", file=sys.stderr, flush=True)
            part = out.with_suffix(".part")
            quantize(model, part, kind, library.tool_path("llama-quantize"), threads, requantize=True)
            part.rename(out)
        files[kind] = out
    return files


def calibrated_rule() -> dict | None:
    """The manifest's calibration if the library would use it here (measured on this
    CPU); None where the built-in table applies."""
    entry = library.manifest().get(calibration.KEY)
    if entry and cpu.same_identity(entry.get("cpu", {}), cpu.identity()):
        return entry
    return None


def variant_env(variant: str, rule: list[int] | None) -> dict:
    """The environment of one variant's run: ours, never the caller's kernel overrides."""
    extra = _RUNS[variant][1]
    if extra is None:                       # the library's table: the calibrated one, else the built-in
        env = calibration.kernel_env(rule)
    else:
        env = {**calibration.kernel_env(), **extra}
    env.pop("GGML_KX8", None)
    return {**env, **_MATMUL.get(variant, {})}


def tool(variant: str) -> Path:
    """The llama-batched-bench a variant runs (SystemExit naming the build step if absent)."""
    exe = library.tool_path("llama-batched-bench", build=_RUNS[variant][0])
    if not exe.exists():
        raise SystemExit(f"{exe} not found: build both sets of tools with ./build_llama.sh --tools")
    return exe


def batched_bench(variant: str, model: Path, args, rule: list[int] | None) -> list[dict]:
    exe = tool(variant)
    n_ctx = max(args.npp) + max(args.npl) * (args.ntg + 8) + 64
    return run_json_lines([str(exe), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
                           "-npp", ",".join(map(str, args.npp)), "-ntg", str(args.ntg),
                           "-npl", ",".join(map(str, args.npl)), "-pps", "-kvu", "-fa", "on",
                           "-ctk", args.kv_type, "-ctv", args.kv_type, "-t", str(args.threads),
                           "--output-format", "jsonl"], env=variant_env(variant, rule))


def table(runs: dict[str, list[list[dict]]], args, kind: str) -> list[dict]:
    """One row per (npp, npl) of weight type `kind`: medians of S_TG and S_PP per variant;
    the default (or the built-in table) over the faster of ggml and ours, and over stock."""
    rows = []
    for npp in args.npp:
        for npl in args.npl:
            row = {"type": kind, "npp": npp, "npl": npl}
            for variant in args.variants:
                hits = [[r for r in run if r["pp"] == npp and r["pl"] == npl][0] for run in runs[variant]]
                row[f"{variant}_tg_tps"] = statistics.median(r["speed_tg"] for r in hits)
                row[f"{variant}_pp_tps"] = statistics.median(r["speed_pp"] for r in hits)
                row[f"{variant}_tg_runs"] = [r["speed_tg"] for r in hits]
                row[f"{variant}_pp_runs"] = [r["speed_pp"] for r in hits]
            for chosen in {"default", "builtin", "kx8"} & set(args.variants):
                for phase in ("tg", "pp"):
                    if chosen != "kx8" and {"ggml", "ours"} <= set(args.variants):
                        best = max(row[f"ggml_{phase}_tps"], row[f"ours_{phase}_tps"])
                        row[f"{chosen}_{phase}_vs_best"] = row[f"{chosen}_{phase}_tps"] / best
                    if "stock" in args.variants:
                        row[f"{chosen}_{phase}_vs_stock"] = row[f"{chosen}_{phase}_tps"] / row[f"stock_{phase}_tps"]
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


def print_table(rows: list[dict], variants: list[str]) -> None:
    chosen = next((v for v in ("default", "builtin") if v in variants), None)
    ratios = [k for k in ("vs_best", "vs_stock") if chosen and any(f"{chosen}_tg_{k}" in r for r in rows)]
    for phase, title in (("tg", "S_TG (decode t/s)"), ("pp", "S_PP (prefill t/s)")):
        print(f"{title}:", file=sys.stderr)
        print(f"{'type':>8} {'npp':>6} {'N':>3} | " + " ".join(f"{v:>10}" for v in variants)
              + "".join(f" | {chosen + ' ' + k.replace('_', ' '):>16}" for k in ratios), file=sys.stderr)
        for r in rows:
            print(f"{r['type']:>8} {r['npp']:>6} {r['npl']:>3} | " + " ".join(f"{r[f'{v}_{phase}_tps']:>10.1f}" for v in variants)
                  + "".join(f" | {r[f'{chosen}_{phase}_{k}']:>15.3f}x" for k in ratios), file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--npp", type=ints, default=[128, 1600, 3500], help="prompt lengths (default 128,1600,3500)")
    ap.add_argument("--npl", type=ints, default=[1, 4, 16], help="parallel sequences (default 1,4,16)")
    ap.add_argument("--ntg", type=int, default=32, help="tokens generated per sequence (default 32)")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="KV cache type (default f16)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant; medians reported (default 3)")
    ap.add_argument("--variants", type=names, default=list(DEFAULT_VARIANTS),
                    help=f"which of {','.join(VARIANTS)} to run (default: {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--types", type=types, default=["file"],
                    help="weight types to run: 'file' (the model as it is) and llama-quantize names such as "
                         "q4_0,q8_0,q4_k_m,q6_k (default: file)")
    ap.add_argument("--op", action="store_true", help="also time the flash-attention op alone")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.ntg < 1:
        ap.error("--repeats and --ntg must be >= 1")
    model = resolve(args.model)
    for variant in args.variants:   # every tool present before the first long run
        tool(variant)
    files = weight_files(model, args.types, args.threads)
    entry = calibrated_rule()
    rule = entry["rule"] if entry else None
    runs: dict[str, dict[str, list[list[dict]]]] = {k: {v: [] for v in args.variants} for k in files}
    for r in range(args.repeats):
        shift = r % len(args.variants)     # each variant in turn runs first, so no one always follows another
        for kind, path in files.items():
            for variant in args.variants[shift:] + args.variants[:shift]:
                print(f"repeat {r + 1}/{args.repeats}: {kind} {variant}", file=sys.stderr, flush=True)
                runs[kind][variant].append(batched_bench(variant, path, args, rule))
    rows = [row for kind in files for row in table(runs[kind], args, kind)]
    print_table(rows, args.variants)
    settings = {**settings_of(args), "llama_batched_bench": {
        "kv_type": args.kv_type, "flash_attn": "on", "n_batch": 2048, "n_ubatch": 512, "threads": args.threads,
        "pps": True, "kv_unified": True}}
    report = {
        "benchmark": "kernels", "model": model.name, "files": {k: p.name for k, p in files.items()},
        "default_table": "calibrated" if entry else "built-in",
        "calibration": None if entry is None else {k: entry.get(k) for k in ("rule", "cpu", "threads", "calibrated_at",
                                                                              "op_rule", "check")},
        "rows": rows,
        "raw": runs,
    }
    if args.op:
        report["op"] = op_timings(args, model)
    report_json(report, args.out, settings, {"rows": [{k: v for k, v in r.items() if not k.endswith("_runs")}
                                            for r in rows], "op": report.get("op")})
    return 0
