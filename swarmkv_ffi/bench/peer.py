"""`swarmkv bench peer`: our fan-out against llama.cpp's own llama-server, same pin.

A user who wants N answers over one document can already start llama-server (built from
the same llama.cpp by `./build_llama.sh --tools`) and send it N requests: its slots keep
the document's prompt cache, so only the first request prefills. That, used the way its
users use it (its own defaults), is the yardstick. For every (N, answer length) this runs,
in one process with the model loaded beforehand on both sides and the prefix cache off:

    ours shared     run_fanout(mode="shared"), our defaults
    ours copy       run_fanout(mode="copy")
    server seq      N /completion requests one after another (each branch's exact prompt text)
    server conc     the same N requests at once

and reports end-to-end, prefill, mean per-answer latency, the ratios, and how many answers
have the same text. llama-server is restarted for every configuration, so no run finds
another's prompt cache; both sides have decoded once before the first measurement (the
server's own warm-up at load, a short fan-out of ours). Output: peer.json, peer.csv and peer.png in --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .. import catalog, library
from ..fanout import BranchSpec, FanoutConfig, run_fanout
from ..model import Model
from .measure import at_once, document_of, settings_of, write_result

QUESTIONS = ["What is this document about?", "Who may use the work?", "What must be kept in copies?",
             "What is excluded?", "Can I sell copies?", "What happens if I sue?", "What is a Contribution?",
             "Is there a warranty?"]


RUNS = ("ours_shared", "ours_copy", "server_seq", "server_conc")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary(given: Path | None, prog: str) -> Path | None:
    """The llama-server to compare with: `given`, or the stock one `./build_llama.sh
    --tools` built; None (after saying how to build it) when it is not there."""
    path = given or library.tool_path("llama-server")
    if not path.exists():
        print(f"{prog}: {path} not found; build it with ./build_llama.sh --tools", file=sys.stderr)
        return None
    return path


def start_healthy(cmd: list[str], url: str, log, what: str) -> subprocess.Popen:
    """Start an HTTP server and wait until its /health answers 200 (at most 120 s)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{what} did not become healthy within 120 s")
        time.sleep(0.2)


