"""The fast mode's choice of attention kernel, calibrated on the machine that runs it.

kernels/ggml/0003 picks, for each flash-attention op of the default (fast) mode, either
ggml's stock kernels or our shared-prefix kernel by a rule table: the fewest KV cells
from which ours wins, per head size, KV type, mask (do most rows see cell 0, or a
sliding window past it) and number of query tokens. The table built
into the patch was measured on one CPU; which kernel wins moves with the instruction set
(an AVX-512 EPYC lost 5-11 % at one branch with it). So:

  calibrate   tools/fa_calibrate.c (built into PREFIX/bin by build_llama.sh) times both
              kernels at the deciding shapes (well under a minute on 2 cores) and prints
              the table; `record()` writes it, with the measurements and the CPU it was
              measured on, into the build's manifest.json ("fa_shared_rule").
  check       the op alone is not what a user runs: on AVX-512 CPUs it said ours wins at
              one query token where a whole model decoded faster with ggml's. So
              tools/fa_check.c then decodes a real model (the packaged one, or at build
              time its random-weight twin, tiny_gguf.py --like) at 1, 4 and 16 branches
              with the table vs each kernel forced; `correct()` takes the faster kernel
              end to end wherever the table's choice is more than 3 % behind it, and the
              manifest keeps both tables and the figures.
  load        `apply()` (on the first load of the library) hands that table to ggml, if
              it was measured on this CPU; otherwise the built-in rule stays. An explicit
              GGML_FA_SHARED_RULE in the environment wins over both.

Exact mode is untouched: it always runs the batch-invariant kernel. The choice changes
speed only, within what the fast mode already allows (its kernels round differently).

This file also runs as a script with nothing but the standard library, which is how
build_llama.sh records a calibration before the package is installed:

    python3 swarmkv_ffi/calibration.py PREFIX [--threads N] [--repeat R] [--check-model GGUF] [--reuse FILE]

With --reuse (build_llama.sh names a file per build in its cache), a table measured before
for the same build on the same CPU with as many cores is recorded again instead of
measured: installing one build twice (a fresh checkout, CI) costs no 3-minute calibration.
`swarmkv calibrate` always measures.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

if __package__:
    from . import cpu
else:                 # run as a script by build_llama.sh: cpu.py, beside this file, is stdlib too
    import cpu

RULE_LEN = 96
HEADS = ("<=64", "<=128", "<=256", ">256")
KV_TYPES = ("float", "quantized")
MASKS = ("prefix", "window")      # most query rows see cell 0 / do not
TOKENS = ("1", "2-3", "4-15", "16-63", "64-511", ">=512")
ENV_RULE = "GGML_FA_SHARED_RULE"
KEY = "fa_shared_rule"            # the manifest's key
SOURCES = {0: "built-in", 1: "environment", 2: "calibrated"}


class CalibrationError(RuntimeError):
    """The calibration could not run or its result could not be recorded."""


# ---- running and recording a calibration ------------------------------------------------

def calibrator(prefix: Path) -> Path:
    return Path(prefix) / "bin" / "fa_calibrate"


def kernel_env(rule: list[int] | None = None) -> dict:
    """This process's environment for a child that times the kernels: without the
    caller's overrides (GGML_FA_SHARED, GGML_FA_SHARED_RULE), with `rule` as the table if
    given."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_RULE, "GGML_FA_SHARED")}
    if rule is not None:
        env[ENV_RULE] = ",".join(map(str, check_rule(rule)))
    return env


def measure(prefix: Path, threads: int | None = None, repeat: int = 3, max_cells: int | None = None) -> dict:
    """Run PREFIX/bin/fa_calibrate; its JSON (rule, measured, seconds, threads). Progress
    goes to our stderr as it runs."""
    exe = calibrator(prefix)
    if not exe.exists():
        raise CalibrationError(f"{exe} not found: this build predates calibration; rebuild with ./build_llama.sh")
    cmd = [str(exe), "--repeat", str(repeat)] + (["--threads", str(threads)] if threads else []) \
        + (["--max-cells", str(max_cells)] if max_cells else [])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=kernel_env())
    if proc.returncode != 0:
        raise CalibrationError(f"{exe.name} failed (exit {proc.returncode})")
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{exe.name} printed no valid JSON: {exc}") from None
    check_rule(result.get("rule"))
    return result


def check_rule(rule) -> list[int]:
    if not (isinstance(rule, list) and len(rule) == RULE_LEN
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in rule)):
        raise CalibrationError(f"a rule is {RULE_LEN} integers >= -1, got {rule!r:.80}")
    return rule


