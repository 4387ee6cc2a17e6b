"""A real lmxd on a temporary socket, for the conductor tests (started as a child
process, waited for, stopped with SIGTERM)."""
from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from swarmkv_ffi.lmxd import protocol
from swarmkv_ffi.lmxd.client import LmxClient
from swarmkv_ffi.errors import SwarmKVError

SYSTEM_PYTHON = "/usr/bin/python3"  # readable by other users, unlike a venv under /root


class Daemon:
    def __init__(self, tmp: Path, *args: str, preexec_fn=None, env: dict | None = None):
        self.path = tmp / "lmx.sock"
        self.log = (tmp / "lmxd.log").open("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmkv_ffi.lmxd",
                                      "--socket", str(self.path), "--threads", "1", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.time() + 60
        while not self._answers():  # the path may pre-exist (a stale socket): wait for a listener
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"lmxd did not start: {self.logs()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.path))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def client(self) -> LmxClient:
        return LmxClient(str(self.path), timeout=300)

    def raw_socket(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(120)
        s.connect(str(self.path))
        return s

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=60)
        return self.proc.returncode


def eventually(check, timeout: float = 60, what: str = "the daemon to catch up"):
    """check() until it returns something true without raising; its value. Polls the
    daemon's own state instead of sleeping and hoping it has caught up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (OSError, AssertionError, ValueError, SwarmKVError):
            if time.monotonic() >= deadline:
                raise
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_decoding(daemon: "Daemon", agent_id: str, timeout: float = 120) -> dict:
    """Poll STATUS until the daemon says agent_id's DECODE holds the slot; the reply
    itself is a STATUS answered during that decode. Waits on the daemon's own word
    instead of sleeping and hoping the decode has started."""
    deadline = time.monotonic() + timeout
    with daemon.client() as c:
        while True:
            status = c.status()
            if status["fields"].get("decoding") == agent_id:
                return status
            assert time.monotonic() < deadline, f"{agent_id}'s DECODE never started"
            time.sleep(0.01)


#: A client run as another uid, by a system python that cannot import this package
#: (the venv may be unreadable to that uid): one request per argument, as JSON
#: [line, [files to open as that user and send with it]]; prints each reply as a JSON list
#: (["CONNECTION_CLOSED"] if the daemon hangs up first). Replies are read by the package's
#: own protocol.read_reply, whose source is prepended.
AS_USER_CLIENT = f"""
import json, os, socket, sys
FINAL_OK = {protocol.FINAL_OK!r}
{inspect.getsource(protocol.read_reply)}
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rb')
for arg in sys.argv[2:]:
    line, files = json.loads(arg)
    fds = []
    try:
        fds = [os.open(p, os.O_RDONLY) for p in files]
    except OSError as exc:
        print(json.dumps(["CLIENT_OPEN_FAILED " + exc.strerror])); continue
    data = line.encode() + b'\\n'
    if fds:
        socket.send_fds(s, [data], fds)
    else:
        s.sendall(data)
    for fd in fds:
        os.close(fd)
    try:
        reply = read_reply(f)
    except EOFError:
        reply = ["CONNECTION_CLOSED"]
    print(json.dumps(reply), flush=True)
"""


def as_user(uid: int, daemon: "Daemon", *requests, timeout: float = 300) -> list[list[str]]:
    """Send requests (a line, or (line, [files])) as `uid`; its replies, one list of lines each."""
    import json
    args = [json.dumps([r, []] if isinstance(r, str) else [r[0], list(map(str, r[1]))]) for r in requests]
    done = subprocess.run([SYSTEM_PYTHON, "-c", AS_USER_CLIENT, str(daemon.path), *args], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=become(uid))
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def become(uid: int):
    """A preexec_fn that turns the child into `uid` (its group too) before it runs."""
    return lambda: (os.setgid(uid), os.setuid(uid))


def outside_body(reply: list[str]) -> list[str]:
    """A reply's own lines, without the body between BEGIN_RESPONSE and END_RESPONSE."""
    out, in_body = [], False
    for line in reply:
        if in_body:
            in_body = line != "END_RESPONSE"
            if in_body:
                continue
        elif line == "BEGIN_RESPONSE":
            in_body = True
        out.append(line)
    return out


def shared_tmp(prefix: str) -> Path:
    """A folder other uids can reach (pytest's tmp is 0700), removed by the caller."""
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(tmp, 0o755)
    return tmp


@contextmanager
def scheduler_held(c):
    """The scheduler thread waits inside a closure until the block ends: DECODEs sent
    meanwhile queue, and its next step takes them all at once."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(60)
    t = threading.Thread(target=c.scheduler.call, args=(hold,))
    t.start()
    assert entered.wait(60)
    try:
        yield
    finally:
        release.set()
        t.join(60)


def queued(c, n: int) -> None:
    """Wait until the in-process conductor `c` has n DECODEs queued."""
    deadline = time.monotonic() + 60
    while c.scheduler.waiting() < n:
        assert time.monotonic() < deadline, "the DECODEs never queued"
        time.sleep(0.005)
