"""The device tier: what a request pool keeps of finished requests, in its own cells.

Every request submitted to a RequestPool (conductor/requests.py) is a short-lived
sequence in its model's pool. When it finishes, its sequence is not freed: its cells
stay, with the tokens they hold, until the pool needs the room (least recently used
first: KeptCells below keeps the books, conductor/pool.py moves the cells). A new
request whose prompt starts with the same tokens as a kept sequence, or as a request
still running, forks that many cells into its own sequence (`llama_memory_seq_cp`: the
cells are shared, nothing is copied) and decodes only the rest. Sequences that share a
prefix share its cells, so the pool holds a tree of prompts, as SGLang's RadixAttention
does, with llama.cpp's cells as the tree's storage.

A kept sequence is matched only by requests of the owner that made it (unless the
operator allows sharing): a prefix served from cache is faster, and that speed would
tell one user what another has asked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .prefix import longest_common_prefix
from .radix import RadixTree


@dataclass
class Kept:
    owner: int
    tokens: list[int]                   # what the sequence's cells hold, position by position
    cells: int = 0                      # the cells it books: those no sequence it forked from books
    last_used: float = field(default_factory=time.monotonic)


class KeptCells:
    """A request pool's kept sequences and the forks between its sequences: who may fork
    what, which sequence books shared cells once another goes, and the order in which
    kept sequences give up their room. Bookkeeping only: the pool (conductor/pool.py)
    moves the cells (seq_cp, seq_rm) and counts what is free.

    Every cell is booked once, however many sequences share it: a sequence books its
    cells less the prefix it forked (`forks`), which the sequence it forked from books.
    When that one goes, the cells the others still use are not freed by llama.cpp, so
    their booking passes to one of them, the heir (the one that forked the most)."""

    def __init__(self, share: bool = False):
        self.share = share                        # every owner may fork every owner's cells
        self.kept: dict[int, Kept] = {}           # seq -> a finished request's cells (drop() removes)
        self.forks: dict[int, tuple[int, int]] = {}   # seq -> (seq it forked from, tokens)
        self.trees: dict[int | None, RadixTree] = {}  # owner (None: shared) -> its kept sequences

    def clear(self) -> None:
        self.kept, self.forks, self.trees = {}, {}, {}

    def _tree(self, owner: int) -> RadixTree:
        return self.trees.setdefault(None if self.share else owner, RadixTree())

    def may_fork(self, owner: int, asker: int) -> bool:
        """Whether `asker` may fork cells of `owner`'s: its own, or anyone's if shared."""
        return self.share or owner == asker

    def match(self, wanted: list[int], asker: int, running=()) -> tuple[int, int | None]:
        """The longest prefix of `wanted` held by a kept sequence (the asker's radix tree)
        or by one of `running` ((owner, tokens held, seq) of sequences still decoding, a
        few: compared one by one) that `asker` may fork, and that sequence (a kept one on
        a tie); at most all but the last token, whose logits the asker needs."""
        cap = len(wanted) - 1
        tree = self.trees.get(None if self.share else asker)
        best, best_seq = tree.longest(wanted) if tree is not None else (0, None)
        best = min(best, cap)
        for owner, tokens, seq in running:
            if self.may_fork(owner, asker):
                n = min(longest_common_prefix(tokens, wanted), cap)
                if n > best:
                    best, best_seq = n, seq
        return (best, best_seq) if best > 0 else (0, None)

    def fork(self, seq: int, source: int, n: int) -> None:
        """`seq` now shares the first n cells of `source` (which books them)."""
        self.forks[seq] = (source, n)
        if source in self.kept:
            self.kept[source].last_used = time.monotonic()

    def forked(self, seq: int) -> int:
        """The tokens `seq` forked from another sequence (which books their cells)."""
        return self.forks.get(seq, (None, 0))[1]

    def keep(self, seq: int, owner: int, tokens: list[int], cells: int) -> None:
        self.kept[seq] = Kept(owner, tokens, cells)
        self._tree(owner).insert(seq, tokens)

    def drop(self, seq: int) -> Kept:
        """Forget kept `seq` (its cells are the pool's to free) and return it."""
        kept = self.kept.pop(seq)
        self._tree(kept.owner).remove(seq)
        return kept

    def heir(self, seq: int) -> tuple[int | None, int]:
        """The sequence that would book what others forked from `seq` once it goes (the
        one that forked the most of it), and how many cells it would take over."""
        forked = [(n, d) for d, (src, n) in self.forks.items() if src == seq]
        if not forked:
            return None, 0
        n, heir = max(forked)
        return heir, max(0, n - self.forked(seq))

    def shared(self, seq: int) -> int:
        """The longest opening of `seq` another sequence holds too: one it forked, or one
        others forked from it."""
        return max([n for d, (src, n) in self.forks.items() if d == seq or src == seq], default=0)

    def frees(self, seq: int) -> int:
        """The cells evicting kept `seq` gives back (its heir keeps what others share)."""
        return self.kept[seq].cells - self.heir(seq)[1]

    def frees_prefix(self, seq: int, min_tokens: int) -> bool:
        """Whether evicting kept `seq` loses at least `min_tokens` tokens: those it holds
        beyond what it forked (its source stays) and what others forked of it (its heir
        keeps that)."""
        return len(self.kept[seq].tokens) - self.forked(seq) - self.heir(seq)[1] >= min_tokens

    def hand_down(self, seq: int) -> tuple[int | None, int]:
        """`seq` is going: the sequences that forked from it fork from its heir from now
        on, and the heir books the cells it took over (a kept heir here; a running one's
        seat is the pool's to grow). Returns (heir, cells taken over)."""
        heir, took = self.heir(seq)
        below = self.forks.pop(seq, None)
        if heir is None:
            return None, 0
        for d, (src, n) in list(self.forks.items()):
            if src == seq and d != heir:
                self.forks[d] = (heir, n)
        n_heir = self.forks.pop(heir)[1]
        if below is not None and min(n_heir, below[1]) > 0:
            self.forks[heir] = (below[0], min(n_heir, below[1]))
        if heir in self.kept:
            self.kept[heir].cells += took
        return heir, took

    def fair_share(self, asker: int, running_owners: set, n_ctx: int) -> int:
        """n_ctx over the owners present: the asker, those running, those keeping cells."""
        return n_ctx // len({asker} | set(running_owners) | {k.owner for k in self.kept.values()})

    def evictable(self, asker: int, source: int | None, running_owners: set, n_ctx: int):
        """The kept sequences a request of `asker`'s may evict, in the order it should:
        its own, least recently used first; then others' only while their owner keeps
        more than its fair share (fair_share); the one it is about to fork (`source`)
        last: prefilling it again beats never running."""
        fair = self.fair_share(asker, running_owners, n_ctx)
        held: dict[int, int] = {}
        for kept in self.kept.values():
            held[kept.owner] = held.get(kept.owner, 0) + kept.cells
        by_age = sorted((seq for seq in self.kept if seq != source), key=lambda s: self.kept[s].last_used)
        yield from (seq for seq in by_age if self.kept[seq].owner == asker)
        for seq in by_age:
            kept = self.kept[seq]
            if kept.owner != asker and held[kept.owner] > fair:
                held[kept.owner] -= kept.cells
                yield seq
        if source in self.kept and (self.kept[source].owner == asker or held[self.kept[source].owner] > fair):
            yield source

    def kept_by_others(self, asker: int) -> int:
        return sum(k.cells for k in self.kept.values() if k.owner != asker)
