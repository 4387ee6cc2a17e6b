"""Fan-out benchmark: baseline vs fan-out, best of N trials, and sweeps.

    baseline  N independent contexts, one after another, each prefilling the whole
              document then decoding its branch (nothing shared);
    shared    one prefill, forks by llama_memory_seq_cp, branches decoded together;
    copy      one prefill, snapshot, per-branch copy + fresh context + restore.

Every mode runs in this process on the same model, document and n_ctx. Best trial: the
one with the lowest shared-mode end-to-end time (best of 3 by default).
Outputs go into one folder: best_run.json, all_trials.csv, sweep_*.json and plots.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..catalog import DEFAULT_MODEL, resolve
from ..fanout import BranchSpec, FanoutConfig, run_baseline, run_fanout
from ..fanout.shared import together
from ..model import Model
from .measure import QUESTIONS, PeakRSS, add_threads, cpu_name, decode_loop, document_of, settings_of, write_result

COMPARED = ("baseline", "shared", "copy")   # the modes each comparison runs
TARGETS = {
    "n2_gen1_e2e_speedup": ("N=2, 1 token: end-to-end vs baseline", 1.95),
    "n2_gen1_branch2_activation_speedup": ("N=2, 1 token: branch-2 activation vs baseline", 100.0),
    "n8_gen32_e2e_speedup": ("N=8, 32 tokens: end-to-end vs baseline", 6.0),
    "max_shared_fork_ms": ("shared fork per branch, every doc length (ms, at most)", 2.0),
    "n16_batched_vs_serial_tps": ("N=16 batched vs serialised decode tokens/s", 3.0),
    "n16_vs_n1_shared_peak_rss": ("shared peak RSS N=16 / N=1 (at most)", 1.5),
}


@dataclass
class FanoutBench:
    """What this benchmark runs: the fan-out settings every mode shares, the document's
    length, the comparisons (N branches, tokens per branch) and how often each runs."""
    model: str = DEFAULT_MODEL
    doc_tokens: int = 3500
    fanout: FanoutConfig = field(default_factory=lambda: FanoutConfig(n_ctx=4096))
    trials: int = 3
    out: str = "bench/results/latest"
    runs: list[tuple[int, int]] = field(default_factory=lambda: [(2, 1), (8, 32)])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_mode(model: Model, document: str, mode: str, n: int, gen: int, cfg: FanoutBench, **kw) -> dict:
    """One run of one mode; returns its FanoutResult as a dict plus peak RSS."""
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=gen) for i in range(n)]
    with PeakRSS() as mem:
        if mode == "baseline":
            res = run_baseline(model, document, specs, cfg.fanout)
        else:
            res = run_fanout(model, document, specs, cfg.fanout, mode=mode, cache=False, **kw)
    out = res.to_dict()
    for b in out["branches"]:
        b["n_tokens"] = len(b.pop("token_ids"))
        for key in ("prompt_token_ids", "prompt_text"):
            b.pop(key)
    out["peak_rss_delta_bytes"] = mem.peak_delta
    out["generated_tokens"] = sum(len(b.token_ids) for b in res.branches)
    out["decode_loop"] = decode_loop(res.branches)
    return out


def compare(runs: dict[str, dict]) -> dict:
    """One trial's figures (speedups, activations, forks), from the baseline and the fan-out runs."""
    base = runs["baseline"]
    out = {"baseline_e2e_ms": base["total_ms"],
           "baseline_prefill_ms_per_agent": [b["prefill_ms"] for b in base["branches"]]}
    for mode in ("shared", "copy"):
        r = runs.get(mode)
        if r is None:
            continue
        out[f"{mode}_e2e_ms"] = r["total_ms"]
        out[f"{mode}_prefill_ms"] = r["prefill_ms"]
        out[f"{mode}_e2e_speedup"] = base["total_ms"] / r["total_ms"]
        out[f"{mode}_e2e_improvement_pct"] = 100 * (1 - r["total_ms"] / base["total_ms"])
        out[f"{mode}_redundant_prefill_eliminated_ms"] = base["prefill_ms"] - r["prefill_ms"]
        if len(r["branches"]) > 1:
            b2, s2 = base["branches"][1]["activation_ms"], r["branches"][1]["activation_ms"]
            out[f"{mode}_branch2_activation_ms"] = s2
            out["baseline_branch2_activation_ms"] = b2
            out[f"{mode}_branch2_activation_speedup"] = b2 / s2
            out[f"{mode}_branch2_activation_improvement_pct"] = 100 * (1 - s2 / b2)
    return out


