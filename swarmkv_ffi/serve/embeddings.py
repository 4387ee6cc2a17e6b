"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings from a served model (issue 64).

Agents retrieve, and llama-server, vLLM, SGLang, Ollama and LM Studio all answer this
route. A generation pool keeps only the rows it samples from, so each hosted model gets,
on its first embeddings request, a context of its own in embeddings mode beside its pool
(`Embedder`): the model's own pooling, mean where it has none (a generative model's), and
vectors of length 1, as OpenAI's are. The context's memory (libllama's own count of its
cells and compute buffers) is booked in the ledger under the model's name before it is
used, and freed with the model; with no room the request gets 503.

A request's inputs are packed into as few decodes as the context holds (EMBED_CELLS
tokens, EMBED_SEQS inputs each), on a worker thread; an input longer than EMBED_CELLS
tokens is a 400 naming it. The context runs one decode at a time, and the keys waiting
for it take turns decode by decode (`TakeTurns`): one key's request of 65,536 tokens
does not hold it while another key's one sentence waits. Each input is its own sequence
and pooled over its own rows, so what else shares its decode changes which kernels round
its sums, not what it attends to (compare vectors with a tolerance).
"""
from __future__ import annotations

import base64
import collections
import contextlib
import threading
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..admission.ledger import LedgerDenied
from ..batch import Batch
from ..context import Context
from .errors import Refused

#: Tokens one decode of the embeddings context holds: the longest input it takes.
EMBED_CELLS = 2048
#: Inputs one decode packs.
EMBED_SEQS = 16
#: Inputs one request may hold (OpenAI's limit).
MAX_INPUTS = 2048
#: Tokens one request may hold in all: the context is one per model, shared by every key's
#: requests one at a time, so one request may not hold it for minutes.
MAX_REQUEST_TOKENS = 32 * EMBED_CELLS


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ContentInput(BaseModel):
    """llama-server's multimodal input, {"content": text or parts}: here text parts only
    (a served model reads no images, audio or video), joined."""
    model_config = ConfigDict(extra="forbid")
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # several: text, ids and content objects mixed, as llama-server takes them
    input: Union[str, list[int], list[Union[str, list[int], ContentInput]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(t, int) for t in x):
            return [list(x)]
        return [t.text() if isinstance(t, ContentInput) else t for t in x]


class Embedder:
    """A model's embeddings context and its ledger booking; pooled() serialises callers.
    `pooling`: --pooling's choice (None: the model's own, mean where it has none), or
    "rank", by the model's classification head (rerank.py)."""

    def __init__(self, model, ledger, key: str, n_threads: int | None = None, pooling: str | None = None):
        if pooling == "none":
            raise Refused(400, "embeddings here are one pooled vector per input, and this server runs with "
                          "--pooling none", "invalid_request_error", "input")
        rank = pooling == "rank"
        kw = {"n_threads": n_threads} if n_threads else {}
        # kv_unified: the whole decode in one ubatch (split per sequence, an input longer than
        # another was pooled over its last rows only: 0.21 off its vector alone).
        kw.update(n_ctx=EMBED_CELLS, n_batch=EMBED_CELLS, n_ubatch=EMBED_CELLS, n_seq_max=EMBED_SEQS,
                  kv_unified=True, embeddings=True)
        ctx = Context(model, pooling=pooling or "unspecified", **kw)
        if ctx.pooling == "none":                  # a generative model: mean over the input's rows
            ctx.close()
            ctx = Context(model, pooling="mean", **kw)
        self.width = model.n_cls_out if rank else model.n_embd
        # libllama reads sequence k's rank at k * n_cls_out of the pooled rows, which are
        # n_embd wide without a head: past the first sequence of a decode it reads the first's
        self.per_decode = EMBED_SEQS if not rank or has_rank_head(model) else 1
        try:
            ledger.reserve(key, max(1, sum(ctx.memory_bytes())))
        except LedgerDenied as exc:
            ctx.close()
            raise Refused(503, f"no memory for this model's embeddings context ({exc})", "no_room") from None
        self.ctx, self.ledger, self.key = ctx, ledger, key
        self._turns = TakeTurns()
        self._batch = Batch(EMBED_CELLS)

    def embed(self, inputs: list[list[int]], owner=None) -> np.ndarray:
        """One unit vector per input (rows in order), for `owner` (an API key's)."""
        out = self.pooled(inputs, owner)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms > 0, norms, 1)

    def pooled(self, inputs: list[list[int]], owner=None) -> np.ndarray:
        """What the context pools for each input (rows in order), as libllama gives it;
        `owner` takes its turn at the context for each decode."""
        out = np.zeros((len(inputs), self.width), dtype=np.float32)
        start = 0
        while start < len(inputs):
            end, cells = start, 0
            while end < len(inputs) and end - start < self.per_decode and cells + len(inputs[end]) <= EMBED_CELLS:
                cells += len(inputs[end])
                end += 1
            with self._turns.turn(owner):
                self._decode(inputs[start:end], out[start:end])
            start = end
        return out

    def _decode(self, group: list[list[int]], into: np.ndarray) -> None:
        self.ctx.clear()
        self._batch.clear()
        for seq, tokens in enumerate(group):
            self._batch.add_sequence(np.asarray(tokens, dtype=np.int32), 0, seq, logits_last=True)
        self.ctx.decode(self._batch)
        for seq in range(len(group)):
            into[seq] = self.ctx.embedding(seq)

    def close(self) -> None:
        with self._turns.turn(None):
            self.ctx.close()
            self.ledger.release(self.key)


