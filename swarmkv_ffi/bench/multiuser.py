"""Two users on one lmxd, one of them hostile: do the other's DECODEs keep their pace?

Needs root (the clients run as other uids). The daemon runs as root with the uids
allowed and a small swap budget. The victim sends --decodes DECODEs of --max-tokens
tokens, one after another, each after a RESET (a short conversation), first alone and
then while the hostile uid runs one attack (--attacks, each in its own phase):

    prefill    one ~7,000-word prompt after another (1-token DECODEs, then RESET)
    newcomer   a uid that never used the daemon starts three streams (the victim has history)
    churn      a prefix agent in the victim's exact pool: DECODE 1 token + RESET in a loop
               (the victim's agent is a prefix agent over a document in this phase)
    stall      REGISTERs of a large n_ctx while agents of the same model are unregistered
    grow       agents of growing n_ctx registered one at a time, each decoded, then all
               unregistered; the pools' cells are sampled against the ledger's booking
    ladder     issue #50's: agents of n_ctx 6,144 .. 36,864, each registered, decoded 1
               token and unregistered before the next; the victim keeps one conversation
               (no RESET, so a pause would have KV to swap) and counts its DECODEs
               restored from host RAM; pools sampled as in grow
    oracle     the hostile user times 1-token DECODEs sent with the victim's at the same
               moment, half opening with the victim's prompt, half not, and classifies
               its samples by time (threshold chosen on one half, scored on the other)
    mixed      connections until BUSY held open, slowloris lines, agents registered until
               refused (their KV paused into the swap budget), long DECODEs kept queued

Prints the victim's p50/p99/max DECODE latency alone and under each attack and their
ratio, what the hostile user was refused, and the oracle's accuracy; writes
multiuser.json into --out.

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
import threading
import time
from pathlib import Path

from .daemon import start_lmxd, stop_lmxd
from .measure import EXAMPLES, report_json, settings_of

SYSTEM_PYTHON = "/usr/bin/python3"   # the venv may be unreadable to the other uids
#: In this order: `mixed` last, since its hog's agents stay registered and hold the swap share.
ATTACKS = ("prefill", "newcomer", "churn", "stall", "grow", "ladder", "oracle", "mixed")
#: Issue #50's ladder of n_ctx (the ladder attack).
LADDER = (6144, 12288, 18432, 24576, 30720, 36864)

#: Shared by the client scripts: one request (with descriptors), its reply's lines.
ASK = r"""
import json, os, socket, sys, threading, time
def connect(path):
    s = socket.socket(socket.AF_UNIX); s.connect(path); return s, s.makefile('rb')
def ask(s, f, line, files=()):
    fds = [os.open(p, os.O_RDONLY) for p in files]
    data = line.encode() + b'\n'
    if fds: socket.send_fds(s, [data], fds); [os.close(fd) for fd in fds]
    else: s.sendall(data)
    out, body = [], False
    while True:
        raw = f.readline()
        if not raw: return out + ['ERR CLOSED']
        r = raw.decode('utf-8', 'replace').rstrip('\n'); out.append(r)
        if body: body = r != 'END_RESPONSE'
        elif r == 'BEGIN_RESPONSE': body = True
        elif r == 'OK done' or r.startswith('ERR '): return out
def fields(reply):
    return dict(p.split('=', 1) for line in reply if line.startswith('OK ') for p in line[3:].split() if '=' in p)
