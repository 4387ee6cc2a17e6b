"""The `swarmkv` command run as a user runs it: a subprocess, its output captured."""
from __future__ import annotations

import subprocess
import sys


def swarmkv(*args: str, check: bool = True, env: dict | None = None, timeout: float = 600):
    """Run `swarmkv ARGS`; with check, a non-zero exit fails the test with its stderr."""
    proc = subprocess.run([sys.executable, "-m", "swarmkv_ffi.cli", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"swarmkv {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc
