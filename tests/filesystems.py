"""Real file-system faults for tests: a small tmpfs that fills up, a read-only view of a
folder, a file size limit. No mocks: the kernel says ENOSPC, EROFS and EFBIG itself.
Mounting needs root (CAP_SYS_ADMIN); where it is not allowed the test is skipped with
the reason."""
from __future__ import annotations

import os
import resource
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here (needs root and CAP_SYS_ADMIN): {proc.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=True)


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` (mount's syntax: 8m) at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


def fill(folder: Path, leave_bytes: int) -> Path:
    """A file that leaves about `leave_bytes` free on `folder`'s file system."""
    st = os.statvfs(folder)
    filler = folder / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave_bytes))
    return filler


@contextmanager
def read_only(path: Path):
    """`path` made read-only: a read-only bind mount onto itself as root (EROFS), mode
    0500 otherwise (EACCES)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        try:
            yield path
        finally:
            os.chmod(path, 0o700)
        return
    _mount("--bind", str(path), str(path))
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
        yield path
    finally:
        _umount(path)


def file_size_limit(nbytes: int):
    """A preexec_fn: the child may not write a file past `nbytes` (EFBIG; Python ignores
    SIGXFSZ)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit
