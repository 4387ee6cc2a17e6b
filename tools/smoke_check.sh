#!/usr/bin/env bash
# Prove that the libllama installed under PREFIX runs on this CPU: compile
# tools/smoke_decode.c against it, write a tiny Q4_1/Q4_0/Q8_0/Q6_K GGUF with the `gguf`
# package, and decode with it in a child process. build_llama.sh runs this before it
# writes the manifest; exit 0 means the decode worked, anything else means do not install.
#
#   tools/smoke_check.sh PREFIX
#
# Environment: SWARMKV_SMOKE_PYTHON (a python with gguf + numpy; default: a small venv in
# the cache, made once), SWARMKV_CACHE, CC.
set -uo pipefail

die() { echo "smoke check: error: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: $0 PREFIX"
prefix=$1
here=$(cd "$(dirname "$0")" && pwd)
cache="${SWARMKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swarmkv-ffi}"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

[ -f "$prefix/include/llama.h" ] || die "no $prefix/include/llama.h"

# A python that can write GGUF files: the caller's, or a venv of our own kept in the cache.
py="${SWARMKV_SMOKE_PYTHON:-}"
if [ -z "$py" ]; then
    venv="$cache/tools-venv"
    if ! "$venv/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
        echo "smoke check: making $venv (gguf, numpy) to write a tiny test model" >&2
        rm -rf "$venv"
        python3 -m venv "$venv" >/dev/null 2>&1 \
            || die "python3 -m venv failed; install python3-venv (apt-get install python3-venv)"
        "$venv/bin/pip" install -q 'gguf>=0.10' numpy >/dev/null 2>&1 \
            || die "pip install gguf numpy into $venv failed; is PyPI reachable?"
    fi
    py="$venv/bin/python"
fi
"$py" "$here/../swarmkv_ffi/tiny_gguf.py" "$work/tiny.gguf" >/dev/null \
    || die "could not write the tiny test model with $py"

"${CC:-cc}" -O1 -o "$work/smoke_decode" "$here/smoke_decode.c" -I"$prefix/include" \
    -L"$prefix/lib" -lllama -lm -Wl,-rpath,"$prefix/lib" 2>"$work/cc.log" \
    || { cat "$work/cc.log" >&2; die "could not compile tools/smoke_decode.c against $prefix"; }

"$work/smoke_decode" "$work/tiny.gguf" 2>"$work/child.log" >&2
rc=$?
if [ $rc -eq 0 ]; then
    exit 0
fi
tail -5 "$work/child.log" >&2
if [ $rc -gt 128 ]; then
    sig=$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))
    hint="the library crashed on this CPU"
    [ "$sig" = ILL ] && hint="the library uses an instruction this CPU cannot run"
    die "the smoke decode died by SIG$sig ($hint). Try ./build_llama.sh --portable, or report it with the output of 'grep -m1 flags /proc/cpuinfo'"
fi
die "the smoke decode failed (exit $rc); see the lines above"
