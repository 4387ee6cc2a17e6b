"""`swarmkv serve`: an OpenAI-compatible server that shares every common prefix.

Agents that speak the OpenAI API (the `openai` client, LangChain, agent SDKs) send it
chat or completion requests as they would to any endpoint. Requests that start with the
same tokens (a document as the system message, a conversation's earlier turns, the n
choices of one request) share their KV cells in one pool: only what is new is decoded,
and the requests decoding together read a shared document's cells once per step.
docs/serve.md says more.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from . import settings as server_settings
from .lineup import FOREVER
from .settings import Settings

log = logging.getLogger("swarmkv.serve")


def batch_size(text: str) -> int:
    """--batch-size's value: a whole number of tokens, at least one."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: a step carries at least one token")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmkv serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    server_settings.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, or several comma-separated (127.0.0.1,::1), as llama-server's "
                        "(default: loopback)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: libllama's)")
    p.add_argument("-b", "--batch-size", type=batch_size, default=512, metavar="N",
                   help="the most tokens one step carries, as llama-server's: a long prompt is read N at a time "
                        "(return_progress reports each), and with more than N requests generating, those that "
                        "have generated the most wait a step (default: 512)")
    p.add_argument("--budget-bytes", type=int, default=None,
                   help="memory the server may book (default: 90%% of the host's, less what others use)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="libllama's log, and every whole answer carries llama-server's __verbose (the prompt as "
                        "the model read it); -vv: uvicorn's access log too")
    ray = p.add_argument_group("on a Ray cluster (the 'distributed' extra; docs/cluster.md)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="serve from Ray Serve replicas: a cluster's address (ray start --head prints "
                          "it), or none to start Ray on this machine (127.0.0.1 only)")
    ray.add_argument("--replicas", type=int, default=2,
                     help="engine replicas, each on --threads CPUs of its node (default: 2)")
    ray.add_argument("--route", choices=["prefix", "load"], default="prefix",
                     help="send a request to the replica that holds the longest prefix of it (default), "
                          "or by load alone (Serve's default router)")
    ray.add_argument("--route-imbalance", type=int, default=16,
                     help="route by load instead of prefix while the replicas' queues differ by more "
                          "than this many requests (default: 16)")
    return p


def check_args(args, settings: Settings):
    """The keys to require, once every flag is known to make sense."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    settings.check()
    if args.replicas < 1 or args.route_imbalance < 1:
        raise ValueError("--replicas and --route-imbalance must be >= 1")
    if args.ray is not None and "," in args.host:
        raise ValueError("--ray listens on one address; give --host one")
    if args.ray is not None and settings.cache_dir is not None:
        raise ValueError("--cache-dir is per machine; with --ray each replica keeps its prefixes in its pool")
    return settings.keys(args.host)


def main(argv: list[str] | None = None) -> int:
    from .app import create_app
    from .engine import ServeEngine
    from .http import listening, server, uvicorn_config
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("swarmkv_ffi.llama").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
    settings = Settings.from_args(args)
    if args.verbose:                    # llama-server's --verbose shows each answer's __verbose too
        settings = dataclasses.replace(settings, verbose_answers=True)
    keys = check_args(args, settings)
    if args.ray is not None:
        from .on_ray import run
        return run(args, settings, keys.mapping())
    if os.environ.get("AIP_MODE") == "PREDICTION" and os.environ.get("AIP_HTTP_PORT"):
        args.port = int(os.environ["AIP_HTTP_PORT"])     # Vertex AI says where to listen (serve/vertex.py)
    engine = ServeEngine(settings, keys, threads=args.threads, budget_bytes=args.budget_bytes,
                         batch_size=args.batch_size)
    app = create_app(engine, keys, settings)
    hosts = [h.strip() for h in args.host.split(",")]
    http = server(engine, uvicorn_config(app, hosts[0], args.port, settings, args.verbose))
    where = ", ".join(f"http://{f'[{h}]' if ':' in h else h}:{args.port}/v1" for h in hosts)
    announce(engine, settings, where + ("" if keys.required else " (no API key)"))
    try:
        http.run(sockets=listening(hosts, args.port) if len(hosts) > 1 else None)
    finally:
        engine.close()
    return 0


def announce(engine, settings: Settings, where: str) -> None:
    """The startup log: each model loaded, its size and why, where its evicted prefixes
    go; each model loaded on demand and how long it stays."""
    def say(line: str) -> None:
        print(f"swarmkv serve: {line}", file=sys.stderr, flush=True)
    below = f", then to {settings.cache_dir}" if settings.cache_dir is not None else ""
    for entry in engine.models.entries:
        names, spec, hosted = ", ".join(entry.names), entry.spec, entry.hosted
        if hosted is None:
            stay = "until its memory is needed" if spec.keep_alive == FOREVER else f"{spec.keep_alive:g} s idle"
            say(f"{names} ({spec.model}): loaded on its first request, kept {stay}")
            continue
        tier, mode = hosted.host_tier, "exact" if spec.exact else "fast"
        say(f"{names} ({hosted.pool.path.name}, {mode} mode, {hosted.cells} cells, {spec.parallel} sequences"
            f"{', pinned' if spec.pinned else ''})")
        if hosted.sized is not None:
            say(f"  --ctx-size {hosted.sized.cells}: {hosted.sized.why}")
        say(f"  evicted prefixes go to host RAM ({tier.limit >> 20} MiB, --host-cache-mib){below}" if tier is not None
            else f"  evicted prefixes are dropped from host RAM (--host-cache-mib 0){below}")
    say(f"on {where}")


if __name__ == "__main__":
    sys.exit(main())
