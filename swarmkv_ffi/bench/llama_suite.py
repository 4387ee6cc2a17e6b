"""`swarmkv bench llama-suite`: llama.cpp's own server tests, unmodified, against both servers.

llama.cpp ships a pytest suite for llama-server (`tools/server/tests/unit` in the source we
build from). Its `utils.ServerProcess` starts whatever binary `LLAMA_SERVER_BIN_PATH` names
with llama-server's flags, then talks HTTP to it. This runs that suite twice over the same
model file: once with the stock llama-server of our pin, once with `swarmkv serve`, through
one shim binary that reads llama-server's flags and starts the chosen server:

    model flags (--hf-repo, --hf-file, --model, --model-url)   -> the one model file (--model)
    --alias -> --name, --n-predict -> --default-max-tokens     (ours; same meaning)
    any other flag `swarmkv serve` knows                       -> passed on as is
    no --metrics (llama-server's /metrics is off by default)   -> --no-metrics (ours is on)
    --parallel (slots there; ours serves any number at once)   -> dropped, and logged
    the rest (--ubatch-size, --ctx-checkpoints, ...)           -> dropped, and logged

The suite downloads its tiny test models from Hugging Face; both servers get the one file
given here instead (SmolLM2-135M by default), so tests whose assertions depend on the tiny
models' text fail on both sides alike. What counts is the comparison: a test that passes on
llama-server and fails on ours is a gap. Output: suite.json (every test's outcome on each
side) and a summary on stdout. The suite needs its own test dependencies:
`pip install wget filelock` besides pytest, requests and openai.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from .. import catalog, library
from .measure import settings_of, write_result

SERVERS = ("llama-server", "ours")
MODEL_FLAGS = {"--hf-repo", "-hf", "--hf-file", "-hff", "--model", "-m", "--model-url", "-mu"}
RENAMED = {"--alias": "--name", "--n-predict": "--default-max-tokens"}
SAME_NAME_OTHER_MEANING = {"--parallel", "-np"}     # slots there; sequences incl. kept prefixes here
#: Off by default on llama-server, on by default on ours: the flag that turns ours off when absent.
OFF_UNLESS_GIVEN = {"--metrics": "--no-metrics"}
SWITCHES = {"--offline", "--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified",
            "--swa-full", "--slots", "--no-slots", "--verbose", "--context-shift", "--no-ui",
            "--no-models-autoload", "--jinja", "--no-jinja", "--no-mmproj", "--no-cache-idle-slots",
            "--ui-mcp-proxy", "--backend_sampling"}


def suite_dir() -> Path:
    """llama.cpp's server tests in the source `./build_llama.sh` unpacked."""
    cache = library.cache_dir()
    version = (library.read_manifest() or {}).get("source", "").rpartition("==")[2]
    tests = cache / f"src-{version}" / "tools" / "server" / "tests"
    if not version or not tests.is_dir():
        raise SystemExit(f"llama-suite: {tests} not found; run ./build_llama.sh first")
    return tests


# ---- the shim: llama-server's command line in, one of the two servers out -------------

def split_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """llama-server's argv as (flag, value) pairs; switches have value None."""
    pairs, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in SWITCHES or i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            pairs.append((flag, None))
            i += 1
        else:
            pairs.append((flag, argv[i + 1]))
            i += 2
    return pairs


def ours_knows() -> set[str]:
    """Every option string `swarmkv serve` accepts."""
    from ..serve.cli import build_parser
    return {s for action in build_parser()._actions for s in action.option_strings}


