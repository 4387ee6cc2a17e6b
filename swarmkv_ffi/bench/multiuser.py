"""Two users on one lmxd, one of them hostile: do the other's DECODEs keep their pace?

Needs root (the clients run as two other uids). The daemon runs as root with both uids
allowed and a small swap budget. The victim sends --decodes DECODEs of --max-tokens
tokens, one after another, each after a RESET (a short conversation), first alone and
then while the hostile uid runs, at once:

    flood      opens connections until the daemon says BUSY, and holds them
    slowloris  connections that send one byte every half second, never a whole line
    swaphog    registers agents until refused and decodes each, so their KV is paused
               into the swap budget
    queue      several connections that keep long DECODEs queued all the time

Prints the victim's p50/p99/max DECODE latency alone and under attack, their ratio, and
what the hostile user was refused; writes multiuser.json into --out.

    sudo .venv/bin/swarmkv bench multiuser --out bench/results/HOST-DATE/multiuser
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .daemon import start_lmxd, stop_lmxd
from .measure import report_json, settings_of

SYSTEM_PYTHON = "/usr/bin/python3"   # the venv may be unreadable to the other uids

#: Shared by both client scripts: one request, its reply's lines.
ASK = r"""
import json, os, socket, sys, threading, time
def connect(path):
    s = socket.socket(socket.AF_UNIX); s.connect(path); return s, s.makefile('rb')
def ask(s, f, line):
    s.sendall(line.encode() + b'\n'); out, body = [], False
    while True:
        raw = f.readline()
        if not raw: return out + ['ERR CLOSED']
        r = raw.decode('utf-8', 'replace').rstrip('\n'); out.append(r)
        if body: body = r != 'END_RESPONSE'
        elif r == 'BEGIN_RESPONSE': body = True
        elif r == 'OK done' or r.startswith('ERR '): return out
"""

VICTIM = ASK + r"""
path, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s, f = connect(path)
assert ask(s, f, 'REGISTER v smollm2-135m n_ctx=512')[-1] == 'OK done'
ask(s, f, 'DECODE v 4 warm up')
lat, errors, parts = [], [], []
for i in range(n):
    ask(s, f, 'RESET v')
    t = time.perf_counter()
    r = ask(s, f, f'DECODE v {max_tokens} Count with me, round {i}: 1, 2, 3, 4, 5, 6,')
    if r[-1] != 'OK done': errors.append(r[-1])
    lat.append((time.perf_counter() - t) * 1e3)
    kv = dict(p.split('=', 1) for line in r if line.startswith('OK ') for p in line[3:].split() if '=' in p)
    parts.append({k: float(kv[k]) for k in ('queued_ms', 'swap_ms', 'slices', 'generated_tokens') if k in kv})
ask(s, f, 'UNREGISTER v')
print(json.dumps({'latency_ms': lat, 'errors': errors, 'parts': parts}))
"""

HOSTILE = ASK + r"""
path, seconds, queue_threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
stop_at = time.monotonic() + seconds
counts, lock, held = {}, threading.Lock(), []
def count(what):
    with lock: counts[what] = counts.get(what, 0) + 1
def code(reply): return reply[-1].split()[1] if reply[-1].startswith('ERR ') else 'OK'
def flood():
    while time.monotonic() < stop_at:
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(path); s.settimeout(0.2)
            try:
                first = s.recv(100)
                if first.startswith(b'ERR BUSY'): count('flood_busy'); s.close(); time.sleep(0.5); continue
            except socket.timeout:
                pass
            held.append(s); count('flood_held')
        except OSError:
            count('flood_refused'); time.sleep(0.5)
def slowloris(k):
    socks = []
    for _ in range(k):
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(path); socks.append(s)
        except OSError: count('slowloris_refused')
    while time.monotonic() < stop_at:
        for s in list(socks):
            try: s.send(b'S')
            except OSError: socks.remove(s); count('slowloris_closed')
        time.sleep(0.5)
def swaphog():
    s, f = connect(path); i = 0
    while time.monotonic() < stop_at:
        r = ask(s, f, f'REGISTER hog{i} smollm2-135m n_ctx=256'); count('swaphog_register_' + code(r))
        if code(r) != 'OK': break
        count('swaphog_decode_' + code(ask(s, f, f'DECODE hog{i} 24 Fill the swap budget with text number {i}')))
        i += 1
def queue(j):
    s, f = connect(path)
    count('queue_register_' + code(ask(s, f, f'REGISTER q{j} smollm2-135m n_ctx=1024')))
    while time.monotonic() < stop_at:
        ask(s, f, f'RESET q{j}')
        count('queue_decode_' + code(ask(s, f, f'DECODE q{j} 400 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,')))
