"""layer-stream-demo: serial vs overlapped layer streaming, side by side.

Prints a per-layer timing table, the ideal bound max(T, C) from a transfer-only and a
compute-only run, the overlap efficiency, pinned vs pageable bandwidth, and one line:
HEADLINE: serial=<ms> ms, overlapped=<ms> ms, savings=<pct>%, speedup=<x>x

Every serial and overlapped run of every trial is checked: sampled output elements after
each layer against NumPy, serial against overlapped, and the issued schedule against
CUDA's ordering rules. Any failure exits 1.

--balance also runs a second configuration whose compute_iters is measured so a layer's
kernel takes as long as its copy (within 10 %): the case overlap exists for. At the
defaults a 64 MiB copy on a PCIe 5 GPU takes ~25x the kernel, capping the speedup near 1.04x.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MIB = 1 << 20
SIM_DEFAULTS = dict(n_layers=4, bytes_per_layer=16 << 10, compute_iters=4, trials=1, warmup=0)


def parse_size(text: str) -> int:
    """'64M', '64MiB', '1G', '65536' → bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 64M)") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"size must be at least 4 bytes, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layer-stream-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layers", type=int, default=None, help="layers (default 8; simulator: 4)")
    p.add_argument("--bytes-per-layer", type=parse_size, default=None,
                   help="weights per layer, e.g. 64M (default 64M; simulator: 16K)")
    p.add_argument("--compute-iters", type=int, default=None,
                   help="FMA iterations per element (default 64; simulator: 4)")
    p.add_argument("--trials", type=int, default=None, help="timed trials, best kept (default 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up runs (default 1)")
    p.add_argument("--balance", action="store_true",
                   help="also run with compute_iters chosen so compute time ~= copy time per layer")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the pinned/pageable measure")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def resolve_defaults(args, simulator: bool) -> dict:
    base = SIM_DEFAULTS if simulator else dict(n_layers=8, bytes_per_layer=64 * MIB,
                                               compute_iters=64, trials=3, warmup=1)
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}


def balance(s, tolerance: float = 0.10, rounds: int = 8) -> dict:
    """Set s.iters so compute-only time is within `tolerance` of transfer-only time."""
    def best(run):
        return min(run().wall_ms for _ in range(2))
    T = best(s.run_transfer_only)
    C = best(s.run_compute_only)
    for _ in range(rounds):
        if abs(C - T) <= tolerance * T:
            break
        s.iters = max(1, round(s.iters * T / C))
        C = best(s.run_compute_only)
    return {"compute_iters": s.iters, "transfer_ms": T, "compute_ms": C,
            "balanced": abs(C - T) <= tolerance * T}


def trials(s, opts: dict) -> tuple[dict, dict[str, list[str]], int]:
    """Best run of each schedule, and every check failure of every run, by check."""
    from .schedule import violations
    for _ in range(opts["warmup"]):
        s.run_serial(), s.run_overlapped()
    best, checked = {}, 0
    failures: dict[str, list[str]] = {"numpy": [], "outputs": [], "schedule": []}
    for t in range(max(1, opts["trials"])):
        runs = {}
        for r in (s.run_serial(), s.run_overlapped(), s.run_transfer_only(), s.run_compute_only()):
            runs[r.schedule] = r
            if r.schedule not in best or r.wall_ms < best[r.schedule].wall_ms:
                best[r.schedule] = r
        for name in ("serial", "overlapped"):
            checked += 1
            bad = s.check(runs[name])
            if bad:
                failures["numpy"].append(f"trial {t + 1}, {name}: layers {bad} differ from NumPy")
            failures["schedule"] += [f"trial {t + 1}, {name}: {v}" for v in violations(runs[name].schedule_log)]
        if not np.array_equal(runs["serial"].output, runs["overlapped"].output):
            failures["outputs"].append(f"trial {t + 1}: serial and overlapped outputs differ")
    return best, failures, checked


def summarise(best: dict, opts: dict, failures: dict[str, list[str]], checked: int) -> dict:
    serial, over = best["serial"], best["overlapped"]
    T, C = best["transfer_only"].wall_ms, best["compute_only"].wall_ms
    ideal = max(T, C)
    saved, possible = serial.wall_ms - over.wall_ms, serial.wall_ms - ideal
    return {
        "config": dict(opts),
        "serial_ms": serial.wall_ms, "overlapped_ms": over.wall_ms,
        "savings_pct": 100 * saved / serial.wall_ms, "speedup": serial.wall_ms / over.wall_ms,
        "transfer_only_ms": T, "compute_only_ms": C, "ideal_ms": ideal,
        "ideal_speedup": serial.wall_ms / ideal,
        "overlap_efficiency_pct": 100 * saved / possible if possible > 0 else None,
        "runs_checked": checked, "check_failures": [f for kind in failures.values() for f in kind],
        "outputs_identical": not failures["outputs"],
        "matches_numpy_reference": not failures["numpy"],
        "schedule_race_free": not failures["schedule"],
        "layers": {name: [vars(layer) for layer in best[name].layers] for name in ("serial", "overlapped")},
    }