"""

VICTIM = ASK + r"""
path, n, max_tokens, doc, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == '1'
s, f = connect(path)
n_ctx = max(1024, 64 + n * (max_tokens + 40)) if keep else 1024   # keep: room for the whole conversation
reg = f'REGISTER v smollm2-135m n_ctx={n_ctx}' + (' prefix=@fd' if doc != '-' else '')
assert ask(s, f, reg, [doc] if doc != '-' else [])[-1] == 'OK done'
ask(s, f, 'DECODE v 4 warm up')
lat, errors, parts = [], [], []
for i in range(n):
    if not keep: ask(s, f, 'RESET v')
    t = time.perf_counter()
    r = ask(s, f, f'DECODE v {max_tokens} Count with me, round {i}: 1, 2, 3, 4, 5, 6,')
    if r[-1] != 'OK done': errors.append(r[-1])
    lat.append((time.perf_counter() - t) * 1e3)
    kv = fields(r)
    parts.append({k: float(kv[k]) for k in ('queued_ms', 'swap_ms', 'slices', 'generated_tokens') if k in kv})
    parts[-1]['restored'] = kv.get('kv_swap_restored') == 'true'
ask(s, f, 'UNREGISTER v')
print(json.dumps({'latency_ms': lat, 'errors': errors, 'parts': parts}))
"""

#: The oracle's two sides: DECODEs sent at the same wall-clock slots (every PERIOD s).
SLOTS = ASK + r"""
path, role, n, period, t0, secret = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
s, f = connect(path)
assert ask(s, f, f'REGISTER {role} smollm2-135m n_ctx=1024')[-1] == 'OK done'
samples = []
for k in range(n):
    ask(s, f, f'RESET {role}')
    while time.time() < t0 + k * period: time.sleep(0.0005)
    match = role == 'victim' or k % 2 == 0
    prompt = secret if match else 'Nothing ' + secret.split(' ', 1)[1]
    t = time.perf_counter()
    r = ask(s, f, f'DECODE {role} 1 {prompt}')
    samples.append({'match': match, 'ms': (time.perf_counter() - t) * 1e3, 'ok': r[-1] == 'OK done'})
ask(s, f, f'UNREGISTER {role}')
print(json.dumps(samples))
"""

HOSTILE = ASK + f"LADDER = {LADDER!r}\n" + r"""
path, seconds, attack, doc, queue_threads = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
stop_at = time.monotonic() + seconds
counts, lock, held = {}, threading.Lock(), []
def count(what):
    with lock: counts[what] = counts.get(what, 0) + 1
def code(reply): return reply[-1].split()[1] if reply[-1].startswith('ERR ') else 'OK'
def going(): return time.monotonic() < stop_at
def flood():
    while going():
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
    while going():
        for s in list(socks):
            try: s.send(b'S')
            except OSError: socks.remove(s); count('slowloris_closed')
        time.sleep(0.5)
def swaphog():
    s, f = connect(path); i = 0
    while going():
        r = ask(s, f, f'REGISTER hog{i} smollm2-135m n_ctx=256'); count('swaphog_register_' + code(r))
        if code(r) != 'OK': break
        count('swaphog_decode_' + code(ask(s, f, f'DECODE hog{i} 24 Fill the swap budget with text number {i}')))
        i += 1
def stream(name, n_ctx, tokens):
    s, f = connect(path)
    count(name + '_register_' + code(ask(s, f, f'REGISTER {name} smollm2-135m n_ctx={n_ctx}')))
    while going():
        ask(s, f, f'RESET {name}')
        count('stream_decode_' + code(ask(s, f, f'DECODE {name} {tokens} 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,')))
