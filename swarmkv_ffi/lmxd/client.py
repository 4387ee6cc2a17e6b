"""A Python client for lmxd, and the `lmx` command built on it.

    with LmxClient("/tmp/lmx.sock") as c:
        c.register("smol", "smollm2-135m", n_ctx=1024)
        print(c.decode("smol", 24, "Once upon a time")["text"])

Files are opened here, with the caller's own credentials, and their descriptors sent to
the daemon (SCM_RIGHTS): a model given as a path and every prefix document. The daemon
never opens a path a client names (see docs/lmxd-security.md).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from .. import catalog
from ..errors import SwarmKVError
from .protocol import FINAL_OK, read_reply

FD_TOKEN = "@fd"


class LmxError(SwarmKVError):
    """The daemon answered ERR <code> <message>."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code} {message}".strip())
        self.code, self.message = code, message


def register_request(agent_id: str, model: str, n_ctx: int | None, prefix: str | None) -> tuple[str, list[int]]:
    """The REGISTER line and the descriptors to send with it (the caller closes them).
    A model that is not a packaged short name but an existing file is opened here; so
    is the prefix document."""
    fds: list[int] = []
    try:
        if model not in catalog.CATALOG and Path(model).expanduser().is_file():
            fds.append(open_for_daemon(model, "model"))
            model = FD_TOKEN
        if prefix is not None:
            if not prefix:
                raise ValueError("prefix path must not be empty")
            fds.append(open_for_daemon(prefix, "prefix document"))
        line = (f"REGISTER {agent_id} {model}" + (f" n_ctx={n_ctx}" if n_ctx else "")
                + (f" prefix={FD_TOKEN}" if prefix is not None else ""))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return line, fds


def open_for_daemon(path: str, what: str) -> int:
    try:
        return os.open(Path(path).expanduser(), os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise SwarmKVError(f"cannot open the {what} {path}: {exc.strerror}") from None


class LmxClient:
    def __init__(self, path: str, timeout: float | None = 600.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise SwarmKVError(f"cannot connect to lmxd at {path}: {exc.strerror or exc}") from None
        self._reader = self.sock.makefile("rb")

    def close(self) -> None:
        self._reader.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def raw(self, line: str | bytes, fds: list[int] = ()) -> list[str]:
        """Send one request line (with `fds`, SCM_RIGHTS); return the reply's lines (ERR
        replies included)."""
        data = (line if isinstance(line, bytes) else line.encode("utf-8")).rstrip(b"\n") + b"\n"
        if fds:
            sent = socket.send_fds(self.sock, [data], list(fds))
            data = data[sent:]
        if data:
            self.sock.sendall(data)
        return self.read_reply()

    def read_reply(self) -> list[str]:
        try:
            return read_reply(self._reader)
        except EOFError as exc:
            raise SwarmKVError(str(exc)) from None

    def request(self, line: str, fds: list[int] = ()) -> dict:
        """Send a request; parse the reply into {"fields": {...}, "lines": [...], "text": body}
        or raise LmxError."""
        return parse_reply(self.raw(line, fds))

    # ---- verbs ---------------------------------------------------------------------------------
    def help(self) -> str:
        return self.request("HELP")["text"]

    def status(self) -> dict:
        return self.request("STATUS")

    def list(self) -> list[dict]:
        return [dict(_pairs(line[3:])) for line in self.request("LIST")["lines"] if line.startswith("OK agent_id=")]

    def register(self, agent_id: str, model: str, n_ctx: int | None = None, prefix: str | None = None) -> dict:
        """model: a packaged short name, a file name in the daemon's --models-dir, or a
        path of yours (opened here and sent). prefix: a document the agent starts from."""
        line, fds = register_request(agent_id, model, n_ctx, prefix)
        try:
            return self.request(line, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def unregister(self, agent_id: str) -> dict:
        return self.request(f"UNREGISTER {agent_id}")

    def decode(self, agent_id: str, max_tokens: int, prompt: str) -> dict:
        if "\n" in prompt:
            raise ValueError("a prompt is one line: replace newlines before sending")
        return self.request(f"DECODE {agent_id} {max_tokens} {prompt}")

    def reset(self, agent_id: str) -> dict:
        return self.request(f"RESET {agent_id}")


def _pairs(text: str):
    for item in text.split():
        key, eq, value = item.partition("=")
        if eq:
            yield key, value


def parse_reply(lines: list[str]) -> dict:
    last = lines[-1]
    if last.startswith("ERR "):
        _, code, *rest = last.split(" ", 2)
        raise LmxError(code, rest[0] if rest else "")
    fields, body, in_body = {}, [], False
    for line in lines:
        if in_body:
            if line == "END_RESPONSE":
                in_body = False
            else:
                body.append(line[1:] if line.startswith(".") else line)
        elif line == "BEGIN_RESPONSE":
            in_body = True
        elif line.startswith("OK ") and line != FINAL_OK:
            fields.update(_pairs(line[3:]))
    return {"fields": fields, "lines": lines, "text": "\n".join(body) if body or "BEGIN_RESPONSE" in lines else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmx", description="Talk to an lmxd daemon.")
    p.add_argument("--socket", required=True, help="the daemon's Unix socket")
    p.add_argument("--json", action="store_true", help="print the parsed reply as JSON")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("help")
    sub.add_parser("status")
    sub.add_parser("list")
    r = sub.add_parser("register")
    r.add_argument("agent_id")
    r.add_argument("model", help="a packaged short name, a file name in the daemon's --models-dir, "
                   "or a path (opened here, with your permissions, and sent to the daemon)")
    r.add_argument("--n-ctx", type=int)
    r.add_argument("--prefix", metavar="PATH", help="a document the agent starts from (opened here and "
                   "sent; shared with your other agents of the model over the same document)")
    for verb in ("unregister", "reset"):
        sub.add_parser(verb).add_argument("agent_id")
    d = sub.add_parser("decode")
    d.add_argument("agent_id")
    d.add_argument("max_tokens", type=int)
    d.add_argument("prompt", nargs="+")
    raw = sub.add_parser("raw", help="send one protocol line as is")
    raw.add_argument("line", nargs="+")
    args = p.parse_args(argv)
    try:
        with LmxClient(args.socket) as c:
            if args.verb == "raw":
                print("\n".join(c.raw(" ".join(args.line))))
                return 0
            if args.verb == "register":
                reply = c.register(args.agent_id, args.model, args.n_ctx, args.prefix)
            else:
                line = {"help": "HELP", "status": "STATUS", "list": "LIST",
                        "unregister": f"UNREGISTER {getattr(args, 'agent_id', '')}",
                        "reset": f"RESET {getattr(args, 'agent_id', '')}",
                        "decode": f"DECODE {getattr(args, 'agent_id', '')} {getattr(args, 'max_tokens', '')} "
                                  + " ".join(getattr(args, "prompt", []))}[args.verb]
                reply = c.request(line)
    except LmxError as exc:
        print(f"lmx: ERR {exc}", file=sys.stderr)
        return 1
    except SwarmKVError as exc:
        print(f"lmx: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"fields": reply["fields"], "text": reply["text"]}, indent=2))
    else:
        print("\n".join(reply["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
