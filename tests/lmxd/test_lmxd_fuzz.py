"""10,000 random request lines into a real lmxd: every reply is well formed (ends with
`OK done` or is one `ERR <CODE> …` line with a documented code) and the daemon lives.

The generator is seeded (reproducible) and mixes valid verbs with bad arities, odd
numbers, control characters, invalid UTF-8, over-long tokens, option soup and raw bytes.
Real work stays small: DECODEs of one token on one registered agent."""
from __future__ import annotations

import random

import pytest

from lmxd_daemon import Daemon
from swarmkv_ffi.lmxd import protocol
from swarmkv_ffi.lmxd.protocol import read_reply

pytestmark = pytest.mark.timeout(600)

N_LINES = 10_000
VERBS = ["HELP", "STATUS", "LIST", "REGISTER", "UNREGISTER", "DECODE", "RESET", "help", "Decode", "NOPE", ""]
WORDS = ["fz", "other", "smollm2-135m", "@fd", "n_ctx=256", "n_ctx=-1", "n_ctx=1_0", "prefix=@fd", "prefix=",
         "prefix=/etc/passwd", "/etc/shadow", "../../x", "1", "0", "4097", "99999999999999999999", "\u0663",
         "+5", "x" * 300, "a:b", "é", "\\x00", "=", "n_ctx"]


def random_line(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b"")
    if kind < 0.08:
        return b"DECODE fz 1 \xff\xfe bad utf-8"
    verb = rng.choice(VERBS)
    words = [rng.choice(WORDS) for _ in range(rng.randrange(0, 5))]
    if verb.upper() == "DECODE" and rng.random() < 0.5:
        words = ["fz", "1", "hi"]
    if verb.upper() == "UNREGISTER":
        words = ["other" if w == "fz" else w for w in words]   # the one real agent stays
    if verb.upper() == "REGISTER" and "smollm2-135m" in words:
        words = [w for w in words if w != "smollm2-135m"]      # do not load models 1,000 times
    line = " ".join([verb] + words)
    if rng.random() < 0.05:
        line += rng.choice(["\t", "\r", "\x01", "\x7f", "  ", "\u2028"])
    return line.encode("utf-8", "surrogatepass")


def well_formed(reply: list[str]) -> bool:
    if len(reply) == 1:
        parts = reply[0].split(" ", 2)
        return parts[0] == "ERR" and len(parts) >= 2 and parts[1] in protocol.ERROR_CODES
    return (reply[0] == f"OK schema={protocol.SCHEMA}" and reply[1].startswith("OK invoke=")
            and reply[-1] == protocol.FINAL_OK)


@pytest.mark.slow
def test_ten_thousand_random_lines(tmp_path):
    rng = random.Random(20261201)
    with Daemon(tmp_path) as d:
        with d.client() as c:
            c.register("fz", "smollm2-135m", n_ctx=4096)
        sock = d.raw_socket()
        reader = sock.makefile("rb")
        codes: dict[str, int] = {}
        for i in range(N_LINES):
            line = random_line(rng)
            sock.sendall(line + b"\n")
            reply = read_reply(reader)
            assert well_formed(reply), (i, line, reply)
            code = reply[0].split()[1] if reply[0].startswith("ERR ") else "OK"
            codes[code] = codes.get(code, 0) + 1
            if i % 500 == 0:
                sock.sendall(b"RESET fz\n")          # keep the one agent's context from filling
                assert read_reply(reader)[-1] == protocol.FINAL_OK
        sock.close()
        assert d.proc.poll() is None
        with d.client() as c:
            assert c.status()["fields"]["agents"] == "1"
        assert {"OK", "BAD_REQUEST", "UNKNOWN_VERB", "UNKNOWN_AGENT"} <= set(codes), codes
