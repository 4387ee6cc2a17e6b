"""A real lmxd on a temporary socket, for the conductor tests (started as a child
process, waited for, stopped with SIGTERM)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from swarmkv_ffi.conductor.client import LmxClient
from swarmkv_ffi.errors import SwarmKVError

SYSTEM_PYTHON = "/usr/bin/python3"  # readable by other users, unlike a venv under /root


class Daemon:
    def __init__(self, tmp: Path, *args: str, preexec_fn=None):
        self.path = tmp / "lmx.sock"
        self.log = (tmp / "lmxd.log").open("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmkv_ffi.conductor.server",
                                      "--socket", str(self.path), "--threads", "1", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
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
