"""`swarmkv serve` as a user starts it: a subprocess on a free loopback port, and the
official `openai` client pointed at it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, *flags: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--port", str(self.port),
                                      "--threads", "2", *flags], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"swarmkv serve exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"swarmkv serve did not answer /health within 120 s:\n{log.read_text()}")
            time.sleep(0.2)

    def client(self, key: str = "none"):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
