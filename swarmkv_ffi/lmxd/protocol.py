"""The lmxd line protocol: one UTF-8 request per line, replies made of lines.

Reply shape: `OK schema=lmx-daemon/1`, `OK invoke=VERB …`, more `OK key=value …` lines,
an optional body between BEGIN_RESPONSE and END_RESPONSE, and a final `OK done`. An
error is one final line: `ERR <CODE> <details>`. Body lines that are exactly
END_RESPONSE or start with "." get one extra leading "." (dot-stuffing, as in SMTP).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMA = "lmx-daemon/1"
FINAL_OK = "OK done"

ERROR_CODES = {
    "BAD_REQUEST": "malformed request: wrong argument count, bad number, empty line",
    "BAD_ENCODING": "the line is not UTF-8 text",
    "UNKNOWN_VERB": "the first word is not a verb listed here",
    "LINE_TOO_LONG": "the line exceeds the daemon's cap (default 64 KiB); it was discarded",
    "UNKNOWN_AGENT": "no agent with that id",
    "UNKNOWN_MODEL": "the model is not a packaged short name or a file in the daemon's --models-dir (send your own file as @fd)",
    "DUPLICATE_AGENT": "an agent with that id is already registered",
    "VRAM_LEDGER_DENY": "code=CAP: the agent does not fit the memory budget; code=USER_SHARE: nor your share of it (numbers follow)",
    "MODEL_LOAD_FAILED": "the model file or its context could not be loaded (an untrusted file is tried in a sandbox first: signal=… says how it died)",
    "CONTEXT_FULL": "the conversation would exceed the agent's n_ctx; RESET it",
    "BAD_PREFIX": "the prefix= document cannot be used: not a regular file, on procfs/sysfs, not UTF-8, too big for n_ctx",
    "FORBIDDEN": "the connecting user may not use this daemon, or may not name paths (send descriptors)",
    "QUOTA": "this user already has as many agents as one user may (--max-agents-per-uid)",
    "BUSY": "the daemon, or your share of its connections, is full; try again later",
    "CANCELLED": "the request was stopped before it finished (the client disconnected, or the daemon is stopping); nothing changed",
    "SWAP_BUDGET_DENY": "no host RAM left in the swap budget (code=CAP) or your share of it (code=USER_SHARE) to keep your paused agent's KV",
    "IDLE_TIMEOUT": "no complete request line arrived within the idle timeout; the connection was closed",
    "INTERNAL": "an unexpected failure; the daemon logged it and keeps running",
}

HELP = [
    "HELP                                   this text",
    "STATUS                                 ledger, live device memory, models, uptime",
    "LIST                                   one line per agent",
    "REGISTER <agent_id> <model> [n_ctx=N] [prefix=@fd]",
    "                                       admit an agent. model: a packaged short name, a file",
    "                                       name in the daemon's --models-dir, or @fd (the file's",
    "                                       descriptor, sent with this line by SCM_RIGHTS). prefix:",
    "                                       a UTF-8 document the agent starts from (@fd, after the",
    "                                       model's), shared by your agents of that model over it.",
    "                                       The daemon's own user may also name paths.",
    "UNREGISTER <agent_id>                  remove an agent, free its reservation",
    "DECODE <agent_id> <max_tokens> <prompt...>  continue the agent's conversation",
    "RESET <agent_id>                       clear the agent's conversation",
    "agent ids: 1-64 of [A-Za-z0-9_.:-], named per user; model paths may not contain whitespace",
]


class ProtocolError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Request:
    verb: str
    args: dict


DECIMAL = re.compile(r"[0-9]{1,18}")


def _int(name: str, text: str) -> int:
    """Plain ASCII decimal digits only: no sign, no '_', no other scripts' digits."""
    if not DECIMAL.fullmatch(text):
        raise ProtocolError("BAD_REQUEST", f"{name} must be a decimal integer, got {escape(text[:32])}")
    return int(text, 10)


def _arity(verb: str, parts: list[str], n: int, usage: str) -> None:
    if len(parts) != n:
        raise ProtocolError("BAD_REQUEST", f"usage: {usage}")


