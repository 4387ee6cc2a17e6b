"""lmxd: the conductor daemon on a Unix socket.

One thread per client connection, at most --max-clients of them (the next one gets
ERR BUSY); a connection idle for --idle-timeout seconds is closed. DECODEs queue in
arrival order on the compute slot; STATUS, LIST and HELP never wait for it. The socket is
created with mode 0600 and every peer's uid is checked (SO_PEERCRED); each agent belongs
to the uid that registered it. Lines longer than the cap are answered with LINE_TOO_LONG
and skipped without being stored. Running out of file descriptors or threads is answered,
never fatal. SIGTERM/SIGINT stop the daemon cleanly and remove the socket; a stale socket
file is reclaimed, a live daemon's is not.
"""
from __future__ import annotations

import argparse
import errno
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
from .agents import MAX_PREFIX_BYTES, Conductor, ConductorError
from .estimate import load_table
from .ledger import Ledger, LedgerDenied
from .memory import DeviceMemory

log = logging.getLogger("lmxd")
DEFAULT_LINE_CAP = 64 * 1024
DEFAULT_MAX_CLIENTS = 256
DEFAULT_IDLE_TIMEOUT = 900.0
GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


class DaemonError(SwarmKVError):
    """lmxd cannot start (socket path taken, bad flags)."""


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def client_gone(conn: socket.socket) -> bool:
    """True once the peer has closed the connection (POLLHUP), not merely its write side.

    A client that sends its request and then shutdown(SHUT_WR)s (nc -N, socat) still
    waits for the reply: on a Unix socket that is POLLIN|POLLRDHUP, without POLLHUP.
    poll(), unlike select(), works for any descriptor number.
    """
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return any(events & GONE for _fd, events in poller.poll(0))
    except (OSError, ValueError):
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
    sock.listen(socket.SOMAXCONN)
    return sock