# ---- checking the table end to end --------------------------------------------------------

CHECK_TOLERANCE = 0.03            # the table's choice may be this far behind the faster kernel
CHECK_NPL = (1, 4, 16)
CHECK_CELLS = 2048


def checker(prefix: Path) -> Path:
    return Path(prefix) / "bin" / "fa_check"


def check(prefix: Path, model: Path, rule: list[int], threads: int | None = None, cells: int = CHECK_CELLS,
          npl=CHECK_NPL, steps: int = 16, repeat: int = 3) -> dict:
    """Decode `model` with PREFIX/bin/fa_check at npl branches over `cells` shared cells:
    the fast mode with table `rule` vs ggml's and our kernel forced. Its JSON (rows of
    rule_tps, ggml_tps, ours_tps per npl; the model's head size). Progress on stderr."""
    exe = checker(prefix)
    if not exe.exists():
        raise CalibrationError(f"{exe} not found: this build predates the end-to-end check; rebuild with ./build_llama.sh")
    if not Path(model).is_file():
        raise CalibrationError(f"no model at {model} to check the kernel choice with")
    cmd = [str(exe), str(model), "--cells", str(cells), "--npl", ",".join(map(str, npl)),
           "--steps", str(steps), "--repeat", str(repeat)] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=kernel_env(rule))
    if proc.returncode != 0:
        raise CalibrationError(f"{exe.name} failed (exit {proc.returncode})")
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{exe.name} printed no valid JSON: {exc}") from None


def head_class(head_dim: int) -> int:
    return 0 if head_dim <= 64 else 1 if head_dim <= 128 else 2 if head_dim <= 256 else 3


def token_bucket(tokens: int) -> int:
    """The patch's buckets of query tokens: 1, 2-3, 4-15, 16-63, 64-511, >= 512."""
    return next(i for i, top in enumerate((2, 4, 16, 64, 512)) if tokens < top) if tokens < 512 else 5


def correct(rule: list[int], checked: dict) -> tuple[list[int], list[dict]]:
    """The table after an end-to-end check: where its choice for a row (npl query tokens,
    the model's head size, float KV, every row seeing cell 0) decoded more than
    CHECK_TOLERANCE slower than the faster kernel, and the kernel it took, forced, was
    too, that bucket takes the faster one (ours from the checked cells up; ggml's: never
    ours). A gap while the table's kernel, forced, keeps up is noise and changes nothing.
    Returns the table and one verdict per row (also written into `checked`'s rows)."""
    fixed = list(check_rule(rule))
    cells, head = checked["cells"], head_class(checked["head_dim"])
    for row in checked["rows"]:
        i = index(head, 0, 0, token_bucket(row["npl"]))
        picks = "ours" if fixed[i] >= 0 and cells >= fixed[i] else "ggml"
        faster = "ours" if row["ours_tps"] > row["ggml_tps"] else "ggml"
        row.update(picks=picks, faster=faster, vs_faster=round(row["rule_tps"] / row[f"{faster}_tps"], 4),
                   table_entry=i, was=fixed[i])
        if row["vs_faster"] >= 1 - CHECK_TOLERANCE:
            row["verdict"] = "ok"
        elif row[f"{picks}_tps"] >= (1 - CHECK_TOLERANCE) * row[f"{faster}_tps"]:
            row["verdict"] = "noise: the table's kernel, forced, keeps up"
        else:
            fixed[i] = cells if faster == "ours" else -1
            row["verdict"] = f"corrected: {faster}'s kernel from now on"
        row["now"] = fixed[i]
    return fixed, checked["rows"]


def check_and_correct(prefix: Path, result: dict, model: Path, **kw) -> dict:
    """Check fa_calibrate's table (`result`) end to end with `model` and fold the
    correction into `result`: its rule becomes the checked one, "op_rule" the table the
    op timings gave, "check" the figures."""
    checked = check(prefix, model, result["rule"], threads=result.get("threads"), **kw)
    rule, _ = correct(result["rule"], checked)
    checked["model"] = str(model)
    return {**result, "op_rule": result["rule"], "rule": rule, "check": checked}


