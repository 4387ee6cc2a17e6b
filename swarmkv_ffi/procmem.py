"""This process's resident memory, read from /proc (Linux)."""
from __future__ import annotations

import os


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
