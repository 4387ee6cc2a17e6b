"""Prompt tokens that DECODEs starting together have in common, decoded once.

Agents often open with the same words (a system prompt, a question template). When
several DECODEs take their first step together from the same starting point (a fresh
conversation, or one that is exactly its shared document), the tokens their prompts have
in common, position by position, go into the batch once, tagged with every sequence that
shares them: llama.cpp stores such a token in one cell that belongs to all of them
(the cells a fork shares), so each prompt pays only for the tokens that are its own.

The prompts form a trie: a token shared by k prompts is one batch row in k sequences,
and where prompts part, each branch goes on with the sequences that still agree. A
prompt that ends at a shared row samples from that row (the same logits). In exact mode
this changes no value: a row's KV depends only on its own token, position and visible
cells, and the visible cells of every sequence stay in position order.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Node:
    seqs: list = field(default_factory=list)          # the sequences of the prompts through it
    ends: list = field(default_factory=list)          # keys of the prompts that end here
    children: dict = field(default_factory=dict)      # token -> _Node


class PromptTrie:
    """(key, seq, tokens) prompts that all start at one position, common tokens merged."""

    def __init__(self, prompts: list[tuple[object, int, list[int]]]):
        self.root, self.size = _Node(), 0      # size: the batch rows it takes
        for key, seq, tokens in prompts:
            node = self.root
            for t in tokens:
                if t not in node.children:
                    node.children[t] = _Node()
                    self.size += 1
                node = node.children[t]
                node.seqs.append(seq)
            node.ends.append(key)

    def add_to(self, batch, pos0: int) -> dict:
        """Add every node to `batch` (depth first, so each sequence's positions rise);
        returns {key: the row whose logits end its prompt}."""
        rows: dict = {}
        stack = [(pos0, t, child) for t, child in reversed(list(self.root.children.items()))]
        while stack:
            pos, token, node = stack.pop()
            row = batch.add(token, pos, node.seqs, logits=bool(node.ends))
            for key in node.ends:
                rows[key] = row
            stack.extend((pos + 1, t, child) for t, child in reversed(list(node.children.items())))
        return rows
