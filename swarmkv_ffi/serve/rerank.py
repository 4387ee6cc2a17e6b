"""POST /rerank (also /reranking, /v1/rerank, /v1/reranking): llama-server's reranking.

Retrieval agents rerank what a search found before they read it. llama-server answers in
Jina's shape (`documents` -> `results` of `index` and `relevance_score`, best first, with
`usage`) or, given `texts`, in TEI's (a bare list of `index` and `score`, and `text` with
`return_text`); `top_n` keeps the best. Like llama-server's, the route answers only on a
server started with --reranking (else 501), so no one is handed scores from a model that
was not meant to rank.

Each document is one input of the model's rank context (embeddings.Embedder with rank
pooling, beside the pool and booked in the ledger as the embeddings context is). Its
prompt is built as llama-server builds it (tools/server/server-common.cpp,
format_prompt_rerank): the model's own rerank template (`tokenizer.chat_template.rerank`,
with {query} and {document} filled in), or else the query and the document joined by the
vocabulary's own markers (BOS, EOS, SEP, where the vocabulary adds them). The score is the
classifier's first output. A model without a classification head (a generative one) has
none: libllama then gives the first component of the last token's hidden state, as
llama-server serves it, and only for the first sequence of a decode (it reads the others
at the wrong offset), so such a model's pairs go one per decode; the log says once that
its scores rank nothing.
"""
from __future__ import annotations

import logging

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from .embeddings import EMBED_CELLS, MAX_INPUTS, has_rank_head, within_request
from .errors import Refused

log = logging.getLogger(__name__)


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr
    documents: list[StrictStr] | None = Field(None, max_length=MAX_INPUTS)   # Jina's
    texts: list[StrictStr] | None = Field(None, max_length=MAX_INPUTS)       # TEI's
    top_n: int | None = Field(None, ge=0)
    return_text: bool = False             # TEI's: each result carries its text
    model: str | None = None

    def candidates(self) -> list[str]:
        """The documents to rank (a 400 when there are none)."""
        given = self.texts if self.texts is not None else self.documents
        if not given:
            raise Refused(400, '"documents" must be a non-empty string array', "invalid_value", "documents")
        return given


def tokens_of(model, body: RerankRequest) -> list[list[int]]:
    """Each document's prompt with the query, as tokens, each within the rank context."""
    template = model.meta("tokenizer.chat_template.rerank")
    out = []
    for i, document in enumerate(body.candidates()):
        if len(body.query) + len(document) > EMBED_CELLS * 64:
            raise Refused(400, f"documents[{i}]: with the query, {len(body.query) + len(document)} characters "
                          f"cannot fit {EMBED_CELLS} tokens", "context_length_exceeded", "documents")
        tokens = pair(model, template, body.query, document)
        if len(tokens) > EMBED_CELLS:
            raise Refused(400, f"documents[{i}]: with the query, {len(tokens)} tokens; a pair takes at most "
                          f"{EMBED_CELLS}", "context_length_exceeded", "documents")
        out.append(tokens)
    return within_request(out, "documents")


def pair(model, template: str | None, query: str, document: str) -> list[int]:
    """One query and document as the model reads them to score them (llama-server's way)."""
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", document)
        return [int(t) for t in model.tokenize(text, add_special=False, parse_special=True)]
    eos = model.eos if model.eos >= 0 else model.sep
    out = [model.bos] if model.add_bos else []
    out += [int(t) for t in model.tokenize(query, add_special=False, parse_special=False)]
    out += [eos] if model.add_eos else []
    out += [model.sep] if model.add_sep else []
    out += [int(t) for t in model.tokenize(document, add_special=False, parse_special=False)]
    return out + ([eos] if model.add_eos else [])


def warn_without_head(model, name: str) -> None:
    """Say once per served model that its scores do not rank (it has no classification head)."""
    if not has_rank_head(model) and name not in _WARNED:
        _WARNED.add(name)
        log.warning("--reranking with %s, which is not a reranker (no rank pooling in its metadata): its scores "
                    "are the first component of a hidden state, as llama-server gives them, and rank nothing", name)


_WARNED: set = set()


def answer(name: str, body: RerankRequest, scores: np.ndarray, n_tokens: int):
    """Jina's answer, or TEI's when the documents came as `texts`: best first, top_n of them."""
    given = body.candidates()
    tei = body.texts is not None
    label = "score" if tei else "relevance_score"
    order = sorted(range(len(given)), key=lambda i: -float(scores[i, 0]))
    results = []
    for i in order[:len(given) if body.top_n is None else body.top_n]:
        result = {"index": i, label: float(scores[i, 0])}
        if tei and body.return_text:
            result["text"] = given[i]
        results.append(result)
    if tei:
        return results
    return {"model": body.model or name, "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results}
