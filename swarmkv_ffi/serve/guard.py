"""Connections that send or take nothing cannot lock the server: uvicorn's protocol, with deadlines.

uvicorn has a keep-alive timeout, but none for a connection that opens and never sends
its request (or sends half its headers): such a connection costs nothing to hold and,
counted by uvicorn's `limit_concurrency`, 320 of them made every other client's request
a plain-text 503. So the servers here run without limit_concurrency (the engine's
admission caps the work, per key and in all) and with uvicorn's own HTTP protocol
extended by these rules:

- a connection must finish a request's headers within `header_timeout` seconds of
  opening, or of its previous response, or it is closed;
- an address holds at most `idle_per_address` connections that have not sent a request
  yet; a newer one closes its oldest, so a flood of idle sockets pushes out its own
  sockets, never the one a client opened to send a request now;
- a request line and headers together take at most `header_bytes` (64 KiB, as nginx's
  large_client_header_buffers and Node's limit are of that order), counted as they
  arrive, before any key is read: past it the answer is a 431 and the connection closes.
  httptools keeps an unfinished header in memory whole, so without a cap four connections
  each sending one endless header line held 192 MiB within seconds;
- a connection whose write buffer stays full for `send_timeout` seconds (its client reads
  nothing of an answer the server has more of) is aborted, its unsent bytes dropped: the
  route sees the client gone and cancels the request. Without it a stream never read kept
  its output queued for as long as the socket stayed open;
- a request whose Content-Length is over `max_body_bytes` gets its 413 as soon as its
  headers are complete, and the connection closes: no request cycle, no routing, no key
  lookup. A client posting 8 MiB bodies as fast as it could (about 500 a second from one
  local process) kept the event loop 90 % busy answering each through the app, and the
  other key's requests waited behind it (p50 1.4 s, 0.4 s alone). Bodies without a
  Content-Length are counted by the route as they arrive (routes.capped_body);
- a response's header names are written in their usual case (`Content-Type`): uvicorn's
  httptools protocol lower-cases them, which HTTP allows, but scripts that copy headers into
  a plain dict and read them by the names llama-server writes (llama.cpp's own server tests
  do) found nothing on ours. Only the head of each answer is touched (`UsualCase`).

The body's deadline is the route's (routes.capped_body). uvicorn documents `http=` as
taking a protocol class; both of its HTTP/1.1 protocols start a new request cycle once
a request's headers are complete and call on_response_complete when it has been
answered, and asyncio calls pause_writing/resume_writing as the write buffer passes its
high and low water marks, which is all this relies on.
"""
from __future__ import annotations

import json
import resource
from http import HTTPStatus

from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: The most bytes a request line and its headers may take.
HEADER_BYTES = 64 << 10


def closing_answer(status: int, message: str, code: str) -> bytes:
    """A whole HTTP response with an OpenAI-shaped error, for a connection the protocol
    answers itself and then closes (no request cycle exists to answer through)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def too_large() -> bytes:
    """The 431 sent before closing a connection whose headers went past HEADER_BYTES."""
    return closing_answer(431, f"the request line and headers are over {HEADER_BYTES} bytes",
                          "request_header_fields_too_large")


def body_over_cap(declared: int, max_body_bytes: int) -> str:
    """What a 413 for a declared body over the cap says, from the protocol or the route."""
    return f"the body is {declared} bytes; the server takes at most {max_body_bytes} (--max-body-bytes)"


def protocol(header_timeout: float, idle_per_address: int, base: type = AutoHTTPProtocol,
             header_bytes: int = HEADER_BYTES, send_timeout: float = 30.0, max_body_bytes: int | None = None) -> type:
    """uvicorn's HTTP protocol class `base` with the five rules above (the last only with
    `max_body_bytes`, and only for uvicorn's httptools protocol, the one that parses headers
    before it starts a request cycle: with h11 the route refuses)."""
    waiting: dict[str, dict] = {}        # address -> its connections without a request, oldest first

    class Guarded(base):
        _timer = None
        _header_seen = 0                 # bytes received while this request's headers are unfinished
        _stalled = None                  # the send deadline, while the write buffer is full

        def data_received(self, data: bytes) -> None:
            """Parse, then count what arrived if the headers are still unfinished (a chunk
            that completes them may carry a body, which is the route's to bound)."""
            super().data_received(data)
            if self._timer is None or not self._idle() or self.transport.is_closing():
                return
            self._header_seen += len(data)
            if self._header_seen > header_bytes:
                self._disarm()
                self.transport.write(too_large())
                self.transport.close()

        def on_headers_complete(self) -> None:
            declared = next((value for name, value in getattr(self, "headers", ()) if name == b"content-length"), b"")
            if max_body_bytes is not None and declared.isdigit() and int(declared) > max_body_bytes:
                self._disarm()
                self.transport.write(closing_answer(413, body_over_cap(int(declared), max_body_bytes),
                                                    "body_too_large"))
                self.transport.close()
                return
            super().on_headers_complete()
            self.cycle.transport = UsualCase(self.transport)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._address = self.client[0] if self.client else ""
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(send_timeout, self.transport.abort)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def _unstall(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _arm(self) -> None:
            """Start waiting for a request: the deadline, and a place in the address's queue."""
            self._disarm()
            self._header_seen = 0
            self._cycle_then = self.cycle
            self._timer = self.loop.call_later(header_timeout, self._expire)
            for other in [p for p in waiting.get(self._address, ()) if not p._idle()]:
                other._disarm()          # a request began there: its headers came in time
            queue = waiting.setdefault(self._address, {})
            queue[self] = None
            while len(queue) > idle_per_address:
                oldest = next(iter(queue))
                oldest._disarm()
                oldest.transport.close()

        def _idle(self) -> bool:
            """No request is being answered and none has begun since the connection was
            armed (a pipelined request may already be under way when it is re-armed)."""
            cycle = self.cycle
            return self._timer is not None and cycle is self._cycle_then and (
                cycle is None or cycle.response_complete)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            queue = waiting.get(self._address)
            if queue is not None:
                queue.pop(self, None)
                if not queue:
                    del waiting[self._address]

        def _expire(self) -> None:
            idle = self._idle()
            self._disarm()
            if idle and not self.transport.is_closing():
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class UsualCase:
    """A request cycle's transport that writes the header names of its answer's head (and of
    a 100 Continue before it) in their usual case; everything after the head goes as it is."""

    def __init__(self, transport):
        self._transport = transport
        self._head_sent = False

    def write(self, data: bytes) -> None:
        if not self._head_sent and data.startswith(b"HTTP/1."):
            self._head_sent = not data.startswith(b"HTTP/1.1 1")
            data = usual_case(data)
        self._transport.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def usual_case(head: bytes) -> bytes:
    """b"HTTP/1.1 200 OK\\r\\ncontent-type: x\\r\\n\\r\\n" -> the same with b"Content-Type"."""
    lines, end, rest = head.partition(b"\r\n\r\n")
    status, *fields = lines.split(b"\r\n")
    named = [b"-".join(w[:1].upper() + w[1:] for w in name.split(b"-")) + b":" + value
             for name, _, value in (field.partition(b":") for field in fields)]
    return b"\r\n".join([status, *named]) + end + rest


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as vLLM does at
    start): every connection is a descriptor, and at the usual 1024 a few hundred idle
    sockets would stop accept() for everyone. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
