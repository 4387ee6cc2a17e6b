"""Which CPU features a libllama build needs, and whether this CPU has them.

A native build (`-march=native`) runs only on CPUs with every instruction set the compiler
enabled for the build machine; on any other it dies with SIGILL at the first matmul.
build_llama.sh records those instruction sets in the manifest (`cpu_features`, in the
names /proc/cpuinfo uses), and `library.lib()` refuses a build whose features this CPU
lacks, with an error that says what to do, before libllama runs a single instruction.

This file imports nothing from the package: build_llama.sh runs it as a script to turn
the compiler's predefined macros into that list:

    cc -march=native -dM -E - </dev/null | python3 swarmkv_ffi/cpu.py --from-macros
"""
from __future__ import annotations

import hashlib
import platform
import re
import sys
from pathlib import Path

# Compiler macro -> the flag /proc/cpuinfo shows when the CPU (and kernel) support it.
X86_MACROS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2",
    "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVXVNNI__": "avx_vnni", "__GFNI__": "gfni", "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq",
    "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8", "__AMX_BF16__": "amx_bf16",
}
ARM_MACROS = {
    "__ARM_NEON": "asimd", "__ARM_FEATURE_DOTPROD": "asimddp",
    "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp", "__ARM_FEATURE_MATMUL_INT8": "i8mm",
    "__ARM_FEATURE_SVE": "sve", "__ARM_FEATURE_SVE2": "sve2", "__ARM_FEATURE_SME": "sme",
    "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16",
}


def features_from_macros(text: str) -> list[str]:
    """The cpuinfo names of the instruction sets a `cc -dM -E` macro dump enables."""
    defined = set(re.findall(r"^#define (\w+)", text, flags=re.M))
    table = {**X86_MACROS, **ARM_MACROS}
    return sorted({flag for macro, flag in table.items() if macro in defined})


def _cpuinfo_field(pattern: str) -> str | None:
    """The first /proc/cpuinfo line whose key matches `pattern`: its value, or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^(?:{pattern})\s*:\s*(.*)$", text, flags=re.M)
    return match.group(1).strip() if match else None


def host_features() -> set[str] | None:
    """This CPU's feature flags as the kernel reports them; None where we cannot tell."""
    flags = _cpuinfo_field("flags|Features")
    return set(flags.split()) if flags is not None else None


def missing_features(required: list[str], host: set[str] | None = None) -> list[str]:
    """The required features this CPU lacks ([] if it has them all or we cannot tell)."""
    host = host_features() if host is None else host
    if host is None:
        return []
    return [f for f in required if f not in host]


def identity() -> dict:
    """What makes two CPUs the same for a race between kernels: model name, vendor,
    family, model and stepping (or an ARM implementer and part), and the flags. A VM's
    model name alone ("AMD EPYC") names both a Zen 3 and a Zen 5, so it is not enough."""
    ids = [_cpuinfo_field(k) or "" for k in ("vendor_id", "cpu family", "model", "stepping",
                                             "CPU implementer", "CPU part")]
    flags = " ".join(sorted(host_features() or ()))
    return {"model_name": _cpuinfo_field("model name") or platform.machine(), "id": "/".join(ids),
            "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def same_identity(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("model_name", "id", "flags_sha256"))


def describe_host() -> str:
    """One line naming this CPU, for error messages and `swarmkv info`."""
    name = _cpuinfo_field("model name")
    if name:
        return f"{name} ({platform.machine()})"
    return platform.machine() or "unknown CPU"


def main(argv: list[str]) -> int:
    if argv[1:] == ["--from-macros"]:
        print(" ".join(features_from_macros(sys.stdin.read())))
        return 0
    if argv[1:2] == ["--missing"]:
        missing = missing_features(argv[2:])
        print(" ".join(missing))
        return 1 if missing else 0
    print("usage: cpu.py --from-macros < macros | cpu.py --missing FEATURE...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
