"""A random-weight GGUF with a real model's shapes, for benchmarks that need its size.

Timings do not depend on weight values, so a model with Llama-3.2-1B's shapes (16
layers, 2048 wide, 32 query / 8 KV heads of 64, 8192 FFN, 128,256-token vocabulary) and
random weights measures what the real one would cost: memory-bound decode included.
Its answers are meaningless. Written as F16 with the `gguf` package, then quantised with
the build's own llama-quantize (tools-stock/, from ./build_llama.sh --tools) to the
type users run (Q4_K_M by default), so the matmuls take the same kernels.

    python -m swarmkv_ffi.shaped_gguf OUT.gguf [--shape llama-3.2-1b] [--type Q4_K_M]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_layer: int
    n_vocab: int
    n_ctx: int = 8192


SHAPES = {"llama-3.2-1b": Shape(n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_layer=16, n_vocab=128256),
          # the same head layout at a size that writes in a second: for dry runs of the scripts
          "tiny": Shape(n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=2, n_vocab=1024, n_ctx=2048)}


def write_f16(path: Path, shape: Shape, seed: int = 0) -> Path:
    """The model in F16 (norms in F32), with a byte-level SentencePiece-style vocabulary
    padded to shape.n_vocab."""
    from dataclasses import asdict

    from .tiny_gguf import write_llama
    write_llama(str(path), "swarmkv random-weight model with a real model's shapes (answers are meaningless)",
                asdict(shape), lambda tensor, data: ((data * 0.4).astype(np.float16), None), seed,
                file_type="MOSTLY_F16")
    return path


def quantize(src: Path, out: Path, qtype: str, quantizer: Path, threads: int, requantize: bool = False) -> Path:
    """`src` to `out` in `qtype` with llama.cpp's llama-quantize. requantize: `src` is
    itself quantized (llama-quantize refuses that unless told; the copy is for speed, not
    quality, measurements)."""
    if not quantizer.exists():
        raise SystemExit(f"{quantizer} not found: build llama.cpp's tools with ./build_llama.sh --tools")
    proc = subprocess.run([str(quantizer), *(["--allow-requantize"] if requantize else []), str(src), str(out),
                           qtype, str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama-quantize failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


def main(argv=None) -> int:
    from . import library
    ap = argparse.ArgumentParser(prog="python -m swarmkv_ffi.shaped_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="where to write the quantised model")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_K_M",
                    help="llama-quantize type (default Q4_K_M); F16 keeps the written file (no llama-quantize needed)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.type.upper() == "F16":
        write_f16(args.out, SHAPES[args.shape])
        print(args.out)
        return 0
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        f16 = write_f16(Path(tmp) / "f16.gguf", SHAPES[args.shape])
        print(f"wrote {f16.stat().st_size / 2**30:.2f} GiB F16; quantising to {args.type}", file=sys.stderr)
        quantize(f16, args.out, args.type, library.tool_path("llama-quantize"), args.threads)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