def parse(raw: bytes) -> Request:
    """One request line (without its newline) → Request, or ProtocolError."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("BAD_ENCODING", "request is not UTF-8") from None
    line = line.rstrip("\r")
    if not line.strip():
        raise ProtocolError("BAD_REQUEST", "empty request line (try HELP)")
    if any(ord(c) < 32 and c != "\t" for c in line):
        raise ProtocolError("BAD_REQUEST", "control characters in request")
    verb, _, rest = line.strip().partition(" ")
    verb = verb.upper()
    if verb in ("HELP", "STATUS", "LIST"):
        if rest.strip():
            raise ProtocolError("BAD_REQUEST", f"usage: {verb}")
        return Request(verb, {})
    if verb == "REGISTER":
        parts = rest.split()
        if not 2 <= len(parts) <= 4:
            raise ProtocolError("BAD_REQUEST", "usage: REGISTER <agent_id> <model> [n_ctx=N] [prefix=@fd]")
        args = {"agent_id": parts[0], "model": parts[1], "n_ctx": 2048, "prefix": None}
        for option in parts[2:]:
            key, eq, value = option.partition("=")
            if key not in ("n_ctx", "prefix") or not eq or not value:
                raise ProtocolError("BAD_REQUEST", f"unknown option {escape(option[:32])} (n_ctx=N or prefix=@fd)")
            args[key] = _int("n_ctx", value) if key == "n_ctx" else value
        return Request(verb, args)
    if verb in ("UNREGISTER", "RESET"):
        parts = rest.split()
        _arity(verb, parts, 1, f"{verb} <agent_id>")
        return Request(verb, {"agent_id": parts[0]})
    if verb == "DECODE":
        parts = rest.split(" ", 2)
        if len(parts) < 3 or not parts[2].strip():
            raise ProtocolError("BAD_REQUEST", "usage: DECODE <agent_id> <max_tokens> <prompt...>")
        return Request(verb, {"agent_id": parts[0], "max_tokens": _int("max_tokens", parts[1]),
                              "prompt": parts[2]})
    raise ProtocolError("UNKNOWN_VERB", f"unknown verb {verb[:32]!r} (try HELP)")


def escape(text: str) -> str:
    """A value safe inside a reply line: whitespace, control characters and backslashes
    become \\xNN, so no value can end a line, split a field or fake another line."""
    return "".join(f"\\x{ord(c):02x}" if c.isspace() or ord(c) < 32 or ord(c) == 127 or c == "\\"
                   or not c.isprintable() else c for c in text)


def kv(**pairs) -> str:
    """'key=value key=value', booleans lower-case, None as '-', strings escaped."""
    def fmt(v):
        if isinstance(v, bool):
            return str(v).lower()
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}"
        return escape(str(v))
    return " ".join(f"{k}={fmt(v)}" for k, v in pairs.items())


def ok(verb: str, lines: list[str], body: str | None = None, **invoke) -> str:
    out = [f"OK schema={SCHEMA}", "OK " + " ".join([f"invoke={verb}"] + ([kv(**invoke)] if invoke else []))]
    out += [f"OK {line}" for line in lines]
    if body is not None:
        out.append("BEGIN_RESPONSE")
        for line in body.split("\n"):
            stuffed = line.rstrip("\r") == "END_RESPONSE" or line.startswith(".")
            out.append("." + line if stuffed else line)
        out.append("END_RESPONSE")
    out.append(FINAL_OK)
    return "\n".join(out) + "\n"


def err(code: str, message: str) -> str:
    """One line; whitespace runs become one space and control characters are escaped."""
    return f"ERR {code} {escape(' '.join(message.split())).replace(chr(92) + 'x20', ' ')}\n"


def read_reply(reader) -> list[str]:
    """One reply's lines from a binary reader (sock.makefile("rb")), the client's side:
    up to `OK done` or an ERR line, a BEGIN_RESPONSE … END_RESPONSE body read whole.
    Raises EOFError when the connection closes before the reply ends."""
    lines, in_body = [], False
    while True:
        raw = reader.readline()
        if not raw:
            raise EOFError(f"lmxd closed the connection mid-reply (after {len(lines)} lines)")
        line = raw.decode("utf-8", "replace").rstrip("\n")
        lines.append(line)
        if in_body:
            in_body = line != "END_RESPONSE"
        elif line == "BEGIN_RESPONSE":
            in_body = True
        elif line == FINAL_OK or line.startswith("ERR "):
            return lines


def help_reply() -> str:
    lines = HELP + [f"error {code}: {meaning}" for code, meaning in ERROR_CODES.items()]
    return ok("HELP", [], body="\n".join(lines))