def comparison(model: Model, document: str, n: int, gen: int, cfg: FanoutBench) -> dict:
    """`cfg.trials` trials of every mode; mode order rotates per trial to spread drift."""
    trials = []
    for t in range(cfg.trials):
        order = COMPARED[t % 3:] + COMPARED[:t % 3]
        runs = {}
        for mode in order:
            log(f"  N={n} gen={gen} trial {t + 1}/{cfg.trials}: {mode}")
            runs[mode] = run_mode(model, document, mode, n, gen, cfg)
        trials.append({"trial": t, "runs": runs, "summary": compare(runs)})
    best = min(trials, key=lambda tr: tr["runs"]["shared"]["total_ms"])
    return {"n_branches": n, "gen_tokens": gen, "trials": trials, "best_trial": best["trial"],
            "best_rule": "lowest shared-mode end-to-end ms", "best": best["summary"]}


# ---- sweeps -----------------------------------------------------------------------------------
def sweep_branches(model, document, cfg, ns=(1, 2, 4, 8, 16), gen=32, baseline_max_n=2) -> list[dict]:
    """End-to-end and peak memory against N. The baseline runs agents one after another, so
    its memory does not grow with N; it is measured up to baseline_max_n to save time."""
    rows = []
    for n in ns:
        for mode in COMPARED:
            if mode == "baseline" and n > baseline_max_n:
                continue
            log(f"  sweep branches: N={n} {mode}")
            r = run_mode(model, document, mode, n, gen, cfg)
            rows.append({"n_branches": n, "mode": mode, "e2e_ms": r["total_ms"],
                         "prefill_ms": r["prefill_ms"], "peak_rss_delta_bytes": r["peak_rss_delta_bytes"],
                         "snapshot_bytes": r["snapshot_bytes"], "generated_tokens": r["generated_tokens"],
                         "mean_activation_ms": _mean(b["activation_ms"] for b in r["branches"])})
    return rows


def sweep_doc_length(model, cfg, lengths=(512, 1024, 2048, 3500, 8192)) -> list[dict]:
    """Fork cost against document length (N=2, one token): seq_cp vs snapshot copy+restore."""
    rows = []
    for length in lengths:
        document = document_of(model, length)
        for mode in ("shared", "copy"):
            log(f"  sweep doc length: {length} tokens, {mode}")
            sub = replace(cfg, fanout=replace(cfg.fanout, n_ctx=None))  # sized to fit each length
            r = run_mode(model, document, mode, 2, 1, sub)
            rows.append({"doc_tokens": r["n_prefix"], "mode": mode, "prefill_ms": r["prefill_ms"],
                         "fork_ms": [b["fork_ms"] for b in r["branches"]],
                         "max_fork_ms": max(b["fork_ms"] for b in r["branches"]),
                         "snapshot_bytes": r["snapshot_bytes"]})
    return rows


def one_at_a_time(chunk, branches):
    """A shared-mode schedule with one decode for the prefill chunk and one per branch, as
    if one global mutex held every decode: what batching is measured against."""
    return [(chunk, [])] + [(None, [b]) for b in branches]


