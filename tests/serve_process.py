"""`swarmkv serve` as a user starts it: a subprocess on a free loopback port, and the
official `openai` client pointed at it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from swarmkv_ffi.bench.peer import free_port, start_healthy

MODEL = "smollm2-135m"


class Serve:
    def __init__(self, *flags: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")
        cmd = [sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--port", str(self.port), "--threads", "2", *flags]
        try:
            self.proc = start_healthy(cmd, self.url, self._log, "swarmkv serve")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{log.read_text()}") from None

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
