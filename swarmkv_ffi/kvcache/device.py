"""The device tier: what a request pool keeps of finished requests, in its own cells.

Every request submitted to a RequestPool (conductor/requests.py) is a short-lived
sequence in its model's pool. When it finishes, its sequence is not freed: its cells
stay, with the tokens they hold, until the pool needs the room (least recently used
first; the bookkeeping of seats and kept sequences is Pool's, conductor/pool.py). A new
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


@dataclass
class Kept:
    owner: int
    tokens: list[int]                   # what the sequence's cells hold, position by position
    cells: int = 0                      # the cells it books: those no sequence it forked from books
    last_used: float = field(default_factory=time.monotonic)
