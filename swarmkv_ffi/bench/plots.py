"""PNG plots for the fan-out benchmark (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"baseline": "#8c8c8c", "shared": "#1f77b4", "copy": "#ff7f0e"}


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fanout(report: dict, out: Path) -> None:
    comps = report["comparisons"]
    if comps:
        _end_to_end(comps, out / "end_to_end_latency.png")
        _prefill_breakdown(comps, out / "prefill_cost_breakdown.png")
        _trial_consistency(comps, out / "trial_consistency.png")
        _activation(comps, out / "activation_latency.png")
    if report.get("sweep_branches") or report.get("sweep_doc_length"):
        _scaling(report, out / "scaling.png")


def _label(c: dict) -> str:
    return f"N={c['n_branches']}, {c['gen_tokens']} tok"


def _end_to_end(comps, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for k, mode in enumerate(("baseline", "shared", "copy")):
        vals = [c["trials"][c["best_trial"]]["runs"][mode]["total_ms"] / 1e3 for c in comps]
        ax.bar([i + (k - 1) * width for i in range(len(comps))], vals, width, label=mode, color=COLORS[mode])
    ax.set_xticks(range(len(comps)), [_label(c) for c in comps])
    ax.set_ylabel("end-to-end (s)")
    ax.set_title("End-to-end latency (best trial)")
    ax.legend()
    _save(fig, path)


def _prefill_breakdown(comps, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, redundant, once = [], [], []
    for c in comps:
        b = c["best"]
        per_agent = b["baseline_prefill_ms_per_agent"]
        labels += [f"{_label(c)}\nbaseline", f"{_label(c)}\nshared"]
        once += [per_agent[0] / 1e3, b["shared_prefill_ms"] / 1e3]
        redundant += [sum(per_agent[1:]) / 1e3, 0]
    ax.bar(labels, once, color="#1f77b4", label="first (necessary) prefill")
    ax.bar(labels, redundant, bottom=once, color="#d62728", label="redundant re-prefills")
    ax.set_ylabel("prefill time (s)")
    ax.set_title("Prefill cost breakdown")
    ax.legend()
    _save(fig, path)


def _trial_consistency(comps, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in comps:
        for mode in ("baseline", "shared", "copy"):
            ys = [tr["runs"][mode]["total_ms"] / 1e3 for tr in c["trials"]]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", color=COLORS[mode],
                    linestyle="-" if c is comps[0] else "--", label=f"{mode} ({_label(c)})")
    ax.set_xlabel("trial")
    ax.set_ylabel("end-to-end (s)")
    ax.set_title("Trial consistency")
    ax.legend(fontsize=7)
    _save(fig, path)


def _activation(comps, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, vals, colors = [], [], []
    for c in comps:
        b = c["best"]
        if "baseline_branch2_activation_ms" not in b:
            continue
        for mode in ("baseline", "shared", "copy"):
            labels.append(f"{_label(c)}\n{mode}")
            vals.append(b[f"{mode}_branch2_activation_ms"])
            colors.append(COLORS[mode])
    ax.bar(labels, vals, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("branch-2 activation (ms, log)")
    ax.set_title("Activation latency (TTFT proxy): re-prefill + first token vs fork + first token")
    ax.tick_params(axis="x", labelsize=7)
    _save(fig, path)


def _scaling(report, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = report.get("sweep_branches") or []
    for mode in ("baseline", "shared", "copy"):
        pts = [(r["n_branches"], r["e2e_ms"] / 1e3) for r in rows if r["mode"] == mode]
        if pts:
            axes[0].plot(*zip(*pts), marker="o", label=mode, color=COLORS[mode])
    axes[0].set_xlabel("branches N")
    axes[0].set_ylabel("end-to-end (s)")
    axes[0].set_title("End-to-end against N")
    axes[0].legend()
    rows = report.get("sweep_doc_length") or []
    for mode in ("shared", "copy"):
        pts = [(r["doc_tokens"], r["max_fork_ms"]) for r in rows if r["mode"] == mode]
        if pts:
            axes[1].plot(*zip(*pts), marker="o", label=mode, color=COLORS[mode])
    axes[1].set_yscale("log")
    axes[1].set_xlabel("document tokens")
    axes[1].set_ylabel("fork / restore per branch (ms, log)")
    axes[1].set_title("Fork cost against document length")
    axes[1].legend()
    _save(fig, path)