class Server:
    def __init__(self, socket_path: Path, conductor: Conductor, memory: DeviceMemory,
                 allow_uids: set[int] | None = None, line_cap: int = DEFAULT_LINE_CAP,
                 max_clients: int = DEFAULT_MAX_CLIENTS, idle_timeout: float = DEFAULT_IDLE_TIMEOUT):
        self.path, self.conductor, self.memory = Path(socket_path), conductor, memory
        self.allowed = {os.getuid()} | set(allow_uids or ())
        self.line_cap, self.max_clients, self.idle_timeout = line_cap, max_clients, idle_timeout
        self._clients = threading.BoundedSemaphore(max_clients)
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
        self._sock.settimeout(0.2)
        if self.conductor.agent_ttl:
            threading.Thread(target=self._expire_agents, daemon=True).start()
        try:
            while not self._stop.is_set():
                conn = self._accept()
                if conn is not None:
                    self._start_client(conn)
        finally:
            self._sock.close()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            log.info("stopped; socket removed")

    def stop(self, *_signal) -> None:
        self._stop.set()

    def _expire_agents(self) -> None:
        """Apart from the accept loop: unregistering waits for a running DECODE."""
        while not self._stop.wait(1.0):
            for agent_id in self.conductor.expire_idle():
                log.info("UNREGISTER %s expired (unused for --agent-ttl)", agent_id)

    def _accept(self) -> socket.socket | None:
        """The next connection, or None (timeout, or a transient failure that was logged)."""
        try:
            conn, _ = self._sock.accept()
        except socket.timeout:
            return None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("accept failed (%s); waiting for descriptors to free up", exc.strerror)
                time.sleep(0.1)
                return None
            raise
        conn.settimeout(None)
        return conn

    def _start_client(self, conn: socket.socket) -> None:
        """One thread for the connection, or ERR BUSY when the daemon has no room for it."""
        if not self._clients.acquire(blocking=False):
            self._refuse(conn, f"{self.max_clients} clients connected (--max-clients); try again later")
            return
        t = threading.Thread(target=self._serve_client, args=(conn,), daemon=True)
        self._threads.add(t)
        try:
            t.start()
        except RuntimeError as exc:  # "can't start new thread"
            self._threads.discard(t)
            self._clients.release()
            self._refuse(conn, f"cannot start a thread for this client ({exc})")

    @staticmethod
    def _refuse(conn: socket.socket, why: str) -> None:
        log.warning("refused a client: %s", why)
        try:
            conn.settimeout(1.0)
            conn.sendall(protocol.err("BUSY", why).encode())
        except OSError:
            pass
        finally:
            conn.close()

    # ---- one client ----------------------------------------------------------------------------
    def _serve_client(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
            if uid not in self.allowed:
                log.warning("refused connection from uid %d", uid)
                conn.sendall(protocol.err("FORBIDDEN", f"uid {uid} may not use this daemon").encode())
                return
            if self.idle_timeout:
                conn.settimeout(self.idle_timeout)
            reader = conn.makefile("rb")
            while not self._stop.is_set():
                try:
                    line = reader.readline(self.line_cap + 1)
                except socket.timeout:
                    self._send(conn, protocol.err("IDLE_TIMEOUT", f"nothing received for {self.idle_timeout:g} s"))
                    return
                if not line:
                    return
                if len(line) > self.line_cap and not line.endswith(b"\n"):
                    self._skip_line(reader)
                    self._send(conn, protocol.err("LINE_TOO_LONG", f"line exceeds {self.line_cap} bytes"))
                    log.info("- - LINE_TOO_LONG 0.0ms")
                    continue
                if not self._send(conn, self._answer(line.rstrip(b"\n"), conn, uid)):
                    return
        except OSError:
            pass
        finally:
            conn.close()
            self._threads.discard(threading.current_thread())
            self._clients.release()

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

    def _answer(self, line: bytes, conn: socket.socket, uid: int) -> str:
        t0 = time.perf_counter()
        verb, agent, result = "-", "-", "OK"
        try:
            req = protocol.parse(line)
            verb, agent = req.verb, req.args.get("agent_id", "-")
            reply = self._dispatch(req, conn, uid)
        except protocol.ProtocolError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except ConductorError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except LedgerDenied as exc:
            result, reply = exc.code, f"ERR {exc}\n"
        except Exception as exc:  # the daemon outlives any one request
            log.exception("internal error on %s", verb)
            result, reply = "INTERNAL", protocol.err("INTERNAL", f"{type(exc).__name__}: {exc}")
        log.info("%s %s %s %.1fms", verb, agent, result, (time.perf_counter() - t0) * 1e3)
        return reply

    # ---- verbs -----------------------------------------------------------------------------------
    def _sees_all(self, uid: int) -> bool:
        """The daemon's own user administers every agent; any other sees only its own."""
        return uid == os.getuid()

    def _owned(self, agent_id: str, uid: int):
        agent = self.conductor.get(agent_id)
        if agent.owner != uid and not self._sees_all(uid):
            raise ConductorError("FORBIDDEN", f"agent {agent_id} belongs to another user")
        return agent

    def _dispatch(self, req: protocol.Request, conn: socket.socket, uid: int) -> str:
        c, a = self.conductor, req.args
        if req.verb == "HELP":
            return protocol.help_reply()
        if req.verb == "STATUS":
            return self._status(uid)
        if req.verb == "LIST":
            return self._list(uid)
        if "agent_id" in a and req.verb != "REGISTER":
            self._owned(a["agent_id"], uid)
        if req.verb == "REGISTER":
            prefix = read_prefix(a["prefix"], uid) if a["prefix"] else None
            agent = c.register(a["agent_id"], a["model"], a["n_ctx"], owner=uid, prefix=prefix)
            e = agent.estimate
            return protocol.ok("REGISTER", [
                protocol.kv(estimate_bytes=e.total, weights_bytes=e.weights, kv_bytes=e.kv,
                            compute_bytes=e.compute, estimate_source=e.source),
                protocol.kv(reserved_bytes=c.ledger.held(f"agent:{agent.id}"),
                            measured_context_bytes=agent.measured_bytes,
                            model_refcount=agent.loaded.refs, shared_weights=agent.loaded.refs > 1),
                protocol.kv(ledger_max_bytes=c.ledger.limit(), ledger_allocated_bytes=c.ledger.allocated),
                protocol.kv(prefix=agent.prefix.key if agent.prefix else None,
                            prefix_tokens=agent.prefix.n_tokens if agent.prefix else 0,
                            prefix_agents=len(agent.prefix.agents) if agent.prefix else 0),
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
            if r.cancelled:
                raise ConductorError("CANCELLED", f"agent {r.agent_id}: the client disconnected; "
                                     "the conversation is as it was before this DECODE")
            return protocol.ok("DECODE", [
                protocol.kv(prompt_tokens=r.prompt_tokens, generated_tokens=r.generated_tokens,
                            stopped_on_eos=r.stopped_on_eog),  # the wire keeps the SPEC's name
                protocol.kv(elapsed_ms=r.elapsed_ms),
                protocol.kv(kv_swap_evicted=r.evicted, kv_swap_restored=r.restored),
            ], body=r.text, agent_id=r.agent_id)
        raise protocol.ProtocolError("UNKNOWN_VERB", req.verb)

    def _visible(self, uid: int) -> list:
        agents = list(self.conductor.agents.values())
        return agents if self._sees_all(uid) else [x for x in agents if x.owner == uid]

    def _status(self, uid: int) -> str:
        c, m = self.conductor, self.memory.refresh()
        limit, allocated = c.ledger.limit(), c.ledger.allocated
        lines = [
            protocol.kv(ledger_max_bytes=limit, ledger_allocated_bytes=allocated,
                        ledger_free_bytes=max(0, limit - allocated)),
            protocol.kv(device_source=m.source, device_total_bytes=m.total, device_used_bytes=m.used,
                        device_free_bytes=m.free, device_used_by_others_bytes=m.others,
                        budget_fixed=self.memory.budget_bytes is not None),
            protocol.kv(swap_max_bytes=c.swap.limit(), swap_allocated_bytes=c.swap.allocated),
            protocol.kv(agents=len(self._visible(uid)), decode_queue=c.slot.waiting,
                        live_agent=c.live[0].id if c.live and c.live[0] in self._visible(uid) else None,
                        decoding=c.decoding if c.decoding in {a.id for a in self._visible(uid)} else None,
                        uptime_s=round(time.time() - self.started, 1)),
        ]
        if self._sees_all(uid):
            for path, refs, measured in c.registry.snapshot():
                lines.append("model " + protocol.kv(path=path, refcount=refs, measured_bytes=measured))
            for p in list(c.prefixes.values()):
                lines.append("prefix " + protocol.kv(key=p.key, tokens=p.n_tokens, agents=len(p.agents),
                                                     host_bytes=p.snapshot.nbytes if p.snapshot else 0))
        for agent in self._visible(uid):
            lines.append(protocol.kv(agent=agent.id, estimate_bytes=agent.estimate.total,
                                     actual_bytes=agent.measured_bytes + agent.loaded.measured_bytes))
        return protocol.ok("STATUS", lines)

    def _list(self, uid: int) -> str:
        c = self.conductor
        lines = [protocol.kv(agent_id=a.id, model=a.model_name, reserved_bytes=c.ledger.held(f"agent:{a.id}"),
                             state=a.state, kv_host_bytes=a.saved.nbytes if a.saved else 0,
                             tokens=a.tokens_in_context, n_ctx=a.n_ctx,
                             prefix=a.prefix.key if a.prefix else None,
                             prefix_host_bytes=a.prefix.snapshot.nbytes if a.prefix and a.prefix.snapshot else 0)
                 for a in self._visible(uid)]
        return protocol.ok("LIST", lines, agents=len(lines))


def read_prefix(path: str, uid: int) -> str:
    """The text of a REGISTER prefix= document, read by the daemon on behalf of `uid`: only
    a regular file that user may read (owner with read permission, or world-readable),
    opened without following a final symlink, at most MAX_PREFIX_BYTES of UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConductorError("BAD_PREFIX", f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConductorError("BAD_PREFIX", f"{path} is not a regular file")
        may_read = uid == 0 or st.st_mode & stat.S_IROTH or (st.st_uid == uid and st.st_mode & stat.S_IRUSR)
        if not may_read:
            raise ConductorError("FORBIDDEN", f"{path}: the connecting user may not read it")
        if st.st_size > MAX_PREFIX_BYTES:
            raise ConductorError("BAD_PREFIX", f"{path} is {st.st_size} bytes; the limit is {MAX_PREFIX_BYTES}")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_PREFIX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConductorError("BAD_PREFIX", f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def default_swap_budget() -> int:
    """A quarter of the host's RAM: paused agents' KV must not push the host into swap."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


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
    p.add_argument("--max-clients", type=int, default=DEFAULT_MAX_CLIENTS,
                   help=f"connections served at once; the next gets ERR BUSY (default {DEFAULT_MAX_CLIENTS})")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT,
                   help=f"close a connection that sends nothing for this many seconds, 0 = never "
                        f"(default {DEFAULT_IDLE_TIMEOUT:g})")
    p.add_argument("--swap-budget-bytes", type=int, default=None,
                   help="host RAM for paused agents' KV snapshots (default: 25%% of host RAM)")
    p.add_argument("--agent-ttl", type=float, default=0,
                   help="unregister an agent unused for this many seconds, 0 = never (default 0)")
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
        booked = []   # the ledger, once it exists: what NVML cannot attribute to us in a container
        memory = DeviceMemory(args.device, args.budget_bytes, args.admission_percent,
                              own_hint=lambda: booked[0].allocated if booked else 0)
        if args.line_cap < 64:
            raise ValueError("--line-cap must be at least 64 bytes")
        if args.max_clients < 1 or args.idle_timeout < 0 or args.agent_ttl < 0:
            raise ValueError("--max-clients must be >= 1; --idle-timeout and --agent-ttl >= 0")
        swap = args.swap_budget_bytes if args.swap_budget_bytes is not None else default_swap_budget()
        if swap < 0:
            raise ValueError("--swap-budget-bytes must be >= 0")
        conductor = Conductor(Ledger(memory.budget), table, n_threads=args.threads,
                              swap=Ledger(lambda: swap, name="SWAP"), agent_ttl=args.agent_ttl)
        booked.append(conductor.ledger)
        server = Server(Path(args.socket), conductor, memory, set(args.allow_uid), args.line_cap,
                        args.max_clients, args.idle_timeout)
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