def check_lines(checked: dict) -> list[str]:
    """The check's figures as text, one line per number of branches."""
    lines = [f"checked end to end on {Path(checked['model']).name}, {checked['cells']} cells, "
             f"{checked['threads']} threads, decode t/s (medians of {checked['repeat']}):"]
    for r in checked["rows"]:
        lines.append(f"  {r['npl']:>2} branches: table {r['rule_tps']:7.1f} ({r['picks']})  ggml {r['ggml_tps']:7.1f}"
                     f"  ours {r['ours_tps']:7.1f}  table/faster {r['vs_faster']:.3f}  {r['verdict']}")
    return lines


def record(prefix: Path, result: dict) -> dict:
    """Write a calibration into PREFIX/manifest.json (atomically), with the CPU and the
    time it was measured; returns the entry."""
    entry = {
        "rule": check_rule(result["rule"]),
        "cpu": {**cpu.identity(), "cpus": os.cpu_count() or 1},
        "threads": result.get("threads"),
        "max_cells": result.get("max_cells"),
        "seconds": result.get("seconds"),
        "calibrated_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "measured": result.get("measured", []),
    }
    if "check" in result:
        entry.update(op_rule=check_rule(result["op_rule"]), check=result["check"])
    _record_entry(prefix, entry)
    return entry


def _record_entry(prefix: Path, entry: dict) -> None:
    path = Path(prefix) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"cannot read {path}: {exc}") from None
    manifest[KEY] = entry
    _write(path, manifest)


def reusable(path: Path | None) -> dict | None:
    """The entry kept at `path` if it was measured on this CPU with as many cores, else None."""
    if path is None:
        return None
    try:
        entry = json.loads(Path(path).read_text())
        check_rule(entry["rule"])
    except (OSError, ValueError, KeyError, TypeError, CalibrationError):
        return None
    same = cpu.same_identity(entry.get("cpu", {}), cpu.identity()) and \
        entry["cpu"].get("cpus") == (os.cpu_count() or 1)
    return entry if same else None


def keep_for_reuse(path: Path | None, entry: dict) -> None:
    """Save `entry` for reusable(); a cache that cannot be written only costs a later re-measure."""
    if path is not None:
        try:
            tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            print(f"calibration: warning: cannot keep the table for reuse in {path}: {exc}", file=sys.stderr)


def forget(prefix: Path) -> bool:
    """Remove a recorded calibration (back to the built-in rule); whether there was one."""
    path = Path(prefix) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"cannot read {path}: {exc}") from None
    if manifest.pop(KEY, None) is None:
        return False
    _write(path, manifest)
    return True