def command_for(server: str, model: str, argv: list[str]) -> tuple[list[str], list[str]]:
    """The command that starts `server` for llama-server's `argv`, and the flags dropped."""
    pairs = [(f, v) for f, v in split_flags(argv) if f not in MODEL_FLAGS]
    if server == "llama-server":
        cmd = [str(library.tool_path("llama-server")), "--model", model]
        for flag, value in pairs:
            cmd += [flag] if value is None else [flag, value]
        return cmd, []
    known, cmd, dropped = ours_knows(), [sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--model", model], []
    for flag, value in pairs:
        flag = RENAMED.get(flag, flag)
        if flag not in known or flag in SAME_NAME_OTHER_MEANING:
            dropped.append(flag)
        else:
            cmd += [flag] if value is None else [flag, value]
    given = {flag for flag, _ in pairs}
    cmd += [off for flag, off in OFF_UNLESS_GIVEN.items() if flag not in given]
    return cmd, dropped


def shim(argv: list[str]) -> int:
    """Run as the suite's llama-server: exec the server LLAMA_SUITE_SERVER names."""
    cmd, dropped = command_for(os.environ["LLAMA_SUITE_SERVER"], os.environ["LLAMA_SUITE_MODEL"], argv)
    if dropped:
        print(f"llama-suite shim: dropped {' '.join(dropped)} (no equivalent)", file=sys.stderr, flush=True)
    print(f"llama-suite shim: {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


# ---- the runner -------------------------------------------------------------------------

def workspace(tests: Path, root: Path) -> Path:
    """A copy of the suite at the same depth as in llama.cpp's tree (its tests open
    ../../../models/templates), with the shim beside it."""
    work = root / "tools" / "server" / "tests"
    shutil.copytree(tests, work, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    (root / "models").symlink_to(tests.parents[2] / "models")
    binary = root / "server-shim"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} -m swarmkv_ffi.bench.llama_suite --shim \"$@\"\n")
    binary.chmod(0o755)
    return work


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
        result[name] = status
    return result


def run_suite(server: str, work: Path, model: Path, files: list[str], marks: str, log: Path) -> dict[str, str]:
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(work.parents[2] / "server-shim"),
           "LLAMA_SUITE_SERVER": server, "LLAMA_SUITE_MODEL": str(model), "LLAMA_CACHE": "tmp"}
    junit = log.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-m", marks, "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "addopts=", *[f"unit/{f}" for f in files]]
    print(f"llama-suite: {server}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    return outcomes(junit) if junit.exists() else {}


def compare(results: dict[str, dict[str, str]]) -> dict:
    theirs, ours = results.get("llama-server", {}), results.get("ours", {})
    names = sorted(set(theirs) | set(ours))
    passed = {s: sum(r.get(n) == "passed" for n in names) for s, r in results.items()}
    return {"tests": len(names), "passed": passed,
            "llama_server_only": [n for n in names if theirs.get(n) == "passed" and ours.get(n) != "passed"],
            "ours_only": [n for n in names if ours.get(n) == "passed" and theirs.get(n) != "passed"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--shim"]:
        return shim(argv[1:])
    p = argparse.ArgumentParser(prog="swarmkv bench llama-suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="test files of tools/server/tests/unit (default: all)")
    p.add_argument("--model", default="smollm2-135m", help="the model both servers serve (default: smollm2-135m)")
    p.add_argument("--servers", default=",".join(SERVERS), help="which to run (default: both)")
    p.add_argument("-m", dest="marks", default="not slow", help="pytest marker expression (default: not slow)")
    p.add_argument("--out", type=Path, default=Path("bench-out/llama-suite"))
    args = p.parse_args(argv)
    for needed in ("wget", "filelock", "requests", "openai"):
        try:
            __import__(needed)
        except ImportError:
            raise SystemExit(f"llama-suite: llama.cpp's tests need `{needed}`: pip install wget filelock requests openai")
    tests, model = suite_dir(), catalog.resolve(args.model)
    files = args.files or sorted(p.name for p in (tests / "unit").glob("test_*.py"))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="llama-suite-") as root:
        work = workspace(tests, Path(root))
        for server in args.servers.split(","):
            results[server] = run_suite(server, work, model, files, args.marks, args.out / f"{server}.log")
            print(f"llama-suite: {server}: {sum(v == 'passed' for v in results[server].values())} of "
                  f"{len(results[server])} passed", flush=True)
    summary = compare(results)
    print(json.dumps({k: summary[k] for k in ("tests", "passed", "llama_server_only", "ours_only")}, indent=1))
    write_result(args.out / "suite.json", {"files": files, "summary": summary, "results": results},
                 settings_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
