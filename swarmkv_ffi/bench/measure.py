"""Measuring helpers shared by the benchmarks: peak RSS while a function runs, documents
of an exact token length, and the machine's name for result folders."""
from __future__ import annotations

import collections
import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from ..procmem import rss_bytes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class PeakRSS:
    """Samples this process's RSS every `interval` seconds while in the `with` block;
    `.peak_delta` is the highest RSS seen minus the RSS at entry."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.start, self.peak = interval, 0, 0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def peak_delta(self) -> int:
        return self.peak - self.start


class Peaks(threading.Thread):
    """Calls `read()` ({name: value}) every `interval` seconds while in the `with` block;
    `.most[name]` is the highest value seen (0 if never read), `.samples` how many reads."""

    def __init__(self, read, interval: float = 0.2):
        super().__init__(daemon=True)
        self.read, self.interval, self._done = read, interval, threading.Event()
        self.most: dict[str, float] = collections.defaultdict(float)
        self.samples = 0

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self.join()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            for name, value in self.read().items():
                self.most[name] = max(self.most[name], value)
            self.samples += 1


def document_of(model, n_tokens: int, source: str | None = None) -> str:
    """Real text of about `n_tokens` tokens: the example licences, repeated if needed, cut
    at a token boundary."""
    text = source or "\n\n".join((EXAMPLES / name).read_text() for name in ("gpl-3.0.txt", "apache-2.0.txt"))
    tokens = model.tokenize(text, add_special=False)
    repeats = -(-n_tokens // len(tokens))
    return model.detokenize(np.tile(tokens, repeats)[:n_tokens])


def at_once(calls) -> tuple[float, list]:
    """Run every call in its own thread, started together; wall ms and their results."""
    out = [None] * len(calls)

    def one(i):
        out[i] = calls[i]()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3, out


def decode_tps(res) -> float:
    """A fan-out's generated tokens per second after its prefill (branch prompts included)."""
    tokens = sum(len(b.token_ids) for b in res.branches)
    return tokens / ((res.total_ms - res.prefill_ms) / 1e3)


def decode_loop(branches) -> dict:
    """The batched decode loop alone, as llama-batched-bench's tg phase counts it: the tokens
    after each branch's first (the first comes from its prompt), over the time from the
    moment every branch had its first token to the last token (BranchResults)."""
    first = [b.ready_ms + b.activation_ms for b in branches]
    last = [f + b.decode_ms for f, b in zip(first, branches)]
    tokens = sum(max(0, len(b.token_ids) - 1) for b in branches)
    ms = max(last) - max(first)
    return {"tokens": tokens, "ms": ms, "tokens_per_s": tokens / (ms / 1e3) if ms > 0 else 0.0}


def cpu_name() -> str:
    """A folder-friendly name of this machine's CPU."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    keep = "".join(c if c.isalnum() else "-" for c in name)
    return "-".join(p for p in keep.split("-") if p)[:48]


QUESTIONS = [
    "What does this document cover?",
    "Can I sell copies of the software?",
    "What must I do when I distribute copies?",
    "What happens if I violate the terms?",
    "Does this grant any patent rights?",
    "Can I modify the software?",
    "What is the warranty?",
    "Who is liable for damages?",
    "What is the source code?",
    "Can I combine this with other software?",
    "What is a derivative work?",
    "How do I apply these terms to my program?",
    "Can the license be revoked?",
    "What are the conditions for conveying copies?",
    "Does this cover installation information?",
    "What is the definition of a covered work?",
]


def machine() -> dict:
    """The machine a result was measured on."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "arch": platform.machine(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def settings_of(args, config=None) -> dict:
    """A benchmark's settings for its result file: its command-line options, and the
    fan-out settings (FanoutConfig) it ran with, threads resolved to the number used."""
    out = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if config is not None:
        out["fanout"] = {**config.as_dict(), "n_threads": config.threads}
    return out


def add_threads(ap) -> None:
    """--threads, the same flag in every benchmark (None: all of this machine's CPUs)."""
    ap.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads for decoding (default: all of this machine's)")


def report_json(report: dict, out: Path | None, settings: dict, shown: dict | None = None) -> dict:
    """Print a benchmark's figures (or the `shown` part of them) and write them to `out`
    with the settings they ran with, the libllama build and the machine, so two result
    files can be compared (or shown not to be comparable). Returns what was written."""
    full = write_result(out, report, settings)
    print(json.dumps(full if shown is None else shown, indent=2))
    return full


def write_result(out: Path | None, report: dict, settings: dict) -> dict:
    """`report` with its settings, the libllama build and the machine, written to `out`
    (if given) as JSON; returns what was written."""
    from .. import library
    full = {"settings": settings, "build": library.build_info(), "machine": machine(), **report}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(full, indent=2) + "\n")
    return full
