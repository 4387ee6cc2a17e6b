"""lmxd: the conductor daemon on a Unix socket.

One thread per client connection, at most --max-clients of them and
--max-clients-per-uid per user (the next one gets ERR BUSY); a connection that does not
complete a request line within --idle-timeout seconds is closed. DECODEs of agents of one
model run together, one llama_decode per step for all of them, on one scheduler thread
that shares the device fairly (by time) between users; STATUS, LIST and HELP never wait
for it. The socket is created with mode 0600 and every peer's uid is checked
(SO_PEERCRED); agents are named per uid and reachable only by it. Model files and prefix
documents come as descriptors the client opened (access.py); untrusted models load in a
sandboxed child first (sandbox.py). Lines longer than the cap are answered with
LINE_TOO_LONG and skipped without being stored. Running out of file descriptors or
threads is answered, never fatal. SIGTERM/SIGINT: stop accepting, cancel queued DECODEs,
give the running one --shutdown-grace seconds, remove the socket if it is still ours.
The security model: docs/lmxd-security.md.
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
from typing import Protocol

from ..errors import SwarmKVError, describe
from ..conductor import (DEFAULT_AGENTS_PER_UID, DEFAULT_CLIENTS_PER_UID, DEFAULT_SHARE_PERCENT, STEP_RATIO,
                         Conductor, ConductorError, DeviceMemory, Ledger, LedgerDenied, Policy, Quotas,
                         check_models_dir, ledger_keys, load_table)
from . import protocol
from .access import Access
from .lines import IdleTimeout, LineReader, LineTooLong, close_all

log = logging.getLogger("lmxd")
DEFAULT_LINE_CAP = 64 * 1024
DEFAULT_MAX_CLIENTS = 256
DEFAULT_IDLE_TIMEOUT = 900.0
DEFAULT_SHUTDOWN_GRACE = 10.0
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


def bind_socket(path: Path, mode: int = 0o600) -> tuple[socket.socket, tuple[int, int]]:
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
    st = path.lstat()
    return sock, (st.st_dev, st.st_ino)


def unlink_if_ours(path: Path, ours: tuple[int, int]) -> bool:
    """Remove the socket file only if it is still the one we bound (another daemon may
    have reclaimed the path since)."""
    try:
        st = path.lstat()
        if (st.st_dev, st.st_ino) != ours:
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False


class Server:
    def __init__(self, socket_path: Path, conductor: Conductor, memory: DeviceMemory,
                 allow_uids: set[int] | None = None, line_cap: int = DEFAULT_LINE_CAP,
                 max_clients: int = DEFAULT_MAX_CLIENTS, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 access: Access | None = None, shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE):
        self.path, self.conductor, self.memory = Path(socket_path), conductor, memory
        self.admin = conductor.admin
        self.allowed = {self.admin} | set(allow_uids or ())
        self.line_cap, self.max_clients, self.idle_timeout = line_cap, max_clients, idle_timeout
        self.access = access or Access(self.admin)
        self.shutdown_grace = shutdown_grace
        self._clients = threading.BoundedSemaphore(max_clients)
        self._per_uid: dict[int, int] = {}
        self._per_uid_lock = threading.Lock()
        self.started = time.time()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()

    # ---- lifecycle ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        # Other allowed users need the file to be reachable; SO_PEERCRED is then the gate.
        self._sock, ours = bind_socket(self.path, 0o600 if self.allowed == {os.getuid()} else 0o666)
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
            self._drain()
            removed = unlink_if_ours(self.path, ours)
            log.info("stopped; %s", "socket removed" if removed else "the socket path is no longer ours: left it")

    def stop(self, *_signal) -> None:
        self._stop.set()

    def _drain(self) -> None:
        """Queued DECODEs are answered CANCELLED at once; the running one has the grace
        period, then is cancelled (rolled back) too; then the clients are let go."""
        self.conductor.shutdown(self.shutdown_grace)
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RD)     # idle readers see the end; replies still go out
            except OSError:
                pass
        deadline = time.monotonic() + self.shutdown_grace + 5
        for t in list(self._threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))

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
        """One thread for the connection, or ERR BUSY when the daemon, or this user's
        share of it, has no room for it."""
        try:
            uid = peer_uid(conn)
        except OSError:
            conn.close()
            return
        if uid not in self.allowed:
            log.warning("refused connection from uid %d", uid)
            self._refuse(conn, f"uid {uid} may not use this daemon", code="FORBIDDEN")
            return
        if not self._count_in(uid):
            self._refuse(conn, f"uid {uid} has {self.conductor.quotas.clients} connections open "
                               "(--max-clients-per-uid); close some first")
            return
        if not self._clients.acquire(blocking=False):
            self._count_out(uid)
            self._refuse(conn, f"{self.max_clients} clients connected (--max-clients); try again later")
            return
        t = threading.Thread(target=self._serve_client, args=(conn, uid), daemon=True)
        self._threads.add(t)
        try:
            t.start()
        except RuntimeError as exc:  # "can't start new thread"
            self._threads.discard(t)
            self._clients.release()
            self._count_out(uid)
            self._refuse(conn, f"cannot start a thread for this client ({exc})")

    def _count_in(self, uid: int) -> bool:
        with self._per_uid_lock:
            n = self._per_uid.get(uid, 0)
            if uid != self.admin and n >= self.conductor.quotas.clients:
                return False
            self._per_uid[uid] = n + 1
            return True

    def _count_out(self, uid: int) -> None:
        with self._per_uid_lock:
            self._per_uid[uid] -= 1
            if not self._per_uid[uid]:
                del self._per_uid[uid]

    @staticmethod
    def _refuse(conn: socket.socket, why: str, code: str = "BUSY") -> None:
        log.warning("refused a client: %s", why)
        try:
            conn.settimeout(1.0)
            conn.sendall(protocol.err(code, why).encode())
        except OSError:
            pass
        finally:
            conn.close()

    # ---- one client ----------------------------------------------------------------------------
    def _serve_client(self, conn: socket.socket, uid: int) -> None:
        reader = LineReader(conn, self.line_cap, self.idle_timeout)
        self._conns.add(conn)
        try:
            while not self._stop.is_set():
                try:
                    got = reader.read()
                except IdleTimeout:
                    self._send(conn, protocol.err("IDLE_TIMEOUT", f"no complete request line within "
                                                  f"{self.idle_timeout:g} s"))
                    return
                except LineTooLong:
                    self._send(conn, protocol.err("LINE_TOO_LONG", f"line exceeds {self.line_cap} bytes"))
                    log.info("%d - - LINE_TOO_LONG 0.0ms", uid)
                    continue
                if got is None:
                    return
                line, fds = got
                conn.settimeout(None)
                try:
                    reply = self._answer(line, conn, uid, fds)
                finally:
                    close_all(fds)          # descriptors this line did not use
                if not self._send(conn, reply):
                    return
        except OSError:
            pass
        finally:
            reader.close()
            self._conns.discard(conn)
            conn.close()
            self._threads.discard(threading.current_thread())
            self._clients.release()
            self._count_out(uid)

    @staticmethod
    def _send(conn: socket.socket, text: str) -> bool:
        try:
            conn.sendall(text.encode("utf-8"))
            return True
        except OSError:
            return False

    def _answer(self, line: bytes, conn: socket.socket, uid: int, fds: list[int]) -> str:
        t0 = time.perf_counter()
        verb, agent, result = "-", "-", "OK"
        try:
            req = protocol.parse(line.rstrip(b"\r"))
            verb, agent = req.verb, req.args.get("agent_id", "-")
            reply = self._dispatch(req, conn, uid, fds)
        except protocol.ProtocolError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except ConductorError as exc:
            result, reply = exc.code, protocol.err(exc.code, str(exc))
        except LedgerDenied as exc:
            result, reply = exc.code, f"ERR {exc}\n"
        except Exception as exc:  # the daemon outlives any one request
            log.exception("internal error on %s", verb)
            result, reply = "INTERNAL", protocol.err("INTERNAL", f"{type(exc).__name__}: {exc}")
        log.info("%d %s %s %s %.1fms", uid, verb, agent, result, (time.perf_counter() - t0) * 1e3)
        return reply

    # ---- verbs -----------------------------------------------------------------------------------
    def _sees_all(self, uid: int) -> bool:
        """The daemon's own user sees every agent in LIST and STATUS; any other only its own."""
        return uid == self.admin

    def _dispatch(self, req: protocol.Request, conn: socket.socket, uid: int, fds: list[int]) -> str:
        c, a = self.conductor, req.args
        if req.verb == "HELP":
            return protocol.help_reply()
        if req.verb == "STATUS":
            return self._status(uid)
        if req.verb == "LIST":
            return self._list(uid)
        if req.verb == "REGISTER":
            return self._register(a, uid, fds)
        if req.verb == "UNREGISTER":
            agent = c.unregister(a["agent_id"], uid)
            return protocol.ok("UNREGISTER", [protocol.kv(ledger_allocated_bytes=c.ledger.allocated)],
                               agent_id=agent.id)
        if req.verb == "RESET":
            c.reset(a["agent_id"], uid)
            return protocol.ok("RESET", [], agent_id=a["agent_id"])
        if req.verb == "DECODE":
            r = c.decode(a["agent_id"], a["max_tokens"], a["prompt"], should_stop=lambda: client_gone(conn),
                         owner=uid)
            if r.cancelled:
                why = "the daemon is stopping" if self._stop.is_set() else "the client disconnected"
                raise ConductorError("CANCELLED", f"agent {r.agent_id}: {why}; "
                                     "the conversation is as it was before this DECODE")
            return protocol.ok("DECODE", [
                protocol.kv(prompt_tokens=r.prompt_tokens, generated_tokens=r.generated_tokens,
                            stopped_on_eos=r.stopped_on_eog),  # the wire keeps the SPEC's name
                protocol.kv(elapsed_ms=r.elapsed_ms),
                protocol.kv(kv_swap_evicted=r.evicted, kv_swap_restored=r.restored),
                protocol.kv(queued_ms=r.queued_ms, swap_ms=r.swap_ms, slices=r.slices, batch=r.batch,
                            prefix_forked=r.forked),
            ], body=r.text, agent_id=r.agent_id)
        raise protocol.ProtocolError("UNKNOWN_VERB", req.verb)

    def _register(self, a: dict, uid: int, fds: list[int]) -> str:
        c = self.conductor
        source = self.access.model(a["model"], uid, fds)
        try:
            prefix = self.access.prefix(a["prefix"], uid, fds) if a["prefix"] else None
            agent = c.register(a["agent_id"], source, a["n_ctx"], owner=uid, prefix=prefix)
        finally:
            source.close()        # a descriptor nothing took (the request failed before the load)
        e = agent.estimate
        mine = [x for x in c.owned_by(None if self._sees_all(uid) else uid) if x.loaded is agent.loaded]
        return protocol.ok("REGISTER", [
            protocol.kv(estimate_bytes=e.total, weights_bytes=e.weights, kv_bytes=e.kv,
                        compute_bytes=e.compute, estimate_source=e.source),
            protocol.kv(reserved_bytes=c.ledger.held(ledger_keys.agent(agent.owner, agent.id)),
                        measured_context_bytes=agent.measured_bytes,
                        model_refcount=len(mine), shared_weights=len(mine) > 1),
            protocol.kv(ledger_max_bytes=c.ledger.limit(), ledger_allocated_bytes=c.ledger.allocated),
            protocol.kv(prefix=agent.prefix.key if agent.prefix else None,
                        prefix_tokens=agent.prefix.n_tokens if agent.prefix else 0,
                        prefix_agents=len(agent.prefix.agents) if agent.prefix else 0),
        ], agent_id=agent.id, model=agent.model_name, n_ctx=agent.n_ctx)

    def _status(self, uid: int) -> str:
        c, m = self.conductor, self.memory.refresh()
        limit, allocated = c.ledger.limit(), c.ledger.allocated
        every = self._sees_all(uid)
        visible = c.owned_by(None if every else uid)
        pool = c.scheduler.live
        live = pool.last if pool is not None else None
        decoding = [a.id for a in c.scheduler.decoding() if a in visible]
        lines = [
            protocol.kv(ledger_max_bytes=limit, ledger_allocated_bytes=allocated,
                        ledger_free_bytes=max(0, limit - allocated)),
            protocol.kv(device_source=m.source, device_total_bytes=m.total, device_used_bytes=m.used,
                        device_free_bytes=m.free, device_used_by_others_bytes=m.others,
                        budget_fixed=self.memory.budget_bytes is not None),
            protocol.kv(swap_max_bytes=c.swap.limit(), swap_allocated_bytes=c.swap.allocated),
            protocol.kv(agents=len(visible), decode_queue=c.scheduler.waiting(None if every else uid),
                        live_agent=live.id if live in visible else None,
                        decoding=",".join(decoding) or None,
                        uptime_s=round(time.time() - self.started, 1)),
        ]
        if not every:
            q = c.quotas
            lines.append(protocol.kv(uid=uid, uid_ledger_bytes=c.ledger.held_by(uid),
                                     uid_ledger_max_bytes=int(limit * q.ledger_share),
                                     uid_swap_bytes=c.swap.held_by(uid), uid_swap_max_bytes=int(c.swap.limit() * q.swap_share),
                                     uid_agents_max=q.agents, uid_clients_max=q.clients))
        if every:
            for path, refs, measured in c.registry.snapshot():
                lines.append("model " + protocol.kv(path=path, refcount=refs, measured_bytes=measured))
            live_pool = c.scheduler.live
            pools = [p for p in [live_pool] + list(c.scheduler.pools.values()) if p is not None]
            for pool in dict.fromkeys(pools):     # every open pool's context, the live one first
                if pool.ctx is None:
                    continue
                lines.append("pool " + protocol.kv(model=pool.loaded.name, exact=pool.exact,
                                                   requests=pool.fixed is not None, alone=bool(pool.key.alone),
                                                   live=pool is live_pool,
                                                   seated=len(pool.seats), seqs=pool.ctx.n_seq_max,
                                                   cells=pool.ctx.n_ctx, cells_free=pool.cells_free,
                                                   tomb_cells=pool.tomb_cells, rebuilds=pool.rebuilds,
                                                   opens=pool.opens, documents=len(pool.docs)))
        for p in list(c.prefixes.values()):
            if every or p.key.startswith(f"{uid}:"):
                lines.append("prefix " + protocol.kv(key=p.key, tokens=p.n_tokens, agents=len(p.agents),
                                                     host_bytes=p.snapshot.nbytes if p.snapshot else 0))
        for agent in visible:
            lines.append(protocol.kv(agent=agent.id, estimate_bytes=agent.estimate.total,
                                     actual_bytes=agent.measured_bytes + agent.loaded.measured_bytes))
        return protocol.ok("STATUS", lines)

    def _list(self, uid: int) -> str:
        c, every = self.conductor, self._sees_all(uid)
        lines = [protocol.kv(agent_id=a.id, model=a.model_name, reserved_bytes=c.ledger.held(ledger_keys.agent(a.owner, a.id)),
                             state=a.state, kv_host_bytes=a.saved.nbytes if a.saved else 0,
                             tokens=a.tokens_in_context, n_ctx=a.n_ctx,
                             prefix=a.prefix.key if a.prefix else None,
                             prefix_host_bytes=a.prefix.snapshot.nbytes if a.prefix and a.prefix.snapshot else 0,
                             **({"owner": a.owner} if every else {}))
                 for a in c.owned_by(None if every else uid)]
        return protocol.ok("LIST", lines, agents=len(lines))


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
    p.add_argument("--models-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="a folder whose .gguf files any allowed user may name by file name "
                        "(repeatable); other users' own files come as descriptors (lmx register "
                        "ID /path/model.gguf sends one)")
    p.add_argument("--max-clients-per-uid", type=int, default=DEFAULT_CLIENTS_PER_UID,
                   help=f"connections one user (other than the daemon's) may hold (default {DEFAULT_CLIENTS_PER_UID})")
    p.add_argument("--max-agents-per-uid", type=int, default=DEFAULT_AGENTS_PER_UID,
                   help=f"agents one user may register (default {DEFAULT_AGENTS_PER_UID})")
    p.add_argument("--uid-ledger-percent", type=float, default=DEFAULT_SHARE_PERCENT,
                   help="share of the device budget one user's agents and the weights they use may "
                        f"hold (default {DEFAULT_SHARE_PERCENT:g})")
    p.add_argument("--uid-swap-percent", type=float, default=DEFAULT_SHARE_PERCENT,
                   help=f"share of the swap budget one user's paused agents may hold (default {DEFAULT_SHARE_PERCENT:g})")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                   help="on SIGTERM, seconds the running DECODE may go on before it is cancelled; "
                        f"queued ones are cancelled at once (default {DEFAULT_SHUTDOWN_GRACE:g})")
    p.add_argument("--step-ratio", type=float, default=STEP_RATIO,
                   help="while users share the device, a step may take at most this times the "
                        "predicted time of its decode rows alone (or 0.25 s, if more), so one user's "
                        f"long prompt goes in chunk by chunk beside the others' decodes (default {STEP_RATIO:g})")
    p.add_argument("--step-tokens", type=int, default=0,
                   help="instead of --step-ratio, a fixed cap on the rows of a step while users "
                        "share the device (0: use --step-ratio; default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per context")
    p.add_argument("-v", "--verbose", action="store_true", help="also show libllama's log")
    return p