class HttpServer:
    """An HTTP server process on a free loopback port, healthy once built; close() (or
    the end of a `with`) stops it. command(port) gives its command line; its output goes
    to `log` (an open file), else nowhere."""

    def __init__(self, command, what: str, log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or open(os.devnull, "w")
        self.proc = start_healthy(command(self.port), self.url, self.log, what)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Server(HttpServer):
    """llama-server on a free local port, with its defaults plus model, threads, port."""

    def __init__(self, binary: Path, model_path: Path, threads: int, extra: list[str]):
        super().__init__(lambda port: [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port",
                                       str(port), "-t", str(threads), "--no-webui", *extra], "llama-server")

    def complete(self, prompt: str, n_predict: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                           "cache_prompt": True}).encode()
        req = urllib.request.Request(self.url + "/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        out["wall_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    def completions(self, prompts: list[str], n_predict: int, concurrent: bool) -> tuple[float, list[dict]]:
        """Every prompt completed, all at once or one after another: wall ms and the replies."""
        calls = [lambda p=p: self.complete(p, n_predict) for p in prompts]
        if concurrent:
            return at_once(calls)
        t0 = time.perf_counter()
        replies = [c() for c in calls]
        return (time.perf_counter() - t0) * 1e3, replies


def server_runs(args, prompts: list[str], gen: int) -> dict:
    out = {}
    for name, concurrent in (("server_seq", False), ("server_conc", True)):
        if name not in args.runs:
            continue
        server = Server(args.server, args.model_path, args.threads, args.server_args)
        try:
            total, replies = server.completions(prompts, gen, concurrent)
        finally:
            server.close()
        out[name] = {"total_ms": total, "prefill_ms": replies[0]["timings"]["prompt_ms"],
                     "prompt_tokens_evaluated": [r["timings"]["prompt_n"] for r in replies],
                     "mean_answer_ms": statistics.mean(r["wall_ms"] for r in replies),
                     "generated_tokens": sum(r["timings"]["predicted_n"] for r in replies),
                     "texts": [r["content"] for r in replies]}
    return out


def our_runs(args, model: Model, document: str, specs: list[BranchSpec]) -> dict:
    out = {}
    for mode in ("shared", "copy"):
        if f"ours_{mode}" not in args.runs:
            continue
        t0 = time.perf_counter()
        res = run_fanout(model, document, specs, mode=mode, cache=False, n_threads=args.threads)
        total = (time.perf_counter() - t0) * 1e3
        out[f"ours_{mode}"] = {
            "total_ms": total, "prefill_ms": res.prefill_ms,
            "mean_answer_ms": statistics.mean(b.ready_ms + b.activation_ms + b.decode_ms for b in res.branches),
            "generated_tokens": sum(len(b.token_ids) for b in res.branches),
            "texts": [b.text for b in res.branches], "prompts": [b.prompt_text for b in res.branches]}
    return out


def one_config(args, model, document, n: int, gen: int) -> dict:
    specs = [BranchSpec(QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})"),
                        max_tokens=gen) for i in range(n)]
    runs = our_runs(args, model, document, specs)
    prompts = [r.pop("prompts") for r in runs.values()][0]
    runs.update(server_runs(args, prompts, gen))

    def ratio(slow: str, fast: str):
        return runs[slow]["total_ms"] / runs[fast]["total_ms"] if slow in runs and fast in runs else None

    def same(a: str, b: str, strip: bool):
        if a not in runs or b not in runs:
            return None
        return sum((x.strip() == y.strip()) if strip else (x == y) for x, y in zip(runs[a]["texts"], runs[b]["texts"]))

    row = {"n": n, "gen": gen,
           **{f"{k}_total_ms": v["total_ms"] for k, v in runs.items()},
           **{f"{k}_prefill_ms": v["prefill_ms"] for k, v in runs.items()},
           **{f"{k}_mean_answer_ms": v["mean_answer_ms"] for k, v in runs.items()},
           # Answers of different lengths take different times: compare totals with these.
           **{f"{k}_generated_tokens": v["generated_tokens"] for k, v in runs.items()},
           "speedup_shared_vs_server_seq": ratio("server_seq", "ours_shared"),
           "speedup_shared_vs_server_conc": ratio("server_conc", "ours_shared"),
           "speedup_copy_vs_server_seq": ratio("server_seq", "ours_copy"),
           "texts_equal_shared_vs_server_seq": same("ours_shared", "server_seq", strip=True),
           "texts_equal_shared_vs_copy": same("ours_shared", "ours_copy", strip=False)}
    times = ", ".join(f"{k} {v['total_ms'] / 1e3:.1f} s" for k, v in runs.items())
    log(f"N={n:>2} gen={gen:>3}: {times} | shared/server-seq {row['speedup_shared_vs_server_seq'] or 0:.2f}x, "
        f"same text {row['texts_equal_shared_vs_server_seq']}/{n}")
    return {"row": row, "texts": {k: v["texts"] for k, v in runs.items()}}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gens = sorted({r["gen"] for r in rows})
    fig, axes = plt.subplots(1, len(gens), figsize=(5 * len(gens), 4), squeeze=False)
    for ax, gen in zip(axes[0], gens):
        rs = [r for r in rows if r["gen"] == gen]
        ns = [r["n"] for r in rs]
        for key, label in (("ours_shared", "ours, shared"), ("ours_copy", "ours, copy"),
                           ("server_seq", "llama-server, sequential"), ("server_conc", "llama-server, concurrent")):
            if f"{key}_total_ms" in rs[0]:
                ax.plot(ns, [r[f"{key}_total_ms"] / 1e3 for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("branches / requests (N)")
        ax.set_ylabel("end-to-end (s)")
        ax.set_title(f"{gen} tokens per answer")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=1565, help="document length in tokens (default 1565)")
    ap.add_argument("--n", default="1,2,4,8,16", help="branch counts (default 1,2,4,8,16)")
    ap.add_argument("--gen", default="8,32,128", help="answer lengths (default 8,32,128)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--server", type=Path, default=None,
                    help="llama-server binary (default: PREFIX/tools-stock/llama-server, stock llama.cpp from ./build_llama.sh --tools)")
    ap.add_argument("--server-arg", dest="server_args", action="append", default=[],
                    help="extra llama-server flag (repeatable); default: its own defaults")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"which sides to run, comma-separated (default all: {','.join(RUNS)}); "
                         "ratios need both of their sides")
    ap.add_argument("--out", type=Path, default=Path("bench/results/peer"))
    args = ap.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown or not any(r.startswith("ours_") for r in args.runs):
        ap.error(f"--runs: unknown {unknown}; choose from {','.join(RUNS)}, at least one ours_*")
    args.server = server_binary(args.server, "swarmkv bench peer")
    if args.server is None:
        return 2
    args.model_path = catalog.resolve(args.model)
    ns, gens = [int(x) for x in args.n.split(",")], [int(x) for x in args.gen.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, texts = [], {}
    with Model(args.model_path) as model:
        document = document_of(model, args.tokens)
        # llama-server warms up at load (one decode before it reports healthy); do the same,
        # or the first configuration's run pays for page faults the server never shows.
        run_fanout(model, document_of(model, 600), [BranchSpec(QUESTIONS[0], max_tokens=4)],
                   cache=False, n_threads=args.threads)
        for gen in gens:
            for n in ns:
                result = one_config(args, model, document, n, gen)
                rows.append(result["row"])
                texts[f"n{n}_gen{gen}"] = result["texts"]
                report = {"model": args.model, "document_tokens": args.tokens, "argv": sys.argv,
                          "rows": rows, "texts": texts}
                write_result(args.out / "peer.json", report, settings_of(args, FanoutConfig(n_threads=args.threads)))
                with open(args.out / "peer.csv", "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
    plot(rows, args.out / "peer.png")
    log(f"wrote {args.out}/peer.json, peer.csv, peer.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