threads = [threading.Thread(target=flood, daemon=True), threading.Thread(target=slowloris, args=(6,), daemon=True),
           threading.Thread(target=swaphog, daemon=True)]
threads += [threading.Thread(target=queue, args=(j,), daemon=True) for j in range(queue_threads)]
def report(*_):
    with lock: print(json.dumps(counts), flush=True)
    os._exit(0)
import signal; signal.signal(signal.SIGTERM, report)
for t in threads: t.start()
while time.monotonic() < stop_at: time.sleep(0.2)
report()
"""


def as_uid(uid: int, script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([SYSTEM_PYTHON, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: (os.setgid(uid), os.setuid(uid)), **kw)


def summary(lat: list[float]) -> dict:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"n": len(lat), "p50_ms": statistics.median(lat), "p99_ms": q[98], "max_ms": max(lat)}


def start_daemon(sock: Path, args) -> subprocess.Popen:
    flags = ["--allow-uid", str(args.victim_uid), "--allow-uid", str(args.hostile_uid),
             "--swap-budget-bytes", str(args.swap_budget_bytes)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    return start_lmxd(sock, *flags, log=sock.parent / "lmxd.log")


def victim_run(sock: Path, args) -> dict:
    p = as_uid(args.victim_uid, VICTIM, str(sock), str(args.decodes), str(args.max_tokens))
    out, _ = p.communicate(timeout=3600)
    if p.returncode != 0:
        raise RuntimeError("the victim's client failed")
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarmkv bench multiuser", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", type=int, default=30, help="victim DECODEs per phase (default 30)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per victim DECODE (default 32)")
    p.add_argument("--queue-threads", type=int, default=4, help="hostile connections keeping DECODEs queued")
    p.add_argument("--swap-budget-bytes", type=int, default=16 << 20, help="the daemon's swap budget (default 16 MiB)")
    p.add_argument("--threads", type=int, default=None, help="the daemon's CPU threads per context")
    p.add_argument("--victim-uid", type=int, default=4242)
    p.add_argument("--hostile-uid", type=int, default=65534)
    p.add_argument("--out", type=Path, default=None, help="folder for multiuser.json")
    args = p.parse_args(argv)
    if os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        print("swarmkv bench multiuser: needs root and /usr/bin/python3 (clients run as other uids)",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="lmxd-multiuser-"))
    os.chmod(tmp, 0o755)
    sock = tmp / "lmx.sock"
    daemon = start_daemon(sock, args)
    try:
        print(f"victim alone: {args.decodes} DECODEs of {args.max_tokens} tokens ...", flush=True)
        alone = victim_run(sock, args)
        attack_s = 3600.0
        hostile = as_uid(args.hostile_uid, HOSTILE, str(sock), str(attack_s), str(args.queue_threads))
        time.sleep(5)                                   # its flood, queue and hog are in place
        print("victim under attack ...", flush=True)
        attacked = victim_run(sock, args)
        hostile.terminate()
        hostile_out, _ = hostile.communicate(timeout=30)
        alive = daemon.poll() is None
    finally:
        stop_lmxd(daemon)
        log_tail = (tmp / "lmxd.log").read_text()[-4000:]
        if os.environ.get("SWARMKV_KEEP_LOG"):
            shutil.copy(tmp / "lmxd.log", os.environ["SWARMKV_KEEP_LOG"])
        shutil.rmtree(tmp, ignore_errors=True)
    a, h = summary(alone["latency_ms"]), summary(attacked["latency_ms"])
    for name, run in (("alone", a), ("under_attack", h)):
        parts = (alone if name == "alone" else attacked)["parts"]
        for key in ("queued_ms", "swap_ms", "slices", "generated_tokens"):
            run[f"mean_{key}"] = statistics.fmean(p.get(key, 0.0) for p in parts) if parts else None
    report = {"benchmark": "multiuser", "model": "smollm2-135m", "alone": a, "under_attack": h,
              "p99_ratio": h["p99_ms"] / a["p99_ms"], "p50_ratio": h["p50_ms"] / a["p50_ms"],
              "victim_errors": {"alone": alone["errors"], "under_attack": attacked["errors"]},
              "hostile_counts": json.loads(hostile_out) if hostile_out.strip().startswith("{") else None,
              "daemon_alive_after": alive, "daemon_log_tail": log_tail[-1500:]}
    print(f"victim p50 {a['p50_ms']:.0f} -> {h['p50_ms']:.0f} ms, p99 {a['p99_ms']:.0f} -> {h['p99_ms']:.0f} ms "
          f"({report['p99_ratio']:.2f}x); errors under attack: {len(attacked['errors'])}")
    report_json(report, args.out / "multiuser.json" if args.out else None, settings_of(args),
                shown={k: report[k] for k in ("alone", "under_attack", "p99_ratio", "hostile_counts",
                                              "victim_errors", "daemon_alive_after")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
