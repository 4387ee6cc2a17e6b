"""A client-named model file, opened once and checked before anything reads it.

lmxd loads files that local clients name, so the path is hostile until proven otherwise:
a FIFO would hang a read, a device never ends, a file truncated while mmapped kills the
process with SIGBUS, and a symlink can be retargeted between two looks. So the file is
opened once (non-blocking, so a FIFO cannot hang the open), `fstat`ed on that descriptor
(regular file, sane size), its GGUF header is copied out and parsed from the copy, and
libllama is given `/proc/self/fd/N`: the very file that was checked. The agent keeps the
file's identity (device, inode, size, mtime) and never resolves the path again.
"""
from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

MIN_BYTES = 32                 # a GGUF header is at least this long


@dataclass(frozen=True)
class ModelFile:
    path: Path                     # as the client named it (for messages)
    identity: tuple[int, int, int, int]

    @property
    def key(self) -> str:
        """Registry and ledger key: the same bytes on disk, whatever path names them."""
        return "{}:{}:{}:{}".format(*self.identity)


@dataclass
class ModelSource:
    """Where an agent's model comes from, as the daemon's access rules decided
    (server.py): a file the daemon may open itself, or a descriptor the client sent.
    Untrusted files (anything but a packaged catalog model) load in the sandbox first."""
    name: str                      # as the client named it: messages, LIST
    path: Path | None = None
    fd: int = -1
    trusted: bool = False

    def open(self) -> "OpenModel":
        """The checked file; a sent descriptor passes to it (and is closed with it)."""
        fd, self.fd = self.fd, -1
        return OpenModel(self.path if fd < 0 else self.name, fd=fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class OpenModel:
    """`with OpenModel(path) as (mf, fd):` checks the file and keeps it open.

    `OpenModel(name, fd=N)` checks a descriptor a client sent instead (lmxd: the client
    opened the file with its own credentials); it is closed on exit like an opened one.
    A path's last component is never followed if it is a symlink: callers resolve first."""

    def __init__(self, path: Path | str, fd: int = -1):
        self.path = Path(path)
        self.fd = fd

    def __enter__(self) -> tuple[ModelFile, int]:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | os.O_NOFOLLOW
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, flags)
            except OSError as exc:
                raise ModelLoadError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                        else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket")
                raise ModelLoadError(f"{self.path} is {kind}, not a regular GGUF file")
            if on_pseudo_fs(self.fd):
                raise ModelLoadError(f"{self.path} is on procfs or sysfs, not a GGUF file")
            if st.st_size < MIN_BYTES:
                raise ModelLoadError(f"{self.path} is {st.st_size} bytes: too small to be a GGUF model")
            os.set_blocking(self.fd, True)
        except BaseException:
            self.close()
            raise
        return ModelFile(self.path, identity(st)), self.fd

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


PSEUDO_FS = {0x9FA0: "procfs", 0x62656572: "sysfs", 0x64626720: "debugfs", 0x74726163: "tracefs",
             0x73636673: "securityfs", 0x27E0EB: "cgroup", 0x63677270: "cgroup2"}


def on_pseudo_fs(fd: int) -> bool:
    """True for a descriptor on procfs, sysfs and the like: "regular files" whose content
    depends on who reads them, or that are checked only when read (fstatfs's f_type)."""
    buf = ctypes.create_string_buffer(256)          # struct statfs; f_type is its first long
    if _libc.fstatfs(fd, buf) != 0:
        raise OSError(ctypes.get_errno(), "fstatfs failed")
    return ctypes.c_long.from_buffer(buf).value in PSEUDO_FS


_libc = ctypes.CDLL(None, use_errno=True)


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def fd_path(fd: int) -> str:
    """A path that opens exactly this descriptor's file (Linux)."""
    return f"/proc/self/fd/{fd}"


def reopenable(fd: int) -> bool:
    """Can this process open fd_path(fd)? Opening /proc/self/fd/N checks the file's own
    permissions again: a descriptor another user sent for a file only they may read
    works for reads (pread) but not for libllama, which opens by path."""
    try:
        os.close(os.open(fd_path(fd), os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY))
        return True
    except PermissionError:
        return False


class LoadableCopy:
    """`with LoadableCopy(mf, fd) as load_fd:` a descriptor libllama can open by path:
    `fd` itself when this process may reopen it, else a sealed in-memory copy (memfd) of
    the file, freed on exit (the daemon loads weights into its own memory anyway)."""

    def __init__(self, mf: ModelFile, fd: int):
        self.mf, self.fd, self.copy = mf, fd, -1

    def __enter__(self) -> int:
        if reopenable(self.fd):
            return self.fd
        import fcntl
        self.copy = os.memfd_create("lmxd-model", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        size, done = self.mf.identity[2], 0
        while done < size:
            n = os.sendfile(self.copy, self.fd, done, min(size - done, 1 << 30))   # in the kernel
            if n == 0:
                raise ModelLoadError(f"{self.mf.path} shrank while it was copied")
            done += n
        check_unchanged(self.mf, self.fd)
        fcntl.fcntl(self.copy, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        return self.copy

    def __exit__(self, *exc) -> None:
        if self.copy >= 0:
            os.close(self.copy)
            self.copy = -1


def check_unchanged(mf: ModelFile, fd: int) -> None:
    """Refuse a file that changed (grew, shrank, rewritten) since it was checked."""
    if identity(os.fstat(fd)) != mf.identity:
        raise ModelLoadError(f"{mf.path} changed while it was being read; try again once it is complete")


def check_models_dir(folder: Path) -> None:
    """An operator's model folder must be theirs: not writable by anyone else, or any
    user could plant a file there for everyone to load."""
    st = folder.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--models-dir {folder} is not a folder")
    if st.st_uid not in (0, os.getuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"--models-dir {folder} is owned by uid {st.st_uid} or writable by others "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); use a folder only the daemon's user can write")
