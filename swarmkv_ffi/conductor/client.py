"""A Python client for lmxd, and the `lmx` command built on it.

    with LmxClient("/tmp/lmx.sock") as c:
        c.register("smol", "smollm2-135m", n_ctx=1024)
        print(c.decode("smol", 24, "Once upon a time")["text"])
"""
from __future__ import annotations

import argparse
import json
import socket
import sys

from ..errors import SwarmKVError
from .protocol import FINAL_OK


class LmxError(SwarmKVError):
    """The daemon answered ERR <code> <message>."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code} {message}".strip())
        self.code, self.message = code, message


def register_line(agent_id: str, model: str, n_ctx: int | None, prefix: str | None) -> str:
    if prefix is not None and (not prefix or any(c.isspace() for c in prefix)):
        raise ValueError(f"prefix path must be non-empty and without whitespace: {prefix!r}")
    return (f"REGISTER {agent_id} {model}" + (f" n_ctx={n_ctx}" if n_ctx else "")
            + (f" prefix={prefix}" if prefix else ""))


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

    def raw(self, line: str | bytes) -> list[str]:
        """Send one request line; return the reply's lines (ERR replies included)."""
        data = line if isinstance(line, bytes) else line.encode("utf-8")
        self.sock.sendall(data.rstrip(b"\n") + b"\n")
        return self.read_reply()

    def read_reply(self) -> list[str]:
        lines, in_body = [], False
        while True:
            raw = self._reader.readline()
            if not raw:
                raise SwarmKVError("lmxd closed the connection mid-reply")
            line = raw.decode("utf-8", "replace").rstrip("\n")
            lines.append(line)
            if in_body:
                in_body = line != "END_RESPONSE"
            elif line == "BEGIN_RESPONSE":
                in_body = True
            elif line == FINAL_OK or line.startswith("ERR "):
                return lines

    def request(self, line: str) -> dict:
        """Send a request; parse the reply into {"fields": {...}, "lines": [...], "text": body}
        or raise LmxError."""
        return parse_reply(self.raw(line))

    # ---- verbs ---------------------------------------------------------------------------------
    def help(self) -> str:
        return self.request("HELP")["text"]

    def status(self) -> dict:
        return self.request("STATUS")

    def list(self) -> list[dict]:
        return [dict(_pairs(line[3:])) for line in self.request("LIST")["lines"] if line.startswith("OK agent_id=")]

    def register(self, agent_id: str, model: str, n_ctx: int | None = None, prefix: str | None = None) -> dict:
        """prefix: path (as the daemon sees it, no whitespace) of a document the agent starts from."""
        return self.request(register_line(agent_id, model, n_ctx, prefix))

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
    r.add_argument("model")
    r.add_argument("--n-ctx", type=int)
    r.add_argument("--prefix", metavar="PATH", help="a document the agent starts from (shared with "
                   "other agents of the model over the same document; path as the daemon sees it)")
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
            line = {"help": "HELP", "status": "STATUS", "list": "LIST",
                    "register": register_line(args.agent_id, args.model, args.n_ctx, args.prefix)
                                if args.verb == "register" else "",
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
