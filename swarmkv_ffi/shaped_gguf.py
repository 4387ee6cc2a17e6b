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
    import gguf

    from .tiny_gguf import add_vocabulary, vocabulary
    rng = np.random.default_rng(seed)
    head = shape.n_embd // shape.n_head

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("swarmkv random-weight model with a real model's shapes (answers are meaningless)")
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    add_vocabulary(w, shape.n_vocab - len(vocabulary(0)[0]))

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    kv = shape.n_head_kv * head
    matrix("token_embd.weight", shape.n_vocab, shape.n_embd)
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", shape.n_embd, shape.n_embd)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.n_embd)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.n_embd)
        matrix(f"blk.{i}.attn_output.weight", shape.n_embd, shape.n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, shape.n_embd)
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, shape.n_embd)
        matrix(f"blk.{i}.ffn_down.weight", shape.n_embd, shape.n_ff)
    norm("output_norm.weight")
    matrix("output.weight", shape.n_vocab, shape.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: Path, out: Path, qtype: str, quantizer: Path, threads: int) -> Path:
    if not quantizer.exists():
        raise SystemExit(f"{quantizer} not found: build llama.cpp's tools with ./build_llama.sh --tools")
    proc = subprocess.run([str(quantizer), str(src), str(out), qtype, str(threads)],
                          capture_output=True, text=True)
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
