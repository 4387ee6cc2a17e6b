"""Soak: 64 clients x 1,000 mixed requests against one lmxd, including disconnects,
malformed lines and REGISTER/UNREGISTER churn. The daemon must stay alive, the ledger
must never pass its cap and must end at exactly 0, and every reply must be well formed.

Slow (minutes on two cores), so it runs only when asked:

    SWARMKV_SOAK=1 .venv/bin/python -m pytest -q tests/conductor/test_conductor_soak.py -s

It prints its figures and writes them to $SWARMKV_SOAK_OUT (default: soak.json in the
test's temporary folder).
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest

from lmxd_daemon import Daemon, outside_body
from swarmkv_ffi.lmxd.protocol import read_reply

pytestmark = [pytest.mark.skipif(os.environ.get("SWARMKV_SOAK") != "1", reason="set SWARMKV_SOAK=1 to run"),
              pytest.mark.timeout(3600)]

CLIENTS, REQUESTS = 64, 1000
CAP = 600_000_000
WELL_FORMED = re.compile(r"^(OK .*|ERR [A-Z_]+ .*|BEGIN_RESPONSE|END_RESPONSE)$")


class Client:
    def __init__(self, path: Path):
        self.path = path
        self.connect()

    def connect(self):
        for _ in range(400):
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(600)
                self.sock.connect(str(self.path))
                break
            except BlockingIOError:
                self.sock.close()
                time.sleep(0.05)
        self.reader = self.sock.makefile("rb")

    def ask(self, line: bytes) -> list[str]:
        self.sock.sendall(line + b"\n")
        reply = read_reply(self.reader)
        for text in outside_body(reply):
            assert WELL_FORMED.match(text), f"malformed reply line {text!r} to {line[:40]!r}"
        return reply


def sample_daemon(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    hwm = int(re.search(r"^VmHWM:\s+(\d+)", status, re.M).group(1)) * 1024
    return threads, hwm


def test_soak(tmp_path):
    d = Daemon(tmp_path, "--budget-bytes", str(CAP), "--max-clients", "256")
    errors, status_ms, ledger_seen, peaks = [], [], [], {"threads": 0, "rss": 0}
    done = threading.Event()

    def watch():
        while not done.wait(0.2):
            threads, rss = sample_daemon(d.proc.pid)
            peaks["threads"], peaks["rss"] = max(peaks["threads"], threads), max(peaks["rss"], rss)

    def worker(k: int):
        rng = random.Random(k)
        c, mine = Client(d.path), None
        try:
            for i in range(REQUESTS):
                roll = rng.random()
                if roll < 0.02:                      # disconnect, sometimes mid-DECODE
                    if mine and rng.random() < 0.5:
                        c.sock.sendall(f"DECODE {mine} 50 Tell me a story\n".encode())
                    c.sock.close()
                    c.connect()
                elif roll < 0.03:                    # churn
                    if mine:
                        c.ask(f"UNREGISTER {mine}".encode())
                        mine = None
                    else:
                        reply = c.ask(f"REGISTER w{k}-{i} smollm2-135m n_ctx=256".encode())
                        if reply[-1] == "OK done":
                            mine = f"w{k}-{i}"
                        else:
                            assert reply[-1].startswith("ERR VRAM_LEDGER_DENY"), reply[-1]
                elif roll < 0.04 and mine:
                    reply = c.ask(f"DECODE {mine} 1 Hi".encode())
                    assert reply[-1] == "OK done" or reply[-1].startswith(("ERR CONTEXT_FULL", "ERR SWAP")), reply[-1]
                    if reply[-1].startswith("ERR CONTEXT_FULL"):
                        c.ask(f"RESET {mine}".encode())
                elif roll < 0.15:
                    bad = rng.choice([b"", b"NOPE", b"DECODE", b"REGISTER x", b"\xff\xfe", b"DECODE a +1 x",
                                      b"STATUS extra", b"REGISTER a b n_ctx=1_0"])
                    assert c.ask(bad)[-1].startswith("ERR "), bad
                elif roll < 0.6:
                    t0 = time.perf_counter()
                    reply = c.ask(b"STATUS")
                    status_ms.append((time.perf_counter() - t0) * 1e3)
                    f = dict(p.split("=", 1) for line in reply for p in line[3:].split() if "=" in p)
                    ledger_seen.append(int(f["ledger_allocated_bytes"]))
                else:
                    c.ask(rng.choice([b"LIST", b"HELP"]))
            if mine:
                c.ask(f"UNREGISTER {mine}".encode())
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(f"client {k}: {exc!r}")
        finally:
            c.sock.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3000)
    elapsed = time.perf_counter() - t0
    done.set()
    try:
        assert not errors, errors[:5]
        assert d.proc.poll() is None, "the daemon died"
        deadline = time.time() + 60
        while True:   # abandoned DECODEs finish, then every reservation is gone
            final = Client(d.path).ask(b"STATUS")
            f = dict(p.split("=", 1) for line in final for p in line[3:].split() if "=" in p)
            if f["ledger_allocated_bytes"] == "0" or time.time() > deadline:
                break
            time.sleep(0.5)
        assert f["ledger_allocated_bytes"] == "0" and f["agents"] == "0", f
        assert max(ledger_seen) <= CAP
    finally:
        d.stop()
    figures = {
        "clients": CLIENTS, "requests_per_client": REQUESTS, "elapsed_s": round(elapsed, 1),
        "ops_per_s": round(CLIENTS * REQUESTS / elapsed, 1),
        "status_p50_ms": round(statistics.median(status_ms), 2),
        "status_p99_ms": round(statistics.quantiles(status_ms, n=100)[98], 2),
        "peak_daemon_threads": peaks["threads"], "peak_daemon_rss_bytes": peaks["rss"],
        "ledger_max_seen_bytes": max(ledger_seen), "ledger_cap_bytes": CAP,
    }
    print(json.dumps(figures, indent=2))
    out = Path(os.environ.get("SWARMKV_SOAK_OUT", tmp_path / "soak.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
