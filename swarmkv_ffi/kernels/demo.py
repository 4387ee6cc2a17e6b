"""layer-stream-demo: serial vs overlapped layer streaming, side by side.

Prints a per-layer timing table, the ideal bound max(T, C) from a transfer-only and a
compute-only run, the overlap efficiency, pinned vs pageable bandwidth, and one line:
HEADLINE: serial=<ms> ms, overlapped=<ms> ms, savings=<pct>%, speedup=<x>x
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
    p.add_argument("--no-bandwidth", action="store_true", help="skip the pinned/pageable measure")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def resolve_defaults(args, simulator: bool) -> dict:
    base = SIM_DEFAULTS if simulator else dict(n_layers=8, bytes_per_layer=64 * MIB,
                                               compute_iters=64, trials=3, warmup=1)
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}


def run(opts: dict, bandwidth_check: bool = True) -> dict:
    from .streamer import SIMULATOR, LayerStreamer, bandwidth
    from .fma import reference

    s = LayerStreamer(opts["n_layers"], opts["bytes_per_layer"], opts["compute_iters"])
    for _ in range(opts["warmup"]):
        s.run_serial(), s.run_overlapped()
    best = {}
    for _ in range(max(1, opts["trials"])):
        for r in (s.run_serial(), s.run_overlapped(), s.run_transfer_only(), s.run_compute_only()):
            if r.schedule not in best or r.wall_ms < best[r.schedule].wall_ms:
                best[r.schedule] = r
    serial, over = best["serial"], best["overlapped"]
    identical = bool(np.array_equal(serial.output, over.output))
    ref_ok = None
    if opts["bytes_per_layer"] * opts["n_layers"] <= 256 * MIB:  # NumPy check costs CPU time
        ref_ok = bool(np.allclose(serial.output, reference(np.asarray(s.host), opts["compute_iters"]),
                                  rtol=1e-5, atol=1e-5))
    T, C = best["transfer_only"].wall_ms, best["compute_only"].wall_ms
    ideal = max(T, C)
    saved, possible = serial.wall_ms - over.wall_ms, serial.wall_ms - ideal
    report = {
        "simulator": SIMULATOR, "config": opts,
        "serial_ms": serial.wall_ms, "overlapped_ms": over.wall_ms,
        "savings_pct": 100 * saved / serial.wall_ms, "speedup": serial.wall_ms / over.wall_ms,
        "transfer_only_ms": T, "compute_only_ms": C, "ideal_ms": ideal,
        "overlap_efficiency_pct": 100 * saved / possible if possible > 0 else None,
        "outputs_identical": identical, "matches_numpy_reference": ref_ok,
        "layers": {name: [vars(layer) for layer in best[name].layers] for name in ("serial", "overlapped")},
    }
    if bandwidth_check:
        report["bandwidth"] = bandwidth(min(opts["bytes_per_layer"], 64 * MIB), repeats=3)
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
    print(f"outputs: serial == overlapped: {r['outputs_identical']}; NumPy reference: "
          f"{r['matches_numpy_reference']}")
    if "bandwidth" in r:
        b = r["bandwidth"]
        print(f"host-to-device: pinned {b['pinned_gbps']:.2f} GB/s, pageable {b['pageable_gbps']:.2f} GB/s "
              f"({b['pinned_over_pageable']:.2f}x)")
    print(f"HEADLINE: serial={r['serial_ms']:.2f} ms, overlapped={r['overlapped_ms']:.2f} ms, "
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
    report = run(opts, bandwidth_check=not args.no_bandwidth)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["outputs_identical"] and report["matches_numpy_reference"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
