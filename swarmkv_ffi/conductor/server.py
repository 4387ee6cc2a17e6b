"""lmxd: the conductor daemon on a Unix socket.

One thread per client connection. DECODEs queue in arrival order on the compute slot;
STATUS, LIST and HELP never wait for it. The socket is created with mode 0600 and every
peer's uid is checked (SO_PEERCRED). Lines longer than the cap are answered with
LINE_TOO_LONG and skipped without being stored. SIGTERM/SIGINT stop the daemon cleanly
and remove the socket; a stale socket file is reclaimed, a live daemon's is not.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

from ..errors import SwarmKVError
from . import protocol
from .agents import Conductor, ConductorError
from .estimate import load_table
from .ledger import Ledger, LedgerDenied
from .memory import DeviceMemory

log = logging.getLogger("lmxd")
DEFAULT_LINE_CAP = 64 * 1024


class DaemonError(SwarmKVError):
    """lmxd cannot start (socket path taken, bad flags)."""


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def client_gone(conn: socket.socket) -> bool:
    """True once the peer has closed its end (readable, and a peek reads nothing)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def bind_socket(path: Path, mode: int = 0o600) -> socket.socket:
    """Bind `path` with `mode`: reclaim a stale socket, refuse a live one or a non-socket."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise DaemonError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers: a stale socket from a daemon that died
        else:
            raise DaemonError(f"another lmxd is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is born 0600: no window where others may connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(64)
    return sock


class Server:
    def __init__(self, socket_path: Path, conductor: Conductor, memory: DeviceMemory,
                 allow_uids: set[int] | None = None, line_cap: int = DEFAULT_LINE_CAP):
        self.path, self.conductor, self.memory = Path(socket_path), conductor, memory
        self.allowed = {os.getuid()} | set(allow_uids or ())
        self.line_cap = line_cap
        self.started = time.time()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()

    # ---- lifecycle ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        # Other allowed users need the file to be reachable; SO_PEERCRED is then the gate.
        self._sock = bind_socket(self.path, 0o600 if self.allowed == {os.getuid()} else 0o666)
        log.info("listening on %s (budget %d bytes, %s)", self.path, self.conductor.ledger.limit(),
                 self.memory.reading.source)
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([self._sock], [], [], 0.2)
                if not readable:
                    continue
                conn, _ = self._sock.accept()
                t = threading.Thread(target=self._serve_client, args=(conn,), daemon=True)
                self._threads.add(t)
                t.start()
        finally:
            self._sock.close()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            log.info("stopped; socket removed")

    def stop(self, *_signal) -> None:
        self._stop.set()

    # ---- one client ----------------------------------------------------------------------------
    def _serve_client(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
            if uid not in self.allowed:
                log.warning("refused connection from uid %d", uid)
                conn.sendall(protocol.err("FORBIDDEN", f"uid {uid} may not use this daemon").encode())
                return
            reader = conn.makefile("rb")
            while not self._stop.is_set():
                line = reader.readline(self.line_cap + 1)
                if not line:
                    return
                if len(line) > self.line_cap and not line.endswith(b"\n"):
                    self._skip_line(reader)
                    self._send(conn, protocol.err("LINE_TOO_LONG", f"line exceeds {self.line_cap} bytes"))
                    log.info("- - LINE_TOO_LONG 0.0ms")
                    continue
                if not self._send(conn, self._answer(line.rstrip(b"\n"), conn)):
                    return
        except OSError:
            pass
        finally:
            conn.close()
            self._threads.discard(threading.current_thread())

    def _skip_line(self, reader) -> None:
        """Discard the rest of an over-long line, chunk by chunk, storing none of it."""
        while True:
            chunk = reader.readline(self.line_cap)
            if not chunk or chunk.endswith(b"\n"):
                return

    @staticmethod
    def _send(conn: socket.socket, text: str) -> bool:
        try:
            conn.sendall(text.encode("utf-8"))
            return True
        except OSError:
            return False

    def _answer(self, line: bytes, conn: socket.socket) -> str:
        t0 = time.perf_counter()
        verb, agent, result = "-", "-", "OK"
        try:
            req = protocol.parse(line)
            verb, agent = req.verb, req.args.get("agent_id", "-")
            reply = self._dispatch(req, conn)
        except protocol.ProtocolError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except ConductorError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except LedgerDenied as exc:
            result, reply = "VRAM_LEDGER_DENY", f"ERR {exc}\n"
        except Exception as exc:  # the daemon outlives any one request
            log.exception("internal error on %s", verb)
            result, reply = "INTERNAL", protocol.err("INTERNAL", f"{type(exc).__name__}: {exc}")
        log.info("%s %s %s %.1fms", verb, agent, result, (time.perf_counter() - t0) * 1e3)
        return reply

    # ---- verbs -----------------------------------------------------------------------------------
    def _dispatch(self, req: protocol.Request, conn: socket.socket) -> str:
        c, a = self.conductor, req.args
        if req.verb == "HELP":
            return protocol.help_reply()
        if req.verb == "STATUS":
            return self._status()
        if req.verb == "LIST":
            return self._list()
        if req.verb == "REGISTER":
            agent = c.register(a["agent_id"], a["model"], a["n_ctx"])
            e = agent.estimate
            return protocol.ok("REGISTER", [
                protocol.kv(estimate_bytes=e.total, weights_bytes=e.weights, kv_bytes=e.kv,
                            compute_bytes=e.compute, estimate_source=e.source),
                protocol.kv(reserved_bytes=c.ledger.held(f"agent:{agent.id}"),
                            measured_context_bytes=agent.measured_bytes,
                            model_refcount=agent.loaded.refs, shared_weights=agent.loaded.refs > 1),
                protocol.kv(ledger_max_bytes=c.ledger.limit(), ledger_allocated_bytes=c.ledger.allocated),
            ], agent_id=agent.id, model=str(agent.path), n_ctx=agent.n_ctx)
        if req.verb == "UNREGISTER":
            agent = c.unregister(a["agent_id"])
            return protocol.ok("UNREGISTER", [protocol.kv(ledger_allocated_bytes=c.ledger.allocated)],
                               agent_id=agent.id)
        if req.verb == "RESET":
            c.reset(a["agent_id"])
            return protocol.ok("RESET", [], agent_id=a["agent_id"])
        if req.verb == "DECODE":
            r = c.decode(a["agent_id"], a["max_tokens"], a["prompt"], should_stop=lambda: client_gone(conn))
            return protocol.ok("DECODE", [
                protocol.kv(prompt_tokens=r.prompt_tokens, generated_tokens=r.generated_tokens,
                            stopped_on_eos=r.stopped_on_eos),
                protocol.kv(elapsed_ms=r.elapsed_ms),
                protocol.kv(kv_swap_evicted=r.evicted, kv_swap_restored=r.restored),
            ], body=r.text, agent_id=r.agent_id)
        raise protocol.ProtocolError("UNKNOWN_VERB", req.verb)

    def _status(self) -> str:
        c, m = self.conductor, self.memory.refresh()
        limit, allocated = c.ledger.limit(), c.ledger.allocated
        lines = [
            protocol.kv(ledger_max_bytes=limit, ledger_allocated_bytes=allocated,
                        ledger_free_bytes=max(0, limit - allocated)),
            protocol.kv(device_source=m.source, device_total_bytes=m.total, device_used_bytes=m.used,
                        device_free_bytes=m.free, device_used_by_others_bytes=m.others,
                        budget_fixed=self.memory.budget_bytes is not None),
            protocol.kv(agents=len(c.agents), decode_queue=c.slot.waiting,
                        live_agent=c.live[0].id if c.live else None,
                        uptime_s=round(time.time() - self.started, 1)),
        ]
        for path, refs, measured in c.registry.snapshot():
            lines.append(f"model path={path} refcount={refs} measured_bytes={measured}")
        for agent in list(c.agents.values()):
            lines.append(protocol.kv(agent=agent.id, estimate_bytes=agent.estimate.total,
                                     actual_bytes=agent.measured_bytes + agent.loaded.measured_bytes))
        return protocol.ok("STATUS", lines)

    def _list(self) -> str:
        c = self.conductor
        lines = [protocol.kv(agent_id=a.id, model=a.model_name, reserved_bytes=c.ledger.held(f"agent:{a.id}"),
                             state=a.state, kv_host_bytes=a.saved.nbytes if a.saved else 0,
                             tokens=a.tokens_in_context, n_ctx=a.n_ctx)
                 for a in list(c.agents.values())]
        return protocol.ok("LIST", lines, agents=len(lines))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmxd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="Unix socket path to serve")
    p.add_argument("--admission-percent", type=float, default=90.0,
                   help="share of device memory the ledger may hand out (default: 90)")
    p.add_argument("--budget-bytes", type=int, default=None,
                   help="fixed budget instead of a share of device memory")
    p.add_argument("--vram-table", default=None,
                   help='JSON {"model name or path": bytes} overriding the GGUF estimates')
    p.add_argument("--device", type=int, default=0, help="GPU index for NVML (default: 0)")
    p.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="another uid allowed to connect (repeatable); the daemon's own always is. "
                        "Without it the socket is mode 0600; with it 0666, and each peer's uid is "
                        "checked with SO_PEERCRED")
    p.add_argument("--line-cap", type=int, default=DEFAULT_LINE_CAP, help="longest request line in bytes")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per context")
    p.add_argument("-v", "--verbose", action="store_true", help="also show libllama's log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("swarmkv_ffi.llama").setLevel(logging.INFO if args.verbose else logging.CRITICAL)
    try:
        table = load_table(args.vram_table) if args.vram_table else None
        memory = DeviceMemory(args.device, args.budget_bytes, args.admission_percent)
        if args.line_cap < 64:
            raise ValueError("--line-cap must be at least 64 bytes")
        conductor = Conductor(Ledger(memory.budget), table, n_threads=args.threads)
        server = Server(Path(args.socket), conductor, memory, set(args.allow_uid), args.line_cap)
        signal.signal(signal.SIGTERM, server.stop)
        signal.signal(signal.SIGINT, server.stop)
        server.serve_forever()
    except (DaemonError, ValueError, OSError) as exc:
        print(f"lmxd: error: {exc}", file=sys.stderr)
        return 2
    conductor.close()
    memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