def _write(path: Path, manifest: dict) -> None:
    """Replace the manifest whole (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CalibrationError(f"cannot write {path}: {exc.strerror or exc}") from None


# ---- applying it at load ------------------------------------------------------------------

_CDEF = """
bool ggml_cpu_set_fa_shared_rule(const int32_t * min_cells, int n);
int  ggml_cpu_get_fa_shared_rule(int32_t * min_cells, int n);
"""
_state: dict = {}                 # what apply() decided, for `swarmkv info`
_apply_lock = threading.Lock()
_ffi = None
_handle = None
_library: Path | None = None      # the libllama apply() was handed (library.py loads it, then calls apply)


def _rule_functions():
    """The patch's two rule functions (None for a library built before them, or before
    library.py has loaded one)."""
    global _ffi, _handle
    if _handle is None:
        if _library is None:
            return None
        from cffi import FFI
        _ffi = FFI()
        _ffi.cdef(_CDEF)
        _handle = _ffi.dlopen(str(_library))
    return _handle if hasattr(_handle, "ggml_cpu_set_fa_shared_rule") else None


def apply(manifest: dict, library: Path) -> dict:
    """Hand the manifest's calibration to ggml (in `library`, the libllama just loaded)
    when it was measured on this CPU and the environment does not set a rule. Once per
    process; returns the decision."""
    global _library
    with _apply_lock:
        if _state:
            return _state
        _library = library
        entry = manifest.get(KEY)
        fns = _rule_functions()
        if fns is None:
            _state.update(source="built-in", note="this libllama has no rule table (built before calibration)")
            return _state
        if os.environ.get(ENV_RULE):
            _state.update(note=f"{ENV_RULE} is set in the environment")
        elif not entry:
            _state.update(note="no calibration in the build's manifest (swarmkv calibrate makes one)")
        elif not cpu.same_identity(entry.get("cpu", {}), cpu.identity()):
            was = entry.get("cpu", {})
            _state.update(note=f"the manifest's calibration was measured on another CPU "
                               f"({was.get('model_name')} {was.get('id')}); run swarmkv calibrate here")
        else:
            _state.update(note=_set_from(fns, entry), check=entry.get("check"))
        _state.update(in_force())
        if os.environ.get(ENV_RULE) and _state["source"] != "environment":
            _state["note"] = f"{ENV_RULE} is malformed (not {RULE_LEN} integers >= -1) and was ignored"
        return _state


def _set_from(fns, entry: dict) -> str:
    """Hand a recorded table to ggml; what happened, in words. A damaged entry leaves the
    built-in table: a manifest never stops the library from loading."""
    try:
        rule = check_rule(entry.get("rule"))
    except CalibrationError as exc:
        return f"the manifest's calibration is not usable ({exc}); run swarmkv calibrate"
    if not fns.ggml_cpu_set_fa_shared_rule(_ffi.new("int32_t[]", rule), RULE_LEN):
        return "libllama refused the manifest's rule table; run swarmkv calibrate"
    return f"measured {entry.get('calibrated_at')} with {entry.get('threads')} threads in {entry.get('seconds')} s"


def in_force() -> dict:
    """The rule table ggml uses now and where it came from."""
    fns = _rule_functions()
    if fns is None:
        return {"source": "built-in", "rule": None}
    out = _ffi.new("int32_t[]", RULE_LEN)
    source = fns.ggml_cpu_get_fa_shared_rule(out, RULE_LEN)
    return {"source": SOURCES.get(source, str(source)), "rule": list(out)}


def status() -> dict:
    """apply()'s decision plus the table in force (library.kernel_rule() loads the library
    first)."""
    return {**_state, **in_force()}


def index(head: int, kv: int, mask: int, tokens: int) -> int:
    """Where an entry sits in the table (the patch's order): by class numbers."""
    return ((head * len(KV_TYPES) + kv) * len(MASKS) + mask) * len(TOKENS) + tokens


def table(rule: list[int]) -> str:
    """The rule as text: one line per head size, KV type and mask, one column per token
    bucket; each cell the fewest KV cells from which the shared-prefix kernel runs."""
    def cell(x: int) -> str:
        return "never" if x < 0 else "always" if x == 0 else f">={x}"
    lines = [f"{'head':>6} {'kv':>9} {'mask':>6} | " + " ".join(f"{t + ' tok':>10}" for t in TOKENS)]
    for h, head in enumerate(HEADS):
        for t, kv in enumerate(KV_TYPES):
            for m, mask in enumerate(MASKS):
                row = rule[index(h, t, m, 0):][:len(TOKENS)]
                lines.append(f"{head:>6} {kv:>9} {mask:>6} | " + " ".join(f"{cell(x):>10}" for x in row))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """build_llama.sh's entry: measure with PREFIX/bin/fa_calibrate and record it."""
    import argparse
    ap = argparse.ArgumentParser(prog="calibration.py", description="calibrate and record the kernel rule")
    ap.add_argument("prefix", type=Path)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check-model", type=Path, default=None,
                    help="check the table end to end with this model (a twin of the packaged one at build time)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="record the table kept in this file if measured on this CPU, else measure and keep it there")
    args = ap.parse_args(argv)
    if (kept := reusable(args.reuse)) is not None:
        try:
            _record_entry(args.prefix, kept)
        except CalibrationError as exc:
            print(f"calibration: error: {exc}", file=sys.stderr)
            return 1
        print(f"calibration: reused the table measured {kept.get('calibrated_at')} for this build on this CPU "
              f"({args.reuse}); `swarmkv calibrate` measures again", file=sys.stderr)
        print(table(kept["rule"]), file=sys.stderr)
        return 0
    try:
        result = measure(args.prefix, args.threads, args.repeat)
        if args.check_model:
            try:
                result = check_and_correct(args.prefix, result, args.check_model)
            except CalibrationError as exc:   # the op timings' table still beats the built-in one
                print(f"calibration: warning: the end-to-end check failed ({exc}); recording the op timings' "
                      "table unchecked (swarmkv calibrate retries)", file=sys.stderr)
        entry = record(args.prefix, result)
    except CalibrationError as exc:
        print(f"calibration: error: {exc}", file=sys.stderr)
        return 1
    keep_for_reuse(args.reuse, entry)
    print(f"calibration: recorded in {args.prefix / 'manifest.json'} ({entry['seconds']} s, "
          f"{entry['threads']} threads); the shared-prefix kernel is used from these cells:", file=sys.stderr)
    print(table(entry["rule"]), file=sys.stderr)
    for line in check_lines(entry["check"]) if "check" in entry else []:
        print(f"calibration: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
