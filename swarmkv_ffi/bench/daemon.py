"""A real lmxd for the benchmarks: started on a socket in a fresh folder, waited for until
it answers, stopped with SIGTERM (the conductor, multiuser and agents benchmarks)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_lmxd(sock: Path, *flags: str, log: Path | None = None, timeout: float = 60) -> subprocess.Popen:
    """`lmxd --socket SOCK FLAGS…` in a child process, returned once a client can connect;
    its log goes to `log` (or nowhere). A daemon that exits first is an error with its log."""
    from ..lmxd.client import LmxClient
    from ..errors import SwarmKVError
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "swarmkv_ffi.lmxd", "--socket", str(sock), *flags],
                            stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.time() + timeout
    while True:
        try:
            LmxClient(str(sock), timeout=5).close()
            return proc
        except SwarmKVError:
            if proc.poll() is not None or time.time() > deadline:
                stop_lmxd(proc)
                said = log.read_text()[-2000:] if log else "(no log kept)"
                raise RuntimeError(f"lmxd did not start: {said}") from None
            time.sleep(0.05)


def stop_lmxd(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not stopped within 60 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
