"""Constrained decoding: a grammar narrows each step's choice to the tokens that keep the
output valid (a JSON value by schema, any JSON object, a Lark grammar).

The grammar engine is llguidance, what llama.cpp and vLLM use: it compiles a grammar
against the model's vocabulary (read once per model from libllama, `vocabulary`) and, for
each generated token, computes the bitmask of the tokens allowed next. Measured against
xgrammar on our vocabulary path (`swarmkv bench grammar`, docs/benchmarks.md): its first
mask comes 7-18x sooner (about a millisecond), it keeps raw control bytes out of JSON
strings where xgrammar lets one in, and it needs no other package (xgrammar requires
torch, transformers and triton); xgrammar's later masks are cheaper, but both are far
under a decode step, and ours is computed beside it.

A grammar is compiled once per request (`compile`, on the caller's worker thread) and
each of its outputs starts from a copy of that matcher (llguidance's deep_copy shares the
compiled grammar): n=16 choices compiled it 16 times on the scheduler's thread, about
60 MB each for a large schema. A `Constraint` is one output's state. The scheduler
calls, for each row it samples:
`apply(logits)` (disallowed tokens to -inf, before the sampler chain), then
`accept(token)` — which starts computing the next mask on a worker thread, so the mask is
ready by the time the next decode returns (llguidance releases the GIL, libllama too).
Masking is elementwise on the row's own logits: in exact mode a constrained request
gives the same tokens alone as among others.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

import llguidance

from .errors import SwarmKVError

_TOKENIZERS: dict[str, llguidance.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")


class GrammarError(SwarmKVError, ValueError):
    """A grammar (or JSON schema) llguidance cannot compile; the message says why."""


class _Vocab:
    """What llguidance's TokenizerWrapper reads: every token's bytes (control tokens
    marked with a leading 0xFF, llguidance's convention, so grammars never write them as
    text), the end token, and a tokenizer for the grammar's literals."""

    def __init__(self, model):
        self.tokens = pieces(model)
        self.eos_token_id = model.eos
        self.bos_token_id = model.bos if model.bos >= 0 else None
        self._model = model

    def __call__(self, text: bytes) -> list[int]:
        return [int(t) for t in self._model.tokenize(text.decode("utf-8", "replace"), add_special=False)]


def pieces(model) -> list[bytes]:
    """Every token's bytes, a control token's as 0xFF + its special text."""
    return [_piece(model, t) for t in range(model.n_vocab)]


def _piece(model, token: int) -> bytes:
    """A control token renders as nothing unless asked for its special text: that is how
    it is told apart without a second attribute call."""
    plain = model.token_bytes(token)
    special = model.token_bytes(token, special=True)
    return b"\xff" + special if special and not plain else plain


def vocabulary(model) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary, built once per model file (about a
    second for 50k tokens) with every end-of-generation token as an end."""
    key = str(model.path)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            ends = [t for t in range(model.n_vocab) if model.is_eog(t)]
            _TOKENIZERS[key] = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocab(model)), n_vocab=model.n_vocab, eos_token=ends)
        return _TOKENIZERS[key]


# ---- grammars -----------------------------------------------------------------------------

def json_schema(schema: dict) -> str:
    """A grammar for one JSON value valid against `schema`, written on one line with the
    separators json.dumps uses (free whitespace lets a small model pad forever). Objects
    take no property the schema does not list unless it says so (additionalProperties):
    what OpenAI's strict mode asks, and still valid output where strict is off."""
    schema = _closed(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    except ValueError as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from None


def json_rule(schema: dict) -> str:
    """A Lark rule's body for one JSON value valid against `schema`, written as json_schema()
    writes it (one line, json.dumps's separators, no unlisted property): how a Lark grammar
    embeds a JSON part, such as a tool call between a model's own markers."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "%json " + json.dumps(dict(_closed(schema), **{"x-guidance": options}))


def _closed(schema):
    """The schema with additionalProperties false on every object that does not set it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def any_json_object() -> str:
    """OpenAI's json_object mode: any JSON object."""
    return json_schema({"type": "object"})


def lark(text: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(text)


class Compiled:
    """A grammar compiled against one model's vocabulary, at its start: what every output
    of a request copies (Constraint), so a request compiles its grammar once. Raises
    GrammarError (the client's 400) when it cannot be used, with llguidance's reason."""

    def __init__(self, model, grammar: str):
        self.text, self.model_path = grammar, str(model.path)
        self.matcher = _matcher(model, grammar)


def _matcher(model, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(vocabulary(model), grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"the grammar cannot be used: {matcher.get_error()}")
    return matcher


def unpack(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """A token bitmask (32 tokens a word, lowest bit first, as llguidance and xgrammar
    write it) as a bool per token."""
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)


class Constraint:
    """One output under a grammar. Not thread-safe: the scheduler's thread drives it, and
    touches the matcher only once the worker computing a mask is done with it (llguidance
    refuses a second borrow: "Already mutably borrowed")."""

    def __init__(self, model, grammar: "str | Compiled"):
        if isinstance(grammar, Compiled) and grammar.model_path == str(model.path):
            self._matcher = grammar.matcher.deep_copy()
        else:
            self._matcher = _matcher(model, grammar if isinstance(grammar, str) else grammar.text)
        self.n_vocab = model.n_vocab
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self.finished = False       # the grammar allows nothing more: the output is complete
        self._ready: Future | None = _MASKS.submit(self._fill)

    def _fill(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def allowed(self) -> np.ndarray:
        """A bool per token: may it come next?"""
        if self._ready is not None:
            self._ready.result()
            self._ready = None
        return unpack(self._bits, self.n_vocab)

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf, in place."""
        logits[~self.allowed()] = -np.inf

    def accept(self, token: int) -> None:
        """Record the sampled token and start the next mask. A token the mask allowed
        always fits; one that does not (a bug) is an error, not a silent drift."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not fit the grammar: {self._matcher.get_error()}")
        self.finished = self._matcher.is_stopped()    # read now: the worker below holds the matcher
        if not self.finished:
            self._ready = _MASKS.submit(self._fill)

    def close(self) -> None:
        if self._ready is not None:
            self._ready.result()
            self._ready = None
