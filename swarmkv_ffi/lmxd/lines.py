"""Request lines off a Unix socket, with the descriptors that came with them.

A client may send file descriptors (SCM_RIGHTS) with a REGISTER line, on the same
sendmsg. Linux never merges data carrying descriptors with data before it, so the
descriptors arrive with the first byte of the message that carried them; each line gets
the descriptors that arrived within it. Descriptors beyond MAX_FDS per message are
discarded by the kernel (MSG_CTRUNC), and any a line did not use are closed by the
caller, so a client cannot pile descriptors up in the daemon.

The idle timeout is a deadline for the whole request line, not for each recv: a client
sending one byte a minute is closed as surely as a silent one.
"""
from __future__ import annotations

import array
import os
import socket
import time

MAX_FDS = 4
CHUNK = 65536


class LineTooLong(Exception):
    """The line exceeded the cap; it was discarded up to and including its newline."""


class IdleTimeout(Exception):
    """No complete request line within the timeout."""


class LineReader:
    def __init__(self, conn: socket.socket, line_cap: int, timeout: float | None):
        self.conn, self.cap, self.timeout = conn, line_cap, timeout or None
        self._buf = bytearray()
        self._fds: list[tuple[int, int]] = []    # (stream offset it arrived at, fd)
        self._offset = 0                         # stream offset of _buf[0]
        self._eof = False

    def read(self) -> tuple[bytes, list[int]] | None:
        """The next line (without its newline) and its descriptors; None at end of stream.
        Raises LineTooLong (line skipped) or IdleTimeout."""
        deadline = time.monotonic() + self.timeout if self.timeout else None
        skipping = False
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                fds = self._take_fds(self._offset + end + 1)
                self._consume(end + 1)
                if skipping or len(line) > self.cap:
                    close_all(fds)
                    raise LineTooLong()
                return line, fds
            if len(self._buf) > self.cap:        # keep none of an over-long line
                skipping = True
                close_all(self._take_fds(self._offset + len(self._buf)))
                self._consume(len(self._buf))
            if self._eof:
                close_all(self._take_fds(1 << 62))
                return None
            self._recv(deadline)

    def _recv(self, deadline: float | None) -> None:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise IdleTimeout()
            self.conn.settimeout(left)
        try:
            data, ancillary, _flags, _ = self.conn.recvmsg(CHUNK, socket.CMSG_SPACE(MAX_FDS * 4),
                                                          socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            raise IdleTimeout() from None
        arrived = self._offset + len(self._buf)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                self._fds += [(arrived, fd) for fd in fds]
        if not data:
            self._eof = True
        self._buf += data

    def _take_fds(self, before: int) -> list[int]:
        taken = [fd for at, fd in self._fds if at < before]
        self._fds = [(at, fd) for at, fd in self._fds if at >= before]
        return taken

    def _consume(self, n: int) -> None:
        del self._buf[:n]
        self._offset += n

    def close(self) -> None:
        close_all(self._take_fds(1 << 62))


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