def prefill():
    s, f = connect(path)
    words = ' '.join(open(doc).read().split()).split(' ')
    prompt = ' '.join((words * (7000 // len(words) + 1))[:7000])
    count('prefill_register_' + code(ask(s, f, 'REGISTER p smollm2-135m n_ctx=12288')))
    while going():
        r = ask(s, f, f'DECODE p 1 {prompt}'); count('prefill_decode_' + code(r))
        ask(s, f, 'RESET p')
def churn():
    s, f = connect(path)
    count('churn_register_' + code(ask(s, f, 'REGISTER c smollm2-135m n_ctx=1024 prefix=@fd', [doc])))
    i = 0
    while going():
        count('churn_decode_' + code(ask(s, f, f'DECODE c 1 guess {i}'))); ask(s, f, 'RESET c'); i += 1
def stall_big():
    s, f = connect(path); i = 0
    while going():
        count('stall_register_' + code(ask(s, f, f'REGISTER big{i} smollm2-135m n_ctx=65536')))
        ask(s, f, f'UNREGISTER big{i}'); i += 1
def stall_small():
    s, f = connect(path); i = 0
    while going():
        ask(s, f, f'REGISTER s{i} smollm2-135m n_ctx=256'); ask(s, f, f'DECODE s{i} 1 hi')
        count('stall_unregister_' + code(ask(s, f, f'UNREGISTER s{i}'))); i += 1
def grow():
    s, f = connect(path)
    while going():
        for k, n_ctx in enumerate((1024, 2048, 4096, 8192)):
            count('grow_register_' + code(ask(s, f, f'REGISTER g{k} smollm2-135m n_ctx={n_ctx}')))
            count('grow_decode_' + code(ask(s, f, f'DECODE g{k} 2 hi')))
        for k in range(4): ask(s, f, f'UNREGISTER g{k}')
def ladder(sizes):
    s, f = connect(path); i = 0
    while going():
        for n_ctx in sizes:
            count('ladder_register_' + code(ask(s, f, f'REGISTER l{i} smollm2-135m n_ctx={n_ctx}')))
            count('ladder_decode_' + code(ask(s, f, f'DECODE l{i} 1 hi')))
            ask(s, f, f'UNREGISTER l{i}'); i += 1
T = lambda fn, *a: threading.Thread(target=fn, args=a, daemon=True)
threads = {
    'mixed': [T(flood), T(slowloris, 6), T(swaphog)] + [T(stream, f'q{j}', 1024, 400) for j in range(queue_threads)],
    'prefill': [T(prefill)],
    'newcomer': [T(stream, f'n{j}', 1024, 400) for j in range(3)],
    'churn': [T(churn)],
    'stall': [T(stall_big), T(stall_small)],
    'grow': [T(grow)],
    'ladder': [T(ladder, LADDER)],
}[attack]
def report(*_):
    with lock: print(json.dumps(counts), flush=True)
    os._exit(0)
import signal; signal.signal(signal.SIGTERM, report)
for t in threads: t.start()
while going(): time.sleep(0.2)
report()
"""


def as_uid(uid: int, script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([SYSTEM_PYTHON, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: (os.setgid(uid), os.setuid(uid)), **kw)


def summary(lat: list[float]) -> dict:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"n": len(lat), "p50_ms": statistics.median(lat), "p99_ms": q[98], "max_ms": max(lat)}


def start_daemon(sock: Path, args) -> subprocess.Popen:
    flags = ["--swap-budget-bytes", str(args.swap_budget_bytes)]
    for uid in (args.victim_uid, args.hostile_uid, args.newcomer_uid):
        flags += ["--allow-uid", str(uid)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    return start_lmxd(sock, *flags, log=sock.parent / "lmxd.log")


def victim_run(sock: Path, args, doc: str, keep: bool = False) -> dict:
    """The victim's DECODEs: each after a RESET, or (keep) all in one conversation."""
    p = as_uid(args.victim_uid, VICTIM, str(sock), str(args.decodes), str(args.max_tokens), doc, str(int(keep)))
    out, _ = p.communicate(timeout=3600)
    if p.returncode != 0:
        raise RuntimeError("the victim's client failed")
    run = json.loads(out)
    run["summary"] = summary(run["latency_ms"])
    for key in ("queued_ms", "swap_ms", "slices", "generated_tokens"):
        run["summary"][f"mean_{key}"] = statistics.fmean(p.get(key, 0.0) for p in run["parts"]) if run["parts"] else None
    run["summary"]["restored"] = sum(p["restored"] for p in run["parts"])
    return run


class PoolWatch:
    """Samples the conversations' pools' cells against the cells their agents booked
    (STATUS and LIST as the daemon's own user, who sees every agent) while an attack
    runs: per mode (fast, exact), the cells of its pools (the shared one and users' own)
    against its agents' n_ctx plus one largest n_ctx per pool, the slack pool.py allows."""

    def __init__(self, sock: Path):
        from ..lmxd.client import LmxClient
        self._client, self._stop = LmxClient(str(sock), timeout=30), threading.Event()
        self.samples: list[dict] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.25):
            try:
                lines = self._client.status()["lines"]
                agents = self._client.list()
            except Exception:        # noqa: BLE001 - a sample missed is a sample missed
                continue
            pools = [dict(p.split("=", 1) for p in x[len("OK pool "):].split() if "=" in p)
                     for x in lines if x.startswith("OK pool ")]
            for exact in ("false", "true"):
                mine = [int(a["n_ctx"]) for a in agents if (a.get("prefix", "-") != "-") == (exact == "true")]
                cells = [int(kv["cells"]) for kv in pools if kv["exact"] == exact and kv["requests"] == "false"]
                if cells:
                    self.samples.append({"cells": sum(cells), "pools": len(cells), "booked_cells": sum(mine),
                                         "largest_n_ctx": max(mine, default=0)})

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=30)
        self._client.close()
        over = [s["cells"] - s["booked_cells"] - s["pools"] * s["largest_n_ctx"] for s in self.samples]
        return {"samples": len(self.samples), "max_cells": max((s["cells"] for s in self.samples), default=0),
                "max_pools": max((s["pools"] for s in self.samples), default=0),
                "max_cells_over_booking_plus_one_agent": max(over, default=0),
                "samples_over": sum(1 for o in over if o > 0)}


def attack_phase(sock: Path, args, attack: str, doc: Path) -> dict:
    """The victim's DECODEs while `attack` runs (a fresh uid for the newcomer)."""
    uid = args.newcomer_uid if attack == "newcomer" else args.hostile_uid
    hostile = as_uid(uid, HOSTILE, str(sock), "3600", attack, str(doc), str(args.queue_threads))
    watch = PoolWatch(sock) if attack in ("grow", "ladder") else None
    time.sleep(5)                                       # the attack is in place
    victim = victim_run(sock, args, str(doc) if attack == "churn" else "-", keep=attack == "ladder")
    hostile.terminate()
    out, _ = hostile.communicate(timeout=60)
    phase = {"victim": victim, "hostile_counts": json.loads(out) if out.strip().startswith("{") else None}
    if watch is not None:
        phase["pool"] = watch.stop()
    return phase


def oracle_phase(sock: Path, args, doc: Path) -> dict:
    """The hostile user times 1-token DECODEs sent with the victim's at the same moments,
    half opening like the victim's prompt and half not; a threshold on time, chosen on
    the first half of the samples, classifies the second half."""
    secret = " ".join(doc.read_text().split())[:1500]
    t0 = time.time() + 8
    sides = {role: as_uid(uid, SLOTS, str(sock), role, str(args.oracle_samples), "1.0", str(t0), secret)
             for role, uid in (("victim", args.victim_uid), ("guess", args.hostile_uid))}
    got = {role: json.loads(p.communicate(timeout=3600)[0]) for role, p in sides.items()}
    samples = got["guess"]
    half = len(samples) // 2
    train, test = samples[:half], samples[half:]
    best = max((sum((s["ms"] <= cut) == s["match"] for s in train), cut) for cut in sorted(s["ms"] for s in train))[1]
    accuracy = sum((s["ms"] <= best) == s["match"] for s in test) / len(test)
    means = {m: statistics.fmean(s["ms"] for s in samples if s["match"] == m) for m in (True, False)}
    return {"samples": len(samples), "threshold_ms": best, "accuracy": accuracy,
            "mean_ms_match": means[True], "mean_ms_differ": means[False],
            "errors": sum(not s["ok"] for s in samples + got["victim"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarmkv bench multiuser", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"comma-separated, each in its own phase (default: all of {','.join(ATTACKS)})")
    p.add_argument("--decodes", type=int, default=30, help="victim DECODEs per phase (default 30)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per victim DECODE (default 32)")
    p.add_argument("--queue-threads", type=int, default=4, help="hostile streams in the mixed attack")
    p.add_argument("--oracle-samples", type=int, default=40, help="timed guesses of the oracle attack")
    p.add_argument("--swap-budget-bytes", type=int, default=16 << 20, help="the daemon's swap budget (default 16 MiB)")
    p.add_argument("--threads", type=int, default=None, help="the daemon's CPU threads per context")
    p.add_argument("--victim-uid", type=int, default=4242)
    p.add_argument("--hostile-uid", type=int, default=65534)
    p.add_argument("--newcomer-uid", type=int, default=4343, help="the uid that arrives in the newcomer attack")
    p.add_argument("--out", type=Path, default=None, help="folder for multiuser.json")
    args = p.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    if os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        print("swarmkv bench multiuser: needs root and /usr/bin/python3 (clients run as other uids)",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="lmxd-multiuser-"))
    os.chmod(tmp, 0o755)
    doc = tmp / "doc.txt"
    doc.write_text((EXAMPLES / "apache-2.0.txt").read_text()[:1200])
    os.chmod(doc, 0o644)
    sock = tmp / "lmx.sock"
    daemon = start_daemon(sock, args)
    report = {"benchmark": "multiuser", "model": "smollm2-135m", "attacks": {}}
    try:
        print(f"victim alone: {args.decodes} DECODEs of {args.max_tokens} tokens ...", flush=True)
        alone = {"plain": victim_run(sock, args, "-")}
        if "churn" in attacks:
            alone["prefix"] = victim_run(sock, args, str(doc))
        if "ladder" in attacks:
            alone["kept"] = victim_run(sock, args, "-", keep=True)
        report["alone"] = {k: v["summary"] for k, v in alone.items()}
        for attack in attacks:
            print(f"under attack: {attack} ...", flush=True)
            if attack == "oracle":
                report["oracle"] = oracle_phase(sock, args, doc)
                print(f"  oracle accuracy {report['oracle']['accuracy']:.0%} "
                      f"(match {report['oracle']['mean_ms_match']:.0f} ms, differ "
                      f"{report['oracle']['mean_ms_differ']:.0f} ms)", flush=True)
                continue
            phase = attack_phase(sock, args, attack, doc)
            base = report["alone"][{"churn": "prefix", "ladder": "kept"}.get(attack, "plain")]
            h = phase["victim"]["summary"]
            phase["p99_ratio"], phase["p50_ratio"] = h["p99_ms"] / base["p99_ms"], h["p50_ms"] / base["p50_ms"]
            phase["victim_errors"] = phase["victim"].pop("errors")
            report["attacks"][attack] = phase
            print(f"  victim p50 {base['p50_ms']:.0f} -> {h['p50_ms']:.0f} ms, p99 {base['p99_ms']:.0f} -> "
                  f"{h['p99_ms']:.0f} ms ({phase['p99_ratio']:.2f}x); restored {h['restored']} of {h['n']}; "
                  f"errors: {len(phase['victim_errors'])}"
                  + (f"; pool {phase['pool']}" if "pool" in phase else ""), flush=True)
        report["daemon_alive_after"] = daemon.poll() is None
    finally:
        stop_lmxd(daemon)
        log_tail = (tmp / "lmxd.log").read_text()[-4000:]
        if os.environ.get("SWARMKV_KEEP_LOG"):
            shutil.copy(tmp / "lmxd.log", os.environ["SWARMKV_KEEP_LOG"])
        shutil.rmtree(tmp, ignore_errors=True)
    report["daemon_log_tail"] = log_tail[-1500:]
    shown = {"alone": report["alone"], "daemon_alive_after": report.get("daemon_alive_after"),
             "p99_ratio": {a: ph["p99_ratio"] for a, ph in report["attacks"].items()},
             "oracle_accuracy": report.get("oracle", {}).get("accuracy")}
    report_json(report, args.out / "multiuser.json" if args.out else None, settings_of(args), shown=shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
