"""uvicorn, as both fronts run it: `swarmkv serve` in the foreground, lmxd --http on a thread.

One uvicorn configuration for both (limits, keep-alive, graceful stop); `Front`, the
HTTP front on a conductor that something else owns (lmxd's): the served model's engine
and app on that conductor, uvicorn on a thread of its own beside the daemon's socket;
and `LmxdFront`, what lmxd's main() hands the daemon: the --http flags (settings.py's, named
--http-*) and the start of a Front when --http is given.
"""
from __future__ import annotations

import argparse
import logging
import socket
import threading
import time

from . import guard
from .app import create_app
from .engine import ServeEngine
from .settings import Settings, add_arguments

log = logging.getLogger("swarmkv.serve")


#: Seconds a stopping server lets running requests finish before it ends them with an
#: error event; uvicorn then has GRACE_S more to send those last events.
GRACE_S = 5


def server(engine: ServeEngine, config):
    """A uvicorn.Server that drains first: on SIGINT/SIGTERM the engine takes no new
    request and /health says draining while the server still listens; running requests
    finish (or are ended with an error after GRACE_S); then uvicorn stops. A second
    signal stops at once."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if engine.stopping:
                return super().handle_exit(sig, frame)
            engine.drain()
            log.info("stopping: draining the running requests (again to stop now)")
            threading.Thread(target=self._exit_when_drained, args=(sig, frame), daemon=True).start()

        def _exit_when_drained(self, sig, frame) -> None:
            engine.wait_drained(GRACE_S)
            super().handle_exit(sig, frame)
    return Draining(config)


def uvicorn_config(app, host: str, port: int, settings: Settings, verbose: int):
    """No limit_concurrency (idle sockets counted in it locked everyone out; the engine's
    admission caps the work), and guard.py's deadlines on a request's headers and on an
    answer left unread."""
    import uvicorn
    guard.raise_open_files_limit()
    return uvicorn.Config(app, host=host, port=port, log_level="info" if verbose > 1 else "warning",
                          access_log=verbose > 1, limit_concurrency=None,
                          http=guard.protocol(settings.read_timeout, settings.idle_connections_per_address,
                                              send_timeout=settings.send_timeout,
                                              max_body_bytes=settings.max_body_bytes),
                          timeout_keep_alive=5, timeout_graceful_shutdown=GRACE_S)


def listening(hosts: list[str], port: int) -> list[socket.socket]:
    """A socket bound to `port` on each address, for uvicorn to serve on all of them (its
    Config takes one host); an IPv6 one takes IPv6 only, so 0.0.0.0 and :: can go together."""
    out = []
    try:
        for host in hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
    except OSError as exc:
        for sock in out:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return out


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
        app = create_app(self.engine, keys, self.engine.settings)
        self.server = server(self.engine, uvicorn_config(app, host, port, settings, 0))
        self.thread = threading.Thread(target=self.server.run, name="lmxd-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                self.engine.close()
                raise OSError(f"the HTTP front could not listen on {host}:{port} (see the log above)")
            time.sleep(0.05)
        log.info("HTTP front: %s on http://%s:%d/v1", settings.served_names, host, port)

    def stop(self) -> None:
        self.engine.drain()
        self.engine.wait_drained(GRACE_S)
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


class LmxdFront:
    """lmxd.server.Front: the OpenAI API beside lmxd's socket, on its conductor."""
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
