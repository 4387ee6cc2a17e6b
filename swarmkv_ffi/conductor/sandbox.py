"""Load an untrusted GGUF in a child process first; the daemon loads only what survived.

A client-supplied GGUF goes through libllama's loader, which asserts (aborting the
process) on some malformed headers and has a history of memory-safety bugs. So lmxd
first hands the file's descriptor to `python -m swarmkv_ffi.conductor.sandbox`: a child
that loads the model (mmap, no GPU) and reads from it the header facts the estimate needs, under
resource limits (address space, CPU seconds, no files written, no core; niced, one
child per user at a time since a user's admissions run one by one), with the
client's uid and groups when the daemon is root, made non-dumpable so nobody can
ptrace it. Its verdict is one JSON line. A crash, an assert, a timeout or a refusal is
ERR MODEL_LOAD_FAILED with the cause; the daemon and every agent go on.

This filters deterministic failures (asserts, runaway allocations, slow parses); a file
crafted to corrupt memory *silently* would pass here and then run in the daemon, which
is one more reason to run lmxd as a dedicated user rather than root (docs/lmxd-security.md).
Verdicts are cached per file identity (device, inode, size, mtime).
"""
from __future__ import annotations

import ctypes
import json
import os
import pwd
import resource
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import ModelLoadError
from .estimate import facts_of
from .modelfile import ModelFile

CPU_SECONDS = 30
WALL_SECONDS = 60
HEADROOM = 1 << 30            # address space beyond the child's own and twice the file's
PR_SET_DUMPABLE = 4
FACTS = ("n_embd", "n_head", "n_layer", "n_head_kv", "key_length", "value_length", "n_vocab", "weights")

_verdicts: dict[tuple, dict] = {}
_lock = threading.Lock()


def check(mf: ModelFile, fd: int, uid: int) -> dict:
    """The header facts of the model behind `fd`, once a child has loaded it; raises
    ModelLoadError (with the signal or the child's last words) otherwise."""
    with _lock:
        cached = _verdicts.get(mf.identity)
    if cached is not None:
        return cached
    argv = [sys.executable, "-B", "-m", "swarmkv_ffi.conductor.sandbox", str(fd), str(uid), str(mf.identity[2])]
    try:
        done = subprocess.run(argv, pass_fds=(fd,), env=child_env(), capture_output=True, timeout=WALL_SECONDS,
                              start_new_session=True, stdin=subprocess.DEVNULL, cwd="/")
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"{mf.path}: loading it took longer than {WALL_SECONDS} s in the sandbox") from None
    if done.returncode != 0:
        raise ModelLoadError(f"{mf.path}: the sandboxed load failed ({describe(done.returncode)}): "
                             f"{last_words(done.stderr)}")
    try:
        facts = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ModelLoadError(f"{mf.path}: the sandboxed load gave no verdict") from None
    if not isinstance(facts, dict) or not all(isinstance(facts.get(k), int) and facts[k] >= 0 for k in FACTS):
        raise ModelLoadError(f"{mf.path}: the sandboxed load gave a malformed verdict")
    with _lock:
        _verdicts[mf.identity] = facts
    return facts


def child_env() -> dict:
    """The daemon's own environment, with this package importable from any directory."""
    here = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def describe(returncode: int) -> str:
    if returncode < 0:
        import signal
        try:
            return f"signal={signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal={-returncode}"
    return f"exit={returncode}"


def last_words(stderr: bytes) -> str:
    lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "assert" in line.lower()]
    return " | ".join((errors or lines)[-3:])[-600:] or "no message"


# ---- the child ---------------------------------------------------------------------------------
def _drop_privileges(uid: int) -> None:
    """Become the client (its uid, primary group and groups; a uid without a passwd entry
    gets the group of the same number) when started as root; then non-dumpable."""
    if os.getuid() == 0 and uid != 0:
        try:
            entry = pwd.getpwuid(uid)
            gid, groups = entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)
        except KeyError:
            gid, groups = uid, [uid]
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _limit(file_bytes: int) -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    address_space = vm + 2 * file_bytes + HEADROOM
    for which, value in ((resource.RLIMIT_AS, address_space), (resource.RLIMIT_CPU, CPU_SECONDS),
                         (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def main(argv: list[str]) -> int:
    fd, uid, file_bytes = (int(x) for x in argv)
    from .. import library
    from ..model import Model
    library.backend()                  # libllama and its backends load before the drop
    _drop_privileges(uid)
    _limit(file_bytes)
    os.nice(10)                        # below the daemon's own decoding
    model = Model(f"/proc/self/fd/{fd}", n_gpu_layers=0, use_mmap=True)
    facts = facts_of(model)
    model.close()
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
