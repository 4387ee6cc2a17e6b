"""A radix tree of token sequences: the longest opening of a prompt that a held sequence
shares, found by walking the prompt once down the tree, not by comparing it with every
sequence held (SGLang's RadixCache does the same over its KV pages).

A request pool keeps up to 256 finished sequences (kvcache/device.py). Comparing a new
prompt with each took 58 ms for 128 kept sequences of 8k tokens, on the scheduler's thread
and several times per seating; the walk takes the branch points the prompt passes.

Each node holds a run of tokens (its edge) and the sequences whose tokens run through the
whole edge, oldest first; a sequence ending inside an edge splits it. Removing a sequence
walks its tokens again, so splits made after it was inserted cannot leave it behind.
"""
from __future__ import annotations

from .prefix import longest_common_prefix


class _Node:
    __slots__ = ("edge", "children", "seqs")

    def __init__(self, edge: list[int], seqs: dict | None = None):
        self.edge = edge
        self.children: dict[int, _Node] = {}      # first token of a child's edge -> child
        self.seqs: dict[int, None] = dict(seqs or {})   # an ordered set: oldest first


class RadixTree:
    """Sequences (by id) and the tokens each holds."""

    def __init__(self):
        self.root = _Node([])
        self.tokens: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def insert(self, seq: int, tokens: list[int]) -> None:
        """Hold `seq` with `tokens` (a sequence held already is replaced)."""
        if seq in self.tokens:
            self.remove(seq)
        self.tokens[seq] = list(tokens)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(list(tokens[i:]))
            m = longest_common_prefix(child.edge, tokens[i:i + len(child.edge)])
            if m < len(child.edge):
                child = self._split(node, child, m)
            child.seqs[seq] = None
            node, i = child, i + m

    @staticmethod
    def _split(parent: _Node, child: _Node, m: int) -> _Node:
        """Cut child's edge after m tokens: the first part becomes a node of its own,
        run through by every sequence that ran through the whole edge."""
        head = _Node(child.edge[:m], child.seqs)
        child.edge = child.edge[m:]
        head.children[child.edge[0]] = child
        parent.children[head.edge[0]] = head
        return head

    def remove(self, seq: int) -> None:
        """Forget `seq` (nothing if it is not held)."""
        tokens = self.tokens.pop(seq, None)
        if tokens is None:
            return
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children[tokens[i]]
            del child.seqs[seq]
            if not child.seqs:
                del node.children[tokens[i]]     # nobody runs through it, nor below it
                return
            node, i = child, i + len(child.edge)

    def longest(self, wanted: list[int]) -> tuple[int, int | None]:
        """How many leading tokens of `wanted` a held sequence holds, and the oldest such
        sequence; (0, None) when none shares its first token."""
        node, n, holder = self.root, 0, None
        while n < len(wanted):
            child = node.children.get(wanted[n])
            if child is None:
                break
            m = longest_common_prefix(child.edge, wanted[n:n + len(child.edge)])
            n, holder = n + m, child
            if m < len(child.edge):
                break
            node = child
        return (n, next(iter(holder.seqs))) if holder is not None else (0, None)
