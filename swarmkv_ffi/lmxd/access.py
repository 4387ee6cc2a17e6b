"""What a client may make the daemon open: the rules that keep lmxd from reading, on a
client's behalf, anything that client could not read itself.

The daemon may run as root, so it never opens a path a client names with its own
credentials. A client passes the descriptor of its prefix document or model file over
the socket (SCM_RIGHTS): it opened the file itself, so the kernel has already checked
that it may. The daemon `fstat`s what arrived: a regular file, not on procfs or sysfs,
within the size cap. Names are accepted only where the operator vouches for them: the
packaged short names (catalog.py) and files inside an operator's --models-dir. The
daemon's own user (the operator) may still name any path, since the daemon's
credentials are its own.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .. import catalog
from ..conductor import MAX_PREFIX_BYTES, ConductorError, ModelSource, named_source, on_pseudo_fs

FD_TOKEN = "@fd"     # REGISTER's <model> or prefix= value: "the descriptor sent with this line"
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Access:
    def __init__(self, admin_uid: int, models_dirs: list[Path] | None = None):
        self.admin = admin_uid
        self.models_dirs = [Path(os.path.realpath(d)) for d in models_dirs or []]

    # ---- models -----------------------------------------------------------------------------
    def model(self, name: str, uid: int, fds: list[int]) -> ModelSource:
        """The model REGISTER names, for `uid`: a short name, a file in a --models-dir,
        the descriptor sent with the line, or (the operator only) any path."""
        if name == FD_TOKEN:
            return ModelSource(FD_TOKEN, fd=take_fd(fds, "the model"))
        if name in catalog.CATALOG or (uid == self.admin and ("/" in name or name.endswith(".gguf"))):
            return named_source(name)
        found = self._in_models_dir(name)
        if found is not None:
            return ModelSource(name, found)
        where = f" or a file name in {', '.join(map(str, self.models_dirs))}" if self.models_dirs else ""
        raise ConductorError("UNKNOWN_MODEL", f"model {name[:80]!r} is not a packaged short name "
                             f"({', '.join(catalog.CATALOG)}){where}; to use your own file, send its "
                             f"descriptor: `lmx register ID /path/model.gguf` does")

    def _in_models_dir(self, name: str) -> Path | None:
        for folder in self.models_dirs:
            candidate = Path(os.path.realpath(folder / name))
            if candidate.parent == folder and candidate.is_file():
                return candidate
        return None

    # ---- prefix documents --------------------------------------------------------------------
    def prefix(self, value: str, uid: int, fds: list[int]) -> str:
        """The text of REGISTER's prefix=: the descriptor sent with the line, or (the
        operator only) a path."""
        if value == FD_TOKEN:
            fd = take_fd(fds, "the prefix document")
            try:
                return read_text(fd, "the prefix document")
            finally:
                os.close(fd)
        if uid != self.admin:
            raise ConductorError("FORBIDDEN", "prefix=PATH would be read with the daemon's credentials; "
                                 "send the document's descriptor instead (prefix=@fd: `lmx register "
                                 "--prefix FILE` and LmxClient.register(prefix=FILE) do)")
        try:
            fd = os.open(value, OPEN_FLAGS)
        except OSError as exc:
            raise ConductorError("BAD_PREFIX", f"cannot open {value}: {exc.strerror}") from None
        try:
            return read_text(fd, value)
        finally:
            os.close(fd)


def take_fd(fds: list[int], what: str) -> int:
    if not fds:
        raise ConductorError("BAD_REQUEST", f"no file descriptor came with this line for {what} "
                             "(send it with SCM_RIGHTS on the same sendmsg as the line)")
    return fds.pop(0)


def read_text(fd: int, name: str) -> str:
    """At most MAX_PREFIX_BYTES of UTF-8 from a regular file (checked on the descriptor)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConductorError("BAD_PREFIX", f"{name} is not a regular file")
    if on_pseudo_fs(fd):
        raise ConductorError("BAD_PREFIX", f"{name} is on procfs or sysfs; send a regular file")
    if st.st_size > MAX_PREFIX_BYTES:
        raise ConductorError("BAD_PREFIX", f"{name} is {st.st_size} bytes; the limit is {MAX_PREFIX_BYTES}")
    chunks, size = [], 0
    while size <= MAX_PREFIX_BYTES:
        chunk = os.pread(fd, min(1 << 20, MAX_PREFIX_BYTES + 1 - size), size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_PREFIX_BYTES:
        raise ConductorError("BAD_PREFIX", f"{name} grew past {MAX_PREFIX_BYTES} bytes while read")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConductorError("BAD_PREFIX", f"{name} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
