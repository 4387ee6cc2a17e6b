"""Write a tiny, random-weight llama-architecture GGUF with the `gguf` package.

build_llama.sh decodes with it to prove a fresh libllama runs on this CPU before
installing it, and tests use it where a real model would be slow or beside the point.
Its matrices are quantised to the types real models ship (Q4_1 like SmolLM2, Q4_0,
Q8_0, Q6_K) with row counts that are multiples of 32, so the CPU backend takes the same
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


def write_llama(path: str, name: str, shape: dict, weight, seed: int = 0, tied: bool = False,
                claimed_layers: int | None = None, file_type: str = "MOSTLY_Q4_1") -> str:
    """Write a random-weight llama-architecture model of `shape` (n_embd, n_head,
    n_head_kv, n_ff, n_layer, n_vocab, n_ctx, optional rope_base) to `path`; returns the
    path. weight(tensor name, float32 data) -> (data to store, its ggml type or None)
    decides each matrix's type; file_type names the header's (gguf.LlamaFileType). tied: no
    output matrix (the embedding serves). claimed_layers: a block_count for the header
    that the tensors do not have (a hostile file)."""
    import gguf
    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head = shape["n_embd"], shape["n_ff"], shape["n_head"]
    n_embd_kv = n_embd // n_head * shape["n_head_kv"]

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(name)
    w.add_context_length(shape["n_ctx"])
    w.add_embedding_length(n_embd)
    w.add_block_count(claimed_layers or shape["n_layer"])
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(shape["n_head_kv"])
    w.add_rope_dimension_count(n_embd // n_head)
    if "rope_base" in shape:
        w.add_rope_freq_base(shape["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType[file_type]))
    n_vocab = add_vocabulary(w, shape["n_vocab"] - len(SPECIAL) - 256)

    def matrix(tensor: str, rows: int, cols: int) -> None:
        data, qtype = weight(tensor, rng.standard_normal((rows, cols), dtype=np.float32) * 0.05)
        w.add_tensor(tensor, data, raw_dtype=qtype)

    def norm(tensor: str) -> None:
        w.add_tensor(tensor, np.ones(n_embd, dtype=np.float32))

    matrix("token_embd.weight", n_vocab, n_embd)
    for i in range(shape["n_layer"]):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        matrix(f"blk.{i}.attn_k.weight", n_embd_kv, n_embd)
        matrix(f"blk.{i}.attn_v.weight", n_embd_kv, n_embd)
        matrix(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", n_vocab, n_embd)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_q6_k(rows: int, cols: int, rng, d_range: tuple[float, float] = (1e-5, 4e-5)) -> np.ndarray:
    """Q6_K blocks of random bytes, each scaled by an fp16 d drawn from d_range: the
    `gguf` package cannot quantize to Q6_K, and any bytes make a valid block (every
    6-bit value, every int8 scale, -128 included)."""
    return _random_blocks(rows, cols, 210, [208], rng, d_range)


def random_q5_k(rows: int, cols: int, rng, d_range: tuple[float, float] = (1e-5, 4e-5)) -> np.ndarray:
    """Q5_K blocks of random bytes (every 5-bit value, every 6-bit scale and min), each
    with an fp16 d and dmin drawn from d_range: the `gguf` package cannot quantize to Q5_K."""
    return _random_blocks(rows, cols, 176, [0, 2], rng, d_range)


def _random_blocks(rows: int, cols: int, size: int, halves: list[int], rng, d_range) -> np.ndarray:
    """Random 256-value blocks of `size` bytes, an fp16 from d_range at each offset in `halves`."""
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at in halves:
        d = rng.uniform(*d_range, size=(rows, cols // 256)).astype(np.float16)
        raw[..., at:at + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def quantized(types: dict, default: str):
    """A weight() for write_llama: each matrix quantised to the type its name's suffix
    maps to in `types` (e.g. "attn_output.weight": "Q4_0"), else to `default`; Q6_K as
    random blocks (random_q6_k) of about the data's size."""
    import gguf

    def weight(tensor: str, data):
        qtype = gguf.GGMLQuantizationType[next((t for k, t in types.items() if tensor.endswith(k)), default)]
        if qtype == gguf.GGMLQuantizationType.Q6_K:
            rng = np.random.default_rng(data.view(np.uint32).ravel()[:4])
            scale = float(np.abs(data).max()) / (127 * 32)
            return random_q6_k(*data.shape, rng, (0.5 * scale, scale)), qtype
        return gguf.quants.quantize(data, qtype), qtype
    return weight


def write(path: str, seed: int = 0, claimed_layers: int | None = None) -> str:
    """Write the tiny model to `path` and return the path. claimed_layers: a block_count
    for the header that the tensors do not have (a hostile file: libllama asserts on 1000)."""
    shape = dict(n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=N_HEAD, n_ff=N_FF, n_layer=N_LAYER, n_ctx=N_CTX,
                 n_vocab=len(SPECIAL) + 256 + N_WORDS)
    types = {"token_embd.weight": "Q8_0", "attn_output.weight": "Q4_0", "ffn_down.weight": "Q8_0",
             "attn_v.weight": "Q6_K"}
    return write_llama(path, "swarmkv tiny test model", shape, quantized(types, "Q4_1"), seed,
                       claimed_layers=claimed_layers)


def write_twin(path: str, like: str = "smollm2-135m", seed: int = 0) -> str:
    """Write a random-weight model with the shapes and weight types of a real one (TWINS):
    as fast to decode as the real model, without it. Returns the path."""
    return write_llama(path, f"swarmkv random twin of {like}", TWINS[like],
                       quantized({"token_embd.weight": "Q8_0"}, "Q4_1"), seed, tied=True)


def retokened(source: str, path: str, renamed: dict[str, str], chat_template: str | None = None) -> str:
    """Copy the GGUF `source` to `path` with tokens renamed (old text -> new text, the
    token's type kept) and, if given, another chat template: a real model that carries
    another family's control tokens (SmolLM2 with Mistral's [TOOL_CALLS]), for tests of
    that family's forms. Returns the path."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = gguf.GGUFReader(source)
    tokens = [renamed.get(t, t) for t in reader.fields[gguf.Keys.Tokenizer.LIST].contents()]
    missing = set(renamed) - set(reader.fields[gguf.Keys.Tokenizer.LIST].contents())
    if missing:
        raise ValueError(f"{source} has no token {sorted(missing)}")
    new = {gguf.Keys.Tokenizer.LIST: MetadataDetails(gguf.GGUFValueType.ARRAY, tokens,
                                                     sub_type=gguf.GGUFValueType.STRING)}
    if chat_template is not None:
        new[gguf.Keys.Tokenizer.CHAT_TEMPLATE] = MetadataDetails(gguf.GGUFValueType.STRING, chat_template)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    copy_with_new_metadata(reader, gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess), new, [])
    return path


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="tiny_gguf.py", description="write a random-weight test model")
    ap.add_argument("out")
    ap.add_argument("--like", choices=sorted(TWINS), help="a twin of this model instead of the tiny one")
    args = ap.parse_args()
    print(write_twin(args.out, args.like) if args.like else write(args.out))
