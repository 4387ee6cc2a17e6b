"""uvicorn, as both fronts run it: `swarmkv serve` in the foreground, lmxd --http on a thread.

One uvicorn configuration for both (limits, keep-alive, graceful stop); `Front`, the
HTTP front on a conductor that something else owns (lmxd's): the served model's engine
and app on that conductor, uvicorn on a thread of its own beside the daemon's socket;
and `LmxdFront`, what lmxd.py hands the daemon: the --http flags (settings.py's, named
--http-*) and the start of a Front when --http is given.
"""
from __future__ import annotations

import argparse
import logging
import threading
import time

from .app import create_app
from .engine import ServeEngine
from .settings import Settings, add_arguments

log = logging.getLogger("swarmkv.serve")


def uvicorn_config(app, host: str, port: int, max_requests: int, verbose: int):
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level="info" if verbose > 1 else "warning",
                          access_log=verbose > 1, limit_concurrency=max_requests + 64,
                          timeout_keep_alive=5, timeout_graceful_shutdown=5)


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT, checked."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise ValueError(f"--http takes HOST:PORT, got {address!r}")
    return host, int(port)


class Front:
    """The OpenAI API on `conductor` at `address` (HOST:PORT), as `settings` say; stop()
    ends it once the conductor's owner has drained."""

    def __init__(self, conductor, settings: Settings, address: str):
        import uvicorn
        host, port = parse_address(address)
        settings.check()
        keys = settings.keys(host)
        self.engine = ServeEngine(settings, keys, conductor=conductor)
        app = create_app(self.engine, keys, settings)
        self.server = uvicorn.Server(uvicorn_config(app, host, port, settings.max_requests, 0))
        self.thread = threading.Thread(target=self.server.run, name="lmxd-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                self.engine.close()
                raise OSError(f"the HTTP front could not listen on {host}:{port} (see the log above)")
            time.sleep(0.05)
        log.info("HTTP front: %s on http://%s:%d/v1", settings.served_name, host, port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


class LmxdFront:
    """conductor.server.Front: the OpenAI API beside lmxd's socket, on its conductor."""
    prefix = "http-"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("the HTTP front (OpenAI-compatible, as swarmkv serve; docs/serve.md)")
        group.add_argument("--http", default=None, metavar="HOST:PORT",
                           help="also serve the OpenAI API here, on this daemon's engine and ledger "
                                "(the --http-* flags are swarmkv serve's, for it)")
        add_arguments(group, self.prefix)

    def start(self, args: argparse.Namespace, conductor) -> Front | None:
        if args.http is None:
            return None
        return Front(conductor, Settings.from_args(args, self.prefix), args.http)
