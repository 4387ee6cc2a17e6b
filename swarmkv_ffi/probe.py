"""Find where batching changes a token's numbers: the first graph node that differs.

One target token is decoded at the end of a document, alone (batch of 1) and then with
1..15 other sequences' tokens around it in the same llama_decode. libllama's eval
callback (cb_eval) hands us every graph node as it is computed; we keep the target's row
of each float32 node and report, per batch size, the first node (in graph order) whose
row differs from the batch-of-1 run, with its op and the largest difference.

Nodes whose shape depends on the batch in another way than one row per token (the KQ
mask, sized by the number of cells) are skipped and counted. Asking for every node makes
the scheduler compute the graph node by node, so fused ops run unfused here.

    swarmkv probe --doc-tokens 700 --batch 1,2,4,8,16          # the fast default
    swarmkv probe --doc-tokens 700 --batch 1,2,4,8,16 --exact  # expect: no node differs
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from . import library
from .batch import Batch
from .catalog import DEFAULT_MODEL, resolve
from .context import Context, ContextParams
from .library import ffi
from .model import Model

F32 = library.enum("ggml_type")["GGML_TYPE_F32"]   # the only node type read back


@dataclass
class Node:
    name: str
    op: str
    inputs: str             # its first two sources' names: a matmul's weight, attention's K...
    ne: tuple[int, ...]
    data: np.ndarray | None   # the whole node's float32 values (None: not float32)


@dataclass
class Divergence:
    batch: int
    nodes_compared: int
    nodes_skipped: int
    first_node: str | None = None     # None: every compared node is equal bit for bit
    first_op: str | None = None
    first_inputs: str | None = None
    max_abs_diff: float = 0.0


class Recorder:
    """The eval callback: records every node while `on` is set."""

    def __init__(self):
        self.on, self.nodes = False, []

    def __call__(self, t, ask: bool) -> bool:
        if not self.on:
            return False
        if ask:
            return True
        try:
            data = None
            lib = library.lib()
            if t.type == F32:
                raw = np.empty(lib.ggml_nbytes(t), dtype=np.uint8)
                lib.ggml_backend_tensor_get(t, ffi.from_buffer(raw), 0, raw.nbytes)
                shape, strides = tuple(t.ne)[::-1], tuple(t.nb)[::-1]
                data = np.lib.stride_tricks.as_strided(raw.view(np.float32), shape, strides).copy()
            inputs = ", ".join(ffi.string(t.src[k].name).decode() for k in (0, 1) if t.src[k] != ffi.NULL)
            self.nodes.append(Node(ffi.string(t.name).decode(), ffi.string(lib.ggml_op_desc(t)).decode(),
                                   inputs, tuple(t.ne), data))
        except Exception as exc:  # never raise into C; the probe reports it afterwards
            self.nodes.append(Node(f"<error: {exc}>", "", "", (), None))
        return True


def decode_target(model: Model, doc, batch: int, exact: bool, kv_type: str, target: int,
                  n_threads: int) -> list[Node]:
    """Decode the target token (last row) with batch-1 other sequences' tokens around it."""
    rec = Recorder()
    params = ContextParams(n_ctx=len(doc) + 2 * batch + 256, n_batch=512, n_ubatch=512, n_seq_max=batch,
                           kv_unified=True, swa_full=model.n_swa > 0, flash_attn="on",
                           type_k=kv_type, type_v=kv_type, batch_invariant=exact, n_threads=n_threads)
    with Context(model, params, eval_callback=rec) as ctx:
        ctx.decode_tokens(doc, 0, 0, logits_last=False)
        for seq in range(1, batch):
            ctx.seq_cp(0, seq)
        b = Batch(batch)
        for seq in range(batch):  # others get other tokens; the target row is the last
            b.add(target if seq == batch - 1 else target + 1 + seq, len(doc), (seq,), logits=True)
        rec.on = True
        ctx.decode(b)
        rec.on = False
    return rec.nodes


def target_row(node: Node, batch: int, alone: Node) -> np.ndarray | None:
    """The target token's slice of a node, or None when its shape is not per-token."""
    if node.data is None or alone.data is None or len(node.ne) != len(alone.ne):
        return None
    if node.ne == alone.ne:
        return node.data
    dims = [d for d in range(len(node.ne)) if alone.ne[d] == 1 and node.ne[d] == batch
            and all(node.ne[k] == alone.ne[k] for k in range(len(node.ne)) if k != d)]
    if len(dims) != 1:
        return None
    axis = len(node.ne) - 1 - dims[0]   # numpy order is reversed
    return np.take(node.data, [batch - 1], axis=axis)


def compare(alone: list[Node], other: list[Node], batch: int) -> Divergence:
    out = Divergence(batch=batch, nodes_compared=0, nodes_skipped=0)
    for a, b in zip(alone, other):
        if a.name.startswith("<error") or b.name.startswith("<error"):
            raise RuntimeError(f"reading a graph node failed: {a.name if a.name.startswith('<') else b.name}")
        if a.name != b.name:
            raise RuntimeError(f"graphs differ in structure at {a.name!r} vs {b.name!r}")
        row = target_row(b, batch, a)
        if row is None or row.shape != a.data.shape:
            out.nodes_skipped += 1
            continue
        out.nodes_compared += 1
        if not np.array_equal(row.view(np.uint32), a.data.view(np.uint32)):
            out.first_node, out.first_op, out.first_inputs = b.name, b.op, b.inputs
            out.max_abs_diff = float(np.nanmax(np.abs(row - a.data)))
            return out
    return out


def probe(model: Model, doc_tokens: int, batches: list[int], exact: bool, kv_type: str = "f16",
          n_threads: int | None = None) -> list[Divergence]:
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * (doc_tokens // 8 + 1))[:doc_tokens]
    target, n_threads = int(tokens[5]), n_threads or os.cpu_count() or 1
    alone = decode_target(model, tokens, 1, exact, kv_type, target, n_threads)
    return [compare(alone, decode_target(model, tokens, b, exact, kv_type, target, n_threads), b)
            for b in batches if b > 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--doc-tokens", type=int, default=700,
                    help="cells before the target (default 700: >= 512 reaches the split-KV path)")
    ap.add_argument("--batch", default="2,4,8,16", help="batch sizes to compare with 1 (default 2,4,8,16)")
    ap.add_argument("--kv-type", default="f16", help="KV cache type (default f16)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--exact", action="store_true", help="batch-invariant kernels (exact mode)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    try:
        batches = sorted({int(b) for b in args.batch.split(",")})
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if args.doc_tokens < 1 or not batches or batches[0] < 1:
        ap.error("--doc-tokens and every --batch size must be >= 1")
    with Model(resolve(args.model)) as model:
        found = probe(model, args.doc_tokens, batches, args.exact, args.kv_type, args.threads)
    if args.json:
        print(json.dumps([asdict(d) for d in found], indent=2))
        return 0
    mode = "exact" if args.exact else "fast"
    for d in found:
        where = (f"first differing node {d.first_node} = {d.first_op}({d.first_inputs}), "
                 f"max |diff| {d.max_abs_diff:.3g}"
                 if d.first_node else "every node equal bit for bit")
        print(f"{mode} batch {d.batch:2d}: {where}  [{d.nodes_compared} nodes compared, {d.nodes_skipped} skipped]")
    return 0