class Front(Protocol):
    """What the daemon may be handed to serve beside its socket (lmxd's main() hands it the
    OpenAI API of serve/): its flags, and a start on the daemon's conductor that returns something
    to stop() once the socket has drained, or None when its flags did not ask for it."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def start(self, args: argparse.Namespace, conductor: Conductor): ...


def main(argv: list[str] | None = None, front: Front | None = None) -> int:
    """lmxd: the socket server, and `front` beside it if handed one."""
    parser = build_parser()
    if front is not None:
        front.add_arguments(parser)
    args = parser.parse_args(argv)
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
        if args.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be >= 0")
        if args.step_ratio < 1 or args.step_tokens < 0:
            raise ValueError("--step-ratio must be >= 1 and --step-tokens >= 0")
        for folder in args.models_dir:
            check_models_dir(folder)
        quotas = Quotas(args.max_clients_per_uid, args.max_agents_per_uid, args.uid_ledger_percent / 100,
                        args.uid_swap_percent / 100)
        conductor = Conductor(Ledger(memory.budget), table, n_threads=args.threads,
                              swap=Ledger(lambda: swap, name="SWAP"), agent_ttl=args.agent_ttl, quotas=quotas,
                              policy=Policy(args.step_ratio, args.step_tokens))
        booked.append(conductor.ledger)
        server = Server(Path(args.socket), conductor, memory, set(args.allow_uid), args.line_cap,
                        args.max_clients, args.idle_timeout, Access(conductor.admin, args.models_dir),
                        args.shutdown_grace)
        started = front.start(args, conductor) if front is not None else None
        signal.signal(signal.SIGTERM, server.stop)
        signal.signal(signal.SIGINT, server.stop)
        try:
            server.serve_forever()
        finally:
            if started is not None:
                started.stop()
    except (DaemonError, ValueError, OSError, SwarmKVError) as exc:
        print(f"lmxd: error: {describe(exc)}", file=sys.stderr)
        return 2
    conductor.close()
    memory.close()
    return 0