class TakeTurns:
    """A lock that owners waiting for it get in turn: on release it goes to the owner
    after the last one served, round-robin, each owner's own waiters first come, first
    served. (threading.Lock wakes any waiter, so a key with many threads would win most
    turns.)"""

    def __init__(self):
        self._cond = threading.Condition()
        self._held = False
        self._waiting: collections.OrderedDict = collections.OrderedDict()   # owner -> its waiters, in order
        self._granted: object | None = None       # a waiter's token, handed the lock by release

    @contextlib.contextmanager
    def turn(self, owner):
        me = object()
        with self._cond:
            if self._held or self._waiting:
                self._waiting.setdefault(owner, collections.deque()).append(me)
                self._cond.wait_for(lambda: self._granted is me)
                self._granted = None
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                if self._waiting:
                    owner, queue = next(iter(self._waiting.items()))
                    self._granted = queue.popleft()
                    del self._waiting[owner]
                    if queue:                      # its next waiter goes to the back of the round
                        self._waiting[owner] = queue
                    self._held = True
                    self._cond.notify_all()


def has_rank_head(model) -> bool:
    """Is it a reranker: does its metadata pool by rank (its classification head), as
    llama.cpp's converter writes for one? (llama-server's `--pooling rank`, value 4.)"""
    return model.meta(f"{model.meta('general.architecture')}.pooling_type") == "4"


def tokens_of(model, body: EmbeddingsRequest) -> list[list[int]]:
    """Every input as tokens, each checked: not empty, within EMBED_CELLS, ids in the vocabulary."""
    inputs = body.inputs()
    if not inputs or len(inputs) > MAX_INPUTS:
        raise Refused(400, f"input: give 1 to {MAX_INPUTS} inputs, got {len(inputs)}", "invalid_value", "input")
    if body.dimensions is not None and body.dimensions != model.n_embd:
        raise Refused(400, f"dimensions: this model's embeddings have {model.n_embd}; shortening them is not "
                      "supported", "unsupported_parameter", "dimensions")
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, str) and len(x) > EMBED_CELLS * 64:
            raise Refused(400, f"input[{i}]: {len(x)} characters cannot fit {EMBED_CELLS} tokens",
                          "context_length_exceeded", "input")
        tokens = x if isinstance(x, list) else [int(t) for t in model.tokenize(x, add_special=True)]
        bad = next((t for t in tokens if not 0 <= t < model.n_vocab), None)
        if bad is not None:
            raise Refused(400, f"input[{i}]: token {bad} is not in the model's vocabulary", "invalid_token", "input")
        if not tokens or len(tokens) > EMBED_CELLS:
            raise Refused(400, f"input[{i}]: {len(tokens)} tokens is too large; an input takes 1 to {EMBED_CELLS}",
                          "context_length_exceeded", "input")
        out.append(tokens)
    return within_request(out, "input")


def within_request(inputs: list[list[int]], field: str) -> list[list[int]]:
    """The inputs, or a 400 when together they are over MAX_REQUEST_TOKENS."""
    total = sum(map(len, inputs))
    if total > MAX_REQUEST_TOKENS:
        raise Refused(400, f"{field}: {total} tokens in all; one request takes at most {MAX_REQUEST_TOKENS} "
                      "(split it)", "context_length_exceeded", field)
    return inputs


def answer(name: str, vectors: np.ndarray, n_tokens: int, encoding: str) -> dict:
    """OpenAI's list of embeddings: floats, or base64 of little-endian float32 (what the
    openai client asks for and decodes by default)."""
    def encoded(v: np.ndarray):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()
    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
