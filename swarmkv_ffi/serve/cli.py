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
import ipaddress
import logging
import sys
import threading
import time
from pathlib import Path

from .. import catalog
from ..conductor.policy import Policy
from .keys import Keys

log = logging.getLogger("swarmkv.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmkv serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=catalog.DEFAULT_MODEL,
                   help="a packaged short name or a path to a .gguf file (default: %(default)s)")
    p.add_argument("--name", default=None, help="the model id clients send (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: libllama's)")
    p.add_argument("--ctx-size", type=int, default=32768,
                   help="KV cells of the pool: every running request's prompt + max_tokens and the "
                        "cached prefixes share them (default: 32768)")
    p.add_argument("--parallel", type=int, default=64,
                   help="sequences in the pool: requests running plus kept prefixes (default: 64)")
    p.add_argument("--exact", action="store_true",
                   help="batch-invariant kernels: a request's answer does not depend on what else runs")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY)")
    keys.add_argument("--api-key-file", type=Path, default=None,
                      help="one key per line (optionally followed by a name): each key is a principal "
                           "with its own fair share, quota and cache")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="keep prefixes that requests share (256 tokens or more) in this prefix-cache "
                        "folder, so a restarted server restores them instead of prefilling "
                        "(default: off; each key's prefixes apart; a full or read-only folder only "
                        "logs a warning)")
    p.add_argument("--share-prefixes", action="store_true",
                   help="let every key reuse every key's cached prefixes (off: a cached prefix's speed "
                        "would tell one key what another asked)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="max_tokens of a chat request that sends none (default: 1024)")
    p.add_argument("--max-requests", type=int, default=256,
                   help="choices running or queued at once, all keys (default: 256; more get 503)")
    p.add_argument("--max-requests-per-key", type=int, default=64,
                   help="choices running or queued at once per key (default: 64; more get 429)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body (default: 8 MiB)")
    p.add_argument("--budget-bytes", type=int, default=None,
                   help="memory the server may book (default: 90%% of the host's, less what others use)")
    p.add_argument("--allow-remote-without-key", action="store_true",
                   help="listen on a non-loopback address with no API key (anyone who reaches it may use it)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="libllama's log (-vv: uvicorn's access log)")
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


def check_args(args) -> Keys:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.ctx_size < 512:
        raise ValueError(f"--ctx-size must be at least 512 cells, got {args.ctx_size}")
    if args.default_max_tokens < 1 or args.max_requests < 1 or args.max_requests_per_key < 1:
        raise ValueError("--default-max-tokens, --max-requests and --max-requests-per-key must be >= 1")
    if args.max_body_bytes < 1024:
        raise ValueError("--max-body-bytes must be at least 1024")
    if args.replicas < 1 or args.route_imbalance < 1:
        raise ValueError("--replicas and --route-imbalance must be >= 1")
    if args.ray is not None and args.cache_dir is not None:
        raise ValueError("--cache-dir is per machine; with --ray each replica keeps its prefixes in its pool")
    return keys_for(args.host, args.api_key, args.api_key_file, args.allow_remote_without_key)


def engine_options(args) -> dict:
    """The ServeEngine settings the flags ask for (one server, or each --ray replica).
    One key alone gets whole n_batch steps, as llama-server's slots do; between keys
    lmxd's fair budget applies."""
    return dict(cells=args.ctx_size, seqs=args.parallel, threads=args.threads, exact=args.exact,
                share_prefixes=args.share_prefixes, budget_bytes=args.budget_bytes,
                max_requests=args.max_requests, max_per_principal=args.max_requests_per_key,
                policy=Policy(lone_step_seconds=None))


def keys_for(host: str, key: str | None, key_file: Path | None, allow_remote: bool = False) -> Keys:
    """The keys to require; none only on a loopback address (unless allowed)."""
    if key is not None:
        if len(key) < 8:
            raise ValueError("an API key must be at least 8 characters")
        keys = Keys({key: "key1"})
    elif key_file is not None:
        keys = Keys.from_file(key_file)
    else:
        keys = Keys()
    if not keys.required and not is_loopback(host) and not allow_remote:
        raise ValueError(f"{host} is reachable from other machines and no API key is set; "
                         "pass an API key file (or allow it explicitly)")
    return keys


def uvicorn_config(app, host: str, port: int, max_requests: int, verbose: int):
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level="info" if verbose > 1 else "warning",
                          access_log=verbose > 1, limit_concurrency=max_requests + 64,
                          timeout_keep_alive=5, timeout_graceful_shutdown=5)


class Front:
    """The HTTP front on lmxd's conductor (lmxd --http): uvicorn on a thread of its own
    beside the Unix socket's; stop() ends it once the daemon has drained."""

    def __init__(self, conductor, model: str, host: str, port: int, keys: Keys, *, cells: int, seqs: int,
                 exact: bool, share_prefixes: bool, name: str | None = None, cache_dir: Path | None = None):
        import uvicorn

        from .app import create_app
        from .engine import ServeEngine
        self.engine = ServeEngine(model, cells=cells, seqs=seqs, exact=exact, share_prefixes=share_prefixes,
                                  conductor=conductor, cache_dir=cache_dir)
        app = create_app(self.engine, name or model, keys)
        self.server = uvicorn.Server(uvicorn_config(app, host, port, self.engine.max_requests, 0))
        self.thread = threading.Thread(target=self.server.run, name="lmxd-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                self.engine.close()
                raise OSError(f"the HTTP front could not listen on {host}:{port} (see the log above)")
            time.sleep(0.05)
        log.info("HTTP front: %s on http://%s:%d/v1", name or model, host, port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .app import create_app
    from .engine import ServeEngine
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("swarmkv_ffi.llama").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
    keys = check_args(args)
    if args.ray is not None:
        from .on_ray import run
        return run(args, keys.mapping())
    name = args.name or args.model
    engine = ServeEngine(args.model, **engine_options(args), cache_dir=args.cache_dir)
    app = create_app(engine, name, keys, args.max_body_bytes, args.default_max_tokens)
    server = uvicorn.Server(uvicorn_config(app, args.host, args.port, args.max_requests, args.verbose))
    mode = "exact" if args.exact else "fast"
    print(f"swarmkv serve: {name} ({engine.base.path.name}, {mode} mode, {args.ctx_size} cells, "
          f"{args.parallel} sequences) on http://{args.host}:{args.port}/v1"
          f"{'' if keys.required else ' (no API key)'}", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
