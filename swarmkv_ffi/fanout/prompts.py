"""Prompt layout: the document as an exact token prefix of every branch's prompt.

Each branch's full prompt is rendered as one text (through the model's chat template when
`chat` is on) and tokenized as a whole, exactly as a plain run would. The shared prefix is
the longest run of tokens that the document-only text and *every* branch's full prompt
agree on, so a tokenizer merge across the document/question boundary can only shorten the
shared prefix by a token or two, never make a branch see different tokens than a plain
run. Branch tokens then continue at position n_prefix with no BOS in the middle.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kvcache.prefix import common_prefix_len

INSTRUCTION = "Read the document below, then answer the question that follows it.\n\n"
SENTINEL = "\u2063SWARMKV-QUESTION\u2063"  # invisible separator: never in a real document


@dataclass
class PromptLayout:
    prefix: np.ndarray           # shared document tokens (int32), BOS included if any
    suffixes: list[np.ndarray]   # per branch: the tokens after the prefix
    texts: list[str]             # per branch: the full prompt as text

    @property
    def n_prefix(self) -> int:
        return len(self.prefix)

    def full(self, i: int) -> np.ndarray:
        return np.concatenate([self.prefix, self.suffixes[i]])


def render(model, document: str, question: str, chat: bool) -> str:
    """The full prompt text a plain, unforked run would use."""
    body = f"{INSTRUCTION}{document}\n\nQuestion: {question}"
    if chat:
        return model.apply_chat_template([{"role": "user", "content": body}])
    return body + "\nAnswer:"


def layout(model, document: str, questions: list[str], chat: bool = True) -> PromptLayout:
    """Tokenize the document once as a prefix and each branch's full prompt."""
    if not questions:
        raise ValueError("at least one question is needed")
    if not document.strip():
        raise ValueError("the document is empty")
    texts = [render(model, document, q, chat) for q in questions]
    # The document part of the template: everything before the question's slot.
    probe = render(model, document, SENTINEL, chat)
    doc_text = probe[:probe.index(SENTINEL)].removesuffix("\n\nQuestion: ")
    doc_tokens = model.tokenize(doc_text, add_special=True, parse_special=chat)
    fulls = [model.tokenize(t, add_special=True, parse_special=chat) for t in texts]
    # Every branch keeps at least one token of its own: its first logits come from it.
    n = min(min(common_prefix_len(doc_tokens, f), len(f) - 1) for f in fulls)
    if n <= 0:
        raise ValueError("document and prompts share no tokens; cannot fork a prefix")
    return PromptLayout(prefix=fulls[0][:n].copy(), suffixes=[f[n:].copy() for f in fulls], texts=texts)