def sweep_decode(model, document, cfg, n=16, gen=32) -> list[dict]:
    """Batched (one llama_decode per step for all branches) vs serialised (one branch per
    decode, as under one global mutex): tokens/s of the decode loop, from the moment every
    branch has its first token (all prompts done, in both schedules) to the last token, and
    of the whole generation phase (prompts included)."""
    rows = []
    for name, schedule in (("batched", together), ("serialised", one_at_a_time)):
        log(f"  sweep decode: N={n} {name}")
        r = run_mode(model, document, "shared", n, gen, cfg, schedule=schedule)
        loop = r["decode_loop"]
        phase_ms = r["total_ms"] - min(b["ready_ms"] for b in r["branches"])
        rows.append({"n_branches": n, "decode": name,
                     "generated_tokens": r["generated_tokens"], "decode_loop_ms": loop["ms"],
                     "tokens_per_s": loop["tokens_per_s"],
                     "generation_phase_ms": phase_ms,
                     "tokens_per_s_incl_prompts": r["generated_tokens"] / (phase_ms / 1e3)})
    return rows


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# ---- output -----------------------------------------------------------------------------------
def write_trials_csv(path: Path, comparisons: list[dict]) -> None:
    fields = ["n_branches", "gen_tokens", "trial", "mode", "branch", "doc_tokens", "prefill_ms",
              "fork_ms", "ready_ms", "activation_ms", "decode_ms", "tokens", "e2e_ms",
              "snapshot_bytes", "peak_rss_delta_bytes"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for comp in comparisons:
            for tr in comp["trials"]:
                for mode, r in tr["runs"].items():
                    for b in r["branches"]:
                        w.writerow({"n_branches": comp["n_branches"], "gen_tokens": comp["gen_tokens"],
                                    "trial": tr["trial"], "mode": mode, "branch": b["index"],
                                    "doc_tokens": r["n_prefix"],
                                    "prefill_ms": b["prefill_ms"] if mode == "baseline" else r["prefill_ms"],
                                    "fork_ms": b["fork_ms"], "ready_ms": b["ready_ms"],
                                    "activation_ms": b["activation_ms"], "decode_ms": b["decode_ms"],
                                    "tokens": b["n_tokens"], "e2e_ms": r["total_ms"],
                                    "snapshot_bytes": r["snapshot_bytes"],
                                    "peak_rss_delta_bytes": r["peak_rss_delta_bytes"]})


def evaluate_targets(report: dict) -> dict:
    """Each target with the measured value and whether it was met."""
    got = {}
    for comp in report["comparisons"]:
        key = (comp["n_branches"], comp["gen_tokens"])
        if key == (2, 1):
            got["n2_gen1_e2e_speedup"] = comp["best"]["shared_e2e_speedup"]
            got["n2_gen1_branch2_activation_speedup"] = comp["best"]["shared_branch2_activation_speedup"]
        if key == (8, 32):
            got["n8_gen32_e2e_speedup"] = comp["best"]["shared_e2e_speedup"]
    if report.get("sweep_doc_length"):
        got["max_shared_fork_ms"] = max(r["max_fork_ms"] for r in report["sweep_doc_length"] if r["mode"] == "shared")
    if report.get("sweep_decode") and report["sweep_decode"][0]["n_branches"] == 16:
        tps = {r["decode"]: r["tokens_per_s"] for r in report["sweep_decode"]}
        got["n16_batched_vs_serial_tps"] = tps["batched"] / tps["serialised"]
    rows = [r for r in report.get("sweep_branches") or [] if r["mode"] == "shared"]
    by_n = {r["n_branches"]: r["peak_rss_delta_bytes"] for r in rows}
    if 1 in by_n and 16 in by_n and by_n[1] > 0:
        got["n16_vs_n1_shared_peak_rss"] = by_n[16] / by_n[1]
    out = {}
    for key, (label, bound) in TARGETS.items():
        if key not in got:
            continue
        at_most = key.startswith("max_") or key.endswith("peak_rss")
        met = got[key] <= bound if at_most else got[key] >= bound
        out[key] = {"label": label, "target": bound, "measured": got[key], "met": met}
    return out


def print_table(report: dict) -> None:
    for comp in report["comparisons"]:
        b = comp["best"]
        print(f"\nN={comp['n_branches']} gen={comp['gen_tokens']} doc={report['doc_tokens']} tokens "
              f"(best of {len(comp['trials'])}: {comp['best_rule']})")
        print(f"  {'':10} {'e2e ms':>10} {'prefill ms':>11} {'speedup':>8} {'branch-2 act. ms':>17}")
        print(f"  {'baseline':10} {b['baseline_e2e_ms']:10.0f} {sum(b['baseline_prefill_ms_per_agent']):11.0f}"
              f" {'1.00x':>8} {b.get('baseline_branch2_activation_ms', float('nan')):17.1f}")
        for mode in ("shared", "copy"):
            if f"{mode}_e2e_ms" in b:
                print(f"  {mode:10} {b[f'{mode}_e2e_ms']:10.0f} {b[f'{mode}_prefill_ms']:11.0f}"
                      f" {b[f'{mode}_e2e_speedup']:7.2f}x {b.get(f'{mode}_branch2_activation_ms', float('nan')):17.1f}")
    if report.get("targets"):
        print("\ntargets:")
        for t in report["targets"].values():
            print(f"  [{'met ' if t['met'] else 'MISS'}] {t['label']}: {t['measured']:.3f} (target {t['target']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarmkv bench fanout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name or .gguf path (default: %(default)s)")
    p.add_argument("--doc-tokens", type=int, default=3500, help="document length in tokens (default: 3500)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context per branch (default: 4096)")
    p.add_argument("--kv-type", default=FanoutConfig.kv_type, help=f"KV cache type (default: {FanoutConfig.kv_type})")
    p.add_argument("--trials", type=int, default=3, help="trials per comparison (default: 3)")
    p.add_argument("--runs", default="2:1,8:32",
                   help="comparisons as N:gen_tokens pairs (default: 2:1,8:32, the targets)")
    p.add_argument("--sweeps", default="branches,doc-length,decode",
                   help="comma list of branches, doc-length, decode, or 'none'")
    p.add_argument("--sweep-ns", default="1,2,4,8,16", help="N values for the branches sweep")
    p.add_argument("--doc-lengths", default="512,1024,2048,3500,8192", help="lengths for the doc-length sweep")
    p.add_argument("--decode-n", type=int, default=16, help="N for the batched-vs-serialised sweep (default: 16)")
    p.add_argument("--sweep-gen", type=int, default=32,
                   help="tokens per branch in the branches and decode sweeps (default: 32)")
    p.add_argument("--baseline-max-n", type=int, default=2, help="largest N the branches sweep runs the baseline for")
    add_threads(p)
    p.add_argument("--out", default=None, help="output folder (default: bench/results/<cpu>-<date>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = p.parse_args(argv)

    out = Path(args.out or f"bench/results/{cpu_name()}-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = FanoutBench(model=args.model, doc_tokens=args.doc_tokens, trials=args.trials, out=str(out),
                      fanout=FanoutConfig(n_ctx=args.n_ctx, kv_type=args.kv_type, n_threads=args.threads),
                      runs=[tuple(int(x) for x in r.split(":")) for r in args.runs.split(",") if r])
    sweeps = set() if args.sweeps == "none" else set(args.sweeps.split(","))
    model = Model(resolve(cfg.model))
    document = document_of(model, cfg.doc_tokens)
    t0 = time.time()
    settings = settings_of(args, cfg.fanout)
    report = {"command": " ".join(["swarmkv bench fanout"] + (sys.argv[1:] if argv is None else argv)),
              "model": model.path.name, "doc_tokens": len(model.tokenize(document)), "comparisons": []}

    def checkpoint():
        """Write what is measured so far: a long run that is stopped loses nothing."""
        report["targets"] = evaluate_targets(report)
        report["wall_s"] = time.time() - t0
        write_result(out / "best_run.json", report, settings)

    for n, gen in cfg.runs:
        log(f"comparison N={n} gen={gen}")
        report["comparisons"].append(comparison(model, document, n, gen, cfg))
        write_trials_csv(out / "all_trials.csv", report["comparisons"])
        checkpoint()
    if "decode" in sweeps:
        report["sweep_decode"] = sweep_decode(model, document, cfg, n=args.decode_n, gen=args.sweep_gen)
        checkpoint()
    if "branches" in sweeps:
        report["sweep_branches"] = sweep_branches(
            model, document, cfg, ns=[int(x) for x in args.sweep_ns.split(",")], gen=args.sweep_gen,
            baseline_max_n=args.baseline_max_n)
        checkpoint()
    if "doc-length" in sweeps:
        report["sweep_doc_length"] = sweep_doc_length(model, cfg, [int(x) for x in args.doc_lengths.split(",")])
        checkpoint()
    if not args.no_plots:
        from .plots import plot_fanout
        plot_fanout(report, out)
    print_table(report)
    print(f"\nwrote {out}/best_run.json, all_trials.csv" + ("" if args.no_plots else ", *.png"))
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