def run(opts: dict, bandwidth_check: bool = True, balanced: bool = False) -> dict:
    from .streamer import SIMULATOR, LayerStreamer, bandwidth

    s = LayerStreamer(opts["n_layers"], opts["bytes_per_layer"], opts["compute_iters"])
    best, failures, checked = trials(s, opts)
    report = {"simulator": SIMULATOR, **summarise(best, opts, failures, checked)}
    if balanced:
        info = balance(s)
        b_opts = {**opts, "compute_iters": s.iters}
        best, failures, checked = trials(s, b_opts)
        report["balanced"] = {"balance": info, **summarise(best, b_opts, failures, checked)}
    if bandwidth_check:
        report["bandwidth"] = bandwidth(min(opts["bytes_per_layer"], 64 * MIB), repeats=3)
    report["ok"] = not report["check_failures"] and not report.get("balanced", {}).get("check_failures")
    return report


def print_report(r: dict) -> None:
    if r["simulator"]:
        print("NOTE: running on Numba's CUDA simulator: kernels run on the CPU, there is no real "
              "overlap, and the times below are wall-clock and mean nothing. Use it for correctness.")
    c = r["config"]
    print(f"{c['n_layers']} layers x {c['bytes_per_layer'] / MIB:.2f} MiB x {c['compute_iters']} FMA "
          f"iterations, best of {c['trials']}")
    print(f"\n{'layer':>5} | {'serial copy':>18} {'serial compute':>18} | {'overl. copy':>18} {'overl. compute':>18}")

    def span(a, b):
        return f"{a:8.2f}-{b:8.2f}" if a is not None and b is not None else f"{'n/a':>17}"
    for i, (s, o) in enumerate(zip(r["layers"]["serial"], r["layers"]["overlapped"])):
        print(f"{i:5} | {span(s['copy_start'], s['copy_end']):>18} {span(s['compute_start'], s['compute_end']):>18} |"
              f" {span(o['copy_start'], o['copy_end']):>18} {span(o['compute_start'], o['compute_end']):>18}")
    print("\n(ms from the start of each run, from CUDA events)" if not r["simulator"] else
          "\n(no per-layer times: the simulator's events have none)")
    eff = r["overlap_efficiency_pct"]
    print(f"transfer only T={r['transfer_only_ms']:.2f} ms, compute only C={r['compute_only_ms']:.2f} ms, "
          f"ideal max(T, C)={r['ideal_ms']:.2f} ms, overlap efficiency="
          + (f"{eff:.1f}%" if eff is not None else "n/a"))
    print(f"checks: {r['runs_checked']} runs, sampled output after every layer vs NumPy, serial vs "
          f"overlapped, schedule vs CUDA ordering rules: "
          + ("all passed" if not r["check_failures"] else f"{len(r['check_failures'])} FAILED"))
    for failure in r["check_failures"]:
        print(f"  FAILED: {failure}")
    if "bandwidth" in r:
        b = r["bandwidth"]
        print(f"host-to-device: pinned {b['pinned_gbps']:.2f} GB/s, pageable {b['pageable_gbps']:.2f} GB/s "
              f"({b['pinned_over_pageable']:.2f}x)")
    print(headline("HEADLINE", r))
    if "balanced" in r:
        b = r["balanced"]
        info = b["balance"]
        print(f"\n--balance: compute_iters={info['compute_iters']} (copy {info['transfer_ms']:.2f} ms, "
              f"compute {info['compute_ms']:.2f} ms for all layers"
              + ("" if info["balanced"] else "; NOT within 10 %") + ")")
        print(f"ideal max(T, C)={b['ideal_ms']:.2f} ms (ideal speedup {b['ideal_speedup']:.3f}x), "
              f"overlap efficiency=" + (f"{b['overlap_efficiency_pct']:.1f}%" if b["overlap_efficiency_pct"] is not None else "n/a")
              + f"; checks: {b['runs_checked']} runs, " + ("all passed" if not b["check_failures"] else "FAILED"))
        for failure in b["check_failures"]:
            print(f"  FAILED: {failure}")
        print(headline(f"HEADLINE (balanced, compute_iters={info['compute_iters']})", b))


def headline(label: str, r: dict) -> str:
    return (f"{label}: serial={r['serial_ms']:.2f} ms, overlapped={r['overlapped_ms']:.2f} ms, "
            f"savings={r['savings_pct']:.2f}%, speedup={r['speedup']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from numba import config, cuda
    except ImportError:
        print("layer-stream-demo: error: needs numba and numba-cuda (pip install 'swarmkv-ffi[cuda]')",
              file=sys.stderr)
        return 2
    simulator = bool(config.ENABLE_CUDASIM)
    if not simulator and not cuda.is_available():
        print("layer-stream-demo: error: no CUDA device. Run it on a GPU, or set "
              "NUMBA_ENABLE_CUDASIM=1 to check correctness on the CPU.", file=sys.stderr)
        return 2
    opts = resolve_defaults(args, simulator)
    for key in ("n_layers", "compute_iters"):
        if opts[key] < 1:
            print(f"layer-stream-demo: error: --{key.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    report = run(opts, bandwidth_check=not args.no_bandwidth, balanced=args.balance)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
