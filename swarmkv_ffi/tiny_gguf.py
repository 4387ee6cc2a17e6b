"""Write a tiny, random-weight llama-architecture GGUF with the `gguf` package.

build_llama.sh decodes with it to prove a fresh libllama runs on this CPU before
installing it, and tests use it where a real model would be slow or beside the point.
Its matrices are quantised to the types real models ship (Q4_1 like SmolLM2, Q4_0,
Q8_0) with row counts that are multiples of 32, so the CPU backend takes the same
repacked and extra-buffer matmul paths it takes for a real model.

`--like smollm2-135m` writes instead a random-weight twin of the default model: its
shapes and weight types (30 layers, 9 query / 3 KV heads of 64, Q4_1 matrices, a Q8_0
embedding tied to the output), which decodes as fast as the real one. The build's
end-to-end kernel check (tools/fa_check.c) decodes with it before the packaged model
is installed.

Imports only gguf and numpy, so it also runs as a script outside the package:

    python3 swarmkv_ffi/tiny_gguf.py OUT.gguf [--like smollm2-135m]
"""
from __future__ import annotations

import sys

import numpy as np

N_EMBD, N_HEAD, N_FF, N_LAYER, N_CTX = 256, 4, 512, 2, 512
#: the shapes of the default model (SmolLM2-135M-Instruct), for its twin
SMOLLM2_135M = dict(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_layer=30, n_vocab=49152, n_ctx=8192,
                    rope_base=100000.0)
TWINS = {"smollm2-135m": SMOLLM2_135M}
SPECIAL = ["<unk>", "<s>", "</s>"]
N_WORDS = 61  # pads the vocabulary to 320 tokens


def vocabulary(n_words: int = N_WORDS) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style tokens: specials, all 256 bytes, n_words words."""
    import gguf
    tt = gguf.TokenType
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581w{i}" for i in range(n_words)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256 + [tt.NORMAL] * n_words
    scores = [0.0] * 259 + [-float(i) for i in range(n_words)]
    return tokens, scores, [int(t) for t in types]


def add_vocabulary(w, n_words: int = N_WORDS) -> int:
    """Write vocabulary(n_words) and its special-token ids into GGUFWriter w; returns
    the vocabulary's size."""
    tokens, scores, types = vocabulary(n_words)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return len(tokens)


def write(path: str, seed: int = 0, claimed_layers: int | None = None) -> str:
    """Write the model to `path` and return the path. claimed_layers: a block_count for
    the header that the tensors do not have (a hostile file: libllama asserts on 1000)."""
    import gguf
    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("swarmkv tiny test model")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(claimed_layers or N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    n_vocab = add_vocabulary(w)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(N_EMBD, dtype=np.float32))

    matrix("token_embd.weight", n_vocab, N_EMBD, q.Q8_0)
    for i in range(N_LAYER):
        norm(f"blk.{i}.attn_norm.weight")
        for part in ("q", "k", "v"):
            matrix(f"blk.{i}.attn_{part}.weight", N_EMBD, N_EMBD, q.Q4_1)
        matrix(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD, q.Q4_0)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD, q.Q4_1)
        matrix(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD, q.Q4_1)
        matrix(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF, q.Q8_0)
    norm("output_norm.weight")
    matrix("output.weight", n_vocab, N_EMBD, q.Q4_1)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_twin(path: str, like: str = "smollm2-135m", seed: int = 0) -> str:
    """Write a random-weight model with the shapes and weight types of a real one (TWINS):
    as fast to decode as the real model, without it. Returns the path."""
    import gguf
    q = gguf.GGMLQuantizationType
    shape = TWINS[like]
    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head, n_head_kv = shape["n_embd"], shape["n_ff"], shape["n_head"], shape["n_head_kv"]
    n_embd_kv = n_embd // n_head * n_head_kv

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(f"swarmkv random twin of {like}")
    w.add_context_length(shape["n_ctx"])
    w.add_embedding_length(n_embd)
    w.add_block_count(shape["n_layer"])
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(shape["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    n_vocab = add_vocabulary(w, shape["n_vocab"] - len(SPECIAL) - 256)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", n_vocab, n_embd, q.Q8_0)      # tied: also the output matrix
    for i in range(shape["n_layer"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", n_embd, n_embd, q.Q4_1)
        matrix(f"blk.{i}.attn_k.weight", n_embd_kv, n_embd, q.Q4_1)
        matrix(f"blk.{i}.attn_v.weight", n_embd_kv, n_embd, q.Q4_1)
        matrix(f"blk.{i}.attn_output.weight", n_embd, n_embd, q.Q4_1)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd, q.Q4_1)
        matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd, q.Q4_1)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff, q.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="tiny_gguf.py", description="write a random-weight test model")
    ap.add_argument("out")
    ap.add_argument("--like", choices=sorted(TWINS), help="a twin of this model instead of the tiny one")
    args = ap.parse_args()
    print(write_twin(args.out, args.like) if args.like else write(args.out))
