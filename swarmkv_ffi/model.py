"""Model: a loaded GGUF file, its vocabulary, tokenizer and chat template.

Loading goes through llama_model_load_from_file; before that we check the path exists and
the file starts with the GGUF magic, so the common mistakes get a plain answer instead of
a NULL pointer. Anything libllama itself rejects (a truncated file, an unknown
architecture) comes back with the error lines libllama logged.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import library
from ._owned import Owned
from .errors import ModelLoadError, ModelNotFoundError, TokenizeError
from .library import ffi

GGUF_MAGIC = b"GGUF"
INT32_MIN = -(2**31)
# (architecture prefix, llama_chat_apply_template built-in name) for GGUFs without a template
BUILTIN_TEMPLATES = (("gemma", "gemma"), ("llama", "llama3"), ("qwen", "chatml"))


def builtin_templates() -> list[str]:
    """The names of libllama's built-in chat templates (llama-server's --chat-template
    list: chatml, llama3, command-r, ...), which apply_chat_template(template=NAME) renders."""
    lib = library.backend()
    n = lib.llama_chat_builtin_templates(ffi.NULL, 0)
    names = ffi.new("const char *[]", n)
    lib.llama_chat_builtin_templates(names, n)
    return [ffi.string(names[i]).decode() for i in range(n)]


def check_gguf_file(path: Path) -> None:
    """Raise a clear error unless `path` is an existing file that starts like a GGUF."""
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF')")


class Model(Owned):
    """A GGUF model loaded into libllama.

    `progress` is called with a float in [0, 1] while the weights load; returning False
    cancels the load. `n_gpu_layers=None` keeps libllama's default (offload everything it
    can when a GPU backend is present).
    """

    def __init__(self, path: str | Path, *, n_gpu_layers: int | None = None,
                 progress: Callable[[float], bool | None] | None = None,
                 use_mmap: bool = True, repack: bool = True):
        self.path = Path(path)
        check_gguf_file(self.path)
        lib = library.backend()
        params = lib.llama_model_default_params()
        if n_gpu_layers is not None:
            params.n_gpu_layers = n_gpu_layers
        if not use_mmap:
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = repack
        callback, raised = None, []
        if progress is not None:
            def on_progress(value, _user):
                try:
                    return progress(float(value)) is not False
                except BaseException as exc:  # must not unwind through C: cancel, re-raise below
                    raised.append(exc)
                    return False
            callback = ffi.callback("llama_progress_callback", on_progress)
            params.progress_callback = callback
        library.recent_errors()  # forget errors from earlier calls
        handle = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if raised:
            if handle != ffi.NULL:
                lib.llama_model_free(handle)
            raise raised[0]
        if handle == ffi.NULL:
            said = library.take_error_text("no message from libllama")
            raise ModelLoadError(
                f"llama_model_load_from_file({self.path}) failed: {said}. "
                "Is the file complete (not truncated) and a model architecture this "
                "llama.cpp build supports?")
        self._handle = handle
        self._vocab = lib.llama_model_get_vocab(handle)
        self._lib = lib
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        self._fingerprint: str | None = None
        self._fingerprint_lock = threading.Lock()
        self._closed = False

    def _release(self) -> None:
        for ctx in list(self._contexts):
            ctx.close()
        self._lib.llama_model_free(self._handle)
        self._handle = ffi.NULL

    @property
    def handle(self):
        self._check_open()
        return self._handle

    # ---- facts from the engine ----------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return self._lib.llama_model_n_layer(self.handle)

    @property
    def n_embd(self) -> int:
        return self._lib.llama_model_n_embd(self.handle)

    @property
    def n_cls_out(self) -> int:
        """Outputs of its classification head (a reranker's: 1; libllama says 1 without one)."""
        return self._lib.llama_model_n_cls_out(self.handle)

    @property
    def n_head(self) -> int:
        return self._lib.llama_model_n_head(self.handle)

    @property
    def n_head_kv(self) -> int:
        return self._lib.llama_model_n_head_kv(self.handle)

    @property
    def n_ctx_train(self) -> int:
        return self._lib.llama_model_n_ctx_train(self.handle)

    @property
    def n_swa(self) -> int:
        """Sliding-window size; 0 for models with full attention everywhere."""
        return self._lib.llama_model_n_swa(self.handle)

    @property
    def n_vocab(self) -> int:
        self._check_open()
        return self._lib.llama_vocab_n_tokens(self._vocab)

    @property
    def size_bytes(self) -> int:
        return int(self._lib.llama_model_size(self.handle))

    @property
    def n_params(self) -> int:
        return int(self._lib.llama_model_n_params(self.handle))

    @property
    def description(self) -> str:
        buf = ffi.new("char[256]")
        self._lib.llama_model_desc(self.handle, buf, 256)
        return ffi.string(buf).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the key is absent."""
        size = 256
        while True:
            buf = ffi.new("char[]", size)
            n = self._lib.llama_model_meta_val_str(self.handle, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return ffi.string(buf).decode("utf-8", "replace")
            size = n + 1

    @property
    def bos(self) -> int:
        self._check_open()
        return self._lib.llama_vocab_bos(self._vocab)

    @property
    def eos(self) -> int:
        self._check_open()
        return self._lib.llama_vocab_eos(self._vocab)

    @property
    def add_bos(self) -> bool:
        self._check_open()
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))

    @property
    def sep(self) -> int:
        """The sentence separator (-1 when the vocabulary has none)."""
        self._check_open()
        return self._lib.llama_vocab_sep(self._vocab)

    @property
    def add_eos(self) -> bool:
        self._check_open()
        return bool(self._lib.llama_vocab_get_add_eos(self._vocab))

    @property
    def add_sep(self) -> bool:
        self._check_open()
        return bool(self._lib.llama_vocab_get_add_sep(self._vocab))

    def is_eog(self, token: int) -> bool:
        """True for any end-of-generation token (EOS, EOT, …)."""
        self._check_open()
        return bool(self._lib.llama_vocab_is_eog(self._vocab, int(token)))

    @property
    def fingerprint(self) -> str:
        """blake2b-128 of the file's bytes: the same weights give the same fingerprint
        whatever the file is called. Computed once, on first use."""
        with self._fingerprint_lock:
            if self._fingerprint is None:
                h = hashlib.blake2b(digest_size=16)
                with self.path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                self._fingerprint = h.hexdigest()
        return self._fingerprint

    # ---- text <-> tokens ---------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True,
                 parse_special: bool = False) -> np.ndarray:
        """Token ids (int32) for `text`. add_special adds BOS/EOS as the model asks;
        parse_special turns written control tokens ("<|im_start|>") into their ids."""
        self._check_open()
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            out = np.empty(capacity, dtype=np.int32)
            n = self._lib.llama_tokenize(
                self._vocab, data, len(data), ffi.from_buffer("llama_token[]", out),
                capacity, add_special, parse_special)
            if n == INT32_MIN:
                raise TokenizeError(f"tokenizing {len(data)} bytes overflows int32")
            if n >= 0:
                return out[:n].copy()
            capacity = -n  # the negative return is the size needed

    def detokenize(self, tokens: Sequence[int] | np.ndarray, *, remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """Text for `tokens` (the inverse of tokenize)."""
        self._check_open()
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        capacity = max(16, len(ids) * 8)
        while True:
            buf = ffi.new("char[]", capacity)
            n = self._lib.llama_detokenize(
                self._vocab, ffi.from_buffer("llama_token[]", ids), len(ids), buf, capacity,
                remove_special, unparse_special)
            if n == INT32_MIN:
                raise TokenizeError(f"detokenizing {len(ids)} tokens overflows int32")
            if n >= 0:
                return ffi.unpack(buf, n).decode("utf-8", "replace")
            capacity = -n

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token's piece. Pieces may split a UTF-8 character, so
        streamers should feed these to an incremental decoder."""
        self._check_open()
        size = 32
        while True:
            buf = ffi.new("char[]", size)
            n = self._lib.llama_token_to_piece(self._vocab, int(token), buf, size, 0, special)
            if n >= 0:
                return ffi.unpack(buf, n)
            size = -n

    # ---- chat template ------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The model's chat template: its own (from the GGUF), else libllama's built-in
        template for its architecture (some GGUFs, e.g. the Gemma 3 270M one, ship none),
        else None."""
        ptr = self._lib.llama_model_chat_template(self.handle, ffi.NULL)
        if ptr != ffi.NULL:
            return ffi.string(ptr).decode("utf-8", "replace")
        arch = self.meta("general.architecture") or ""
        return next((name for prefix, name in BUILTIN_TEMPLATES if arch.startswith(prefix)), None)

    def apply_chat_template(self, messages: Sequence[dict], *, add_assistant: bool = True,
                            template: str | None = None) -> str:
        """Format [{"role": …, "content": …}, …] with the model's chat template
        (llama_chat_apply_template), ending with the assistant's turn opener."""
        tmpl = template if template is not None else self.chat_template
        if tmpl is None:
            raise TokenizeError(f"{self.path.name} has no chat template; pass template=")
        keep = []  # the C strings must outlive the call
        chat = ffi.new("llama_chat_message[]", len(messages))
        for i, msg in enumerate(messages):
            role = ffi.new("char[]", msg["role"].encode())
            content = ffi.new("char[]", msg["content"].encode())
            keep += [role, content]
            chat[i].role, chat[i].content = role, content
        tmpl_c = tmpl.encode()
        size = 2 * sum(len(m["content"]) for m in messages) + 256
        while True:
            buf = ffi.new("char[]", size)
            n = self._lib.llama_chat_apply_template(tmpl_c, chat, len(messages),
                                                    add_assistant, buf, size)
            if n < 0:
                raise TokenizeError(
                    f"llama_chat_apply_template does not support {self.path.name}'s template")
            if n <= size:
                return ffi.unpack(buf, n).decode("utf-8")
            size = n

    def __repr__(self):
        state = "closed" if self._closed else self.description
        return f"<Model {self.path.name} {state}>"
