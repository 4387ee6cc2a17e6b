"""This process's resident memory, read from /proc (Linux)."""
from __future__ import annotations

import os


def rss_bytes() -> int:
    return rss_of(os.getpid())


def rss_of(pid: int) -> int:
    """The resident memory of process `pid`, in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
