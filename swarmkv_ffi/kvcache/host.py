"""The tier below a request pool's cells: evicted cached prefixes kept in host RAM.

A request pool keeps finished requests' cells as cache (device.py) until it needs the room.
What it evicts would be forgotten and prefilled again by the next request over the same
document. `HostTier` keeps it instead: the evicted sequence's KV state is captured
(llama_state_seq_get_data, a copy of its cells) into host RAM, booked in the conductor's
swap ledger (admission/ledger.py; lmxd's --swap budget, or the server's own) and within the tier's
own byte limit. When the tier is full, the least recently used entry of the owner holding
the most goes down to the store below it (serve's --cache-dir on disk, disk.py), or
away if there is none. A request whose prompt the pool holds little of restores the
longest entry of its owner's that starts like it, here or below, when the measured cost
of restoring is below the measured cost of prefilling (`Costs`); cells restored beyond
the common opening are trimmed by the pool.

    pool cells --evicted--> HostTier (host RAM, swap ledger) --full--> below (disk) --> away
    a request  <--restored-- the nearest tier that holds its opening, if cheaper than prefill

Entries are per owner: one key never restores (or times) another's prefixes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import SwarmKVError, describe
from ..snapshot import Snapshot, tokens_hash
from ..admission import keys
from ..admission.ledger import Ledger, LedgerDenied
from .costs import Costs
from .prefix import longest_common_prefix
from .thresholds import HOST_MIN
from .tier import PrefixTier

log = logging.getLogger("lmxd")


@dataclass
class HostEntry:
    owner: int
    tokens: list[int]
    snap: Snapshot
    last_used: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> keys.Key:
        return keys.tier(self.owner, tokens_hash(self.tokens))


class HostTier:
    """PrefixTier in host RAM, of at most `limit_bytes`, booked in `ledger`, over the
    store `below` (or none). Runs on the scheduler's thread; `nbytes`, `len(entries)` and
    `demoted` may be read from others (/metrics)."""
    min_tokens = HOST_MIN

    def __init__(self, ledger: Ledger, limit_bytes: int, below: PrefixTier | None = None):
        self.ledger, self.limit, self.below = ledger, limit_bytes, below
        self.entries: dict[str, HostEntry] = {}
        self.nbytes = 0            # what the entries hold (and the ledger books)
        self.costs = Costs()
        self.demoted = 0           # entries sent down to `below` (or dropped) for room

    # ---- PrefixTier ------------------------------------------------------------------
    def remember(self, owner: int, tokens: list[int], ctx, seq: int, n: int) -> None:
        """A prefix requests share: the store below keeps it (it outlives the process)."""
        if self.below is not None:
            self.below.remember(owner, tokens, ctx, seq, n)

    def evicted(self, owner: int, tokens: list[int], ctx, seq: int) -> None:
        """The pool evicts `seq`, which holds `tokens`: keep a copy of its KV here."""
        if len(tokens) < self.min_tokens or any(e.owner == owner and e.tokens[:len(tokens)] == tokens
                                                for e in self.entries.values()):
            return                          # too short, or held already (in a longer entry)
        if ctx.seq_state_size(seq) > self.limit:
            if self.below is not None:      # never copied into RAM only to be let go at once
                self.below.evicted(owner, tokens, ctx, seq)
            return
        try:
            entry = HostEntry(owner, list(tokens), Snapshot.capture(ctx, seq, tokens))
        except SwarmKVError as exc:
            log.warning("host cache: capture of %d tokens failed (%s); it is prefilled again if asked",
                        len(tokens), describe(exc))
            return
        for old in [e for e in self.entries.values() if e.owner == owner and tokens[:len(e.tokens)] == e.tokens]:
            self._drop(old)                 # a shorter opening of this one: held in it now
        if not self._admit(entry, ctx):
            self._down(entry, ctx)

    def recall(self, owner: int, tokens: list[int], ctx, seq: int, more_than: int, spare: int = 0,
               prefill_s: float | None = None) -> tuple[int, str | None]:
        """Restore into the empty `seq` the entry of `owner`'s sharing the longest opening
        with `tokens` (all but the last), if longer than `more_than` and cheaper than
        prefilling what it saves; its cells beyond that opening at most `spare` (the pool
        trims them). (tokens in common, "host"), or the store below's answer, or (0, None)."""
        best, entry = self._best(owner, tokens, spare)
        if entry is not None and best > more_than and best >= self.min_tokens and \
                self.costs.cheaper(len(entry.tokens), best - more_than, prefill_s):
            t0 = time.perf_counter()
            try:
                entry.snap.restore(ctx, seq)
            except SwarmKVError as exc:
                log.warning("host cache: restore failed (%s); prefilling instead", describe(exc))
                self._drop(entry)
                ctx.seq_rm(seq)
            else:
                self.costs.observe(len(entry.tokens), time.perf_counter() - t0)
                entry.last_used = time.monotonic()
                return best, "host"
        if self.below is None:
            return 0, None
        return self.below.recall(owner, tokens, ctx, seq, more_than, spare, prefill_s)

    def flush(self) -> None:
        if self.below is not None:
            self.below.flush()

    def clear(self) -> None:
        """Drop every entry and its booking (the pool it served is closed)."""
        for entry in list(self.entries.values()):
            self._drop(entry)

    # ---- inside ------------------------------------------------------------------------------
    def _best(self, owner: int, tokens: list[int], spare: int) -> tuple[int, HostEntry | None]:
        best, chosen = 0, None
        for entry in self.entries.values():
            if entry.owner != owner:
                continue
            n = min(longest_common_prefix(entry.tokens, tokens), len(tokens) - 1)
            if n > best and len(entry.tokens) - n <= spare:
                best, chosen = n, entry
        return best, chosen

    def _admit(self, entry: HostEntry, ctx) -> bool:
        """Book the entry, sending older ones down for room; False if it cannot fit."""
        size = entry.snap.nbytes
        if size > self.limit:
            return False
        while self.nbytes + size > self.limit:
            self._down(self._victim(), ctx)
        while True:
            try:
                self.ledger.reserve(entry.key, size)
                break
            except LedgerDenied:
                if not self.entries:
                    return False            # the swap budget is others' now
                self._down(self._victim(), ctx)
        self.entries[entry.key] = entry
        self.nbytes += size
        return True

    def _victim(self) -> HostEntry:
        """The least recently used entry of the owner who holds the most bytes here."""
        held: dict[int, int] = {}
        for e in self.entries.values():
            held[e.owner] = held.get(e.owner, 0) + e.snap.nbytes
        richest = max(held, key=held.get)
        return min((e for e in self.entries.values() if e.owner == richest), key=lambda e: e.last_used)

    def _down(self, entry: HostEntry, ctx) -> None:
        """The entry leaves host RAM for the store below, if any."""
        if entry.key in self.entries:
            self._drop(entry)
        self.demoted += 1
        if self.below is not None:
            self.below.keep(entry.owner, entry.snap, ctx)

    def _drop(self, entry: HostEntry) -> None:
        del self.entries[entry.key]
        self.nbytes -= entry.snap.nbytes
        self.ledger.release(entry.key)
