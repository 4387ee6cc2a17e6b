"""A pool: the one context that agents of a model share, a KV sequence per resident agent.

Agents of one model DECODE together in one llama_context with a unified KV cache: each
resident agent holds a sequence id (a seat), its cells are its conversation, and one
llama_decode steps every agent in the batch (scheduler.py). Prefix agents fork their
document's cells from a document sequence (llama_memory_seq_cp: the cells are shared,
nothing is copied) instead of each restoring a host copy. An agent leaves its sequence
only when the pool is out of seats or cells (the scheduler pauses the least recently
used idle one) or when another pool becomes live: switching between agents of one model
moves no KV bytes.

A pool is keyed by (model file, exact): prefix agents run batch-invariant kernels
(exact mode), which give the same tokens batched as alone; the other agents run the fast
kernels, so they get a pool of their own. The shared-prefix attention kernel reads a
sequence's cells in cell order, so exactness also needs every sequence's cells in
position order wherever they sit. llama.cpp puts new tokens into the first free cells
from where it last freed some, so a freed cell below a sequence's last one would take
that sequence's next token out of order. An exact pool therefore never frees cells
while agents are in it: what a roll-back, a RESET, a pause or a departure leaves is
handed to a `tomb` sequence that no token attends to, and new tokens always go above
every occupied cell. Another user's churn costs cells, never a rebuild: an exact pool
has one agent's n_ctx of cells beyond its agents' for the tomb to fill. Only when the
tomb's cells are needed for a seat are they freed (`flush_tombs`); the pool is then
`scrambled`, and the scheduler rebuilds it (every agent from its document and a
re-read, or its snapshot), charging the rebuild to the users who filled the tomb.

A seat costs the agent's n_ctx in cells (less its document when it shares one), and the
context is sized for the agents of the pool registered when it opens (Conductor.agents_of; plus the tomb's
room), so the pool holds no more KV than the agents' bookings in the ledger cover and
one agent's n_ctx; when agents leave and it holds more than that, it is `oversized`
and reopened smaller, unless another user's agents sit in it: then the cells beyond the
bookings are booked in the ledger as the pool's own (the conductor's excess booking)
until its context goes, so the ledger stays true and nobody is paused for a leaver.

A reopen pauses every resident to host RAM and back. So an agent registered since the
pool opened that does not fit it, while another user's agent sits in it, does not
reopen it: it decodes in a context of its owner's own (`PoolKey.alone`, made on a
thread of its own and booked to the owner: own.py) with that owner's other such
agents, until they leave; it is rebuilt larger or smaller for them the same way. One user's agents of
growing size cost that user, not everyone in the pool.

A request pool (requests.py: the pool a RequestPool opens, which serve/ submits to) has a
fixed size and keeps the cells of finished requests (`kept`, least recently used first
out) so that a later request that starts with the same tokens forks them instead of
decoding them again: a radix cache over the pool's cells, matched per owner (kvcache/device.py).
Room for a new request is made from kept sequences only as far as it falls short, its
owner's first, another owner's only beyond its fair share (evict_for).

Cells there are booked once, however many sequences share them: a request books its
tokens less the prefix it forked, and RESERVE more, growing by RESERVE as it generates (a
request the pool has no room to grow gives its cells up: the scheduler's _reserve); a
kept sequence books its tokens less its fork; who forked what, and who books shared
cells once their booker goes, is kvcache/device.py's KeptCells. The sum of bookings
stays at least the cells in use, and evicting can never overfill the pool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from ..context import Context
from ..errors import SwarmKVError
from ..snapshot import Snapshot
from ..kvcache.device import KeptCells
from ..kvcache.tier import PrefixTier
from .request_cells import RequestCells

#: llama.cpp's LLAMA_MAX_SEQ: sequences one context can hold.
MAX_SEQS = 256
#: A request in a fast pool books its prompt and this many more cells at first, and this
#: many more each time it has generated into them (grow), instead of all of max_tokens:
#: most agents stop long before their max_tokens, and what they never generate would
#: keep others waiting. An exact pool books max_tokens whole (its freed cells go to the
#: tomb, so growing would have nothing to take from).
RESERVE = 64


class NoRoom(SwarmKVError):
    """A request that cannot be seated in its request pool and would wait for nothing:
    no request runs there, and what is free and evictable for it is too little."""


@dataclass(frozen=True)
class Fixed:
    """A request pool's settings (requests.py): its size, whether every owner may fork
    every owner's kept cells, and the store of shared prefixes below them."""
    cells: int
    seqs: int
    share: bool = False
    store: PrefixTier | None = None


class PoolKey(NamedTuple):
    """The pool an agent decodes in."""
    model: str          # the model file's key
    exact: bool         # batch-invariant kernels (prefix agents, requests of an exact pool)
    requests: bool      # a request pool's (a fixed size, finished requests' cells kept)
    alone: str = ""     # a context of one user's own (its uid): its agents outgrew the shared one


@dataclass
class Seat:
    """A resident agent's sequence. kv_len: how many of the agent's history tokens have
    their KV in the sequence (the rest are re-read by the next steps)."""
    seq: int
    agent: "object"
    kv_len: int
    cells: int
    own_from: int = 0             # its first position not shared with a document


@dataclass
class Entry:
    """How an agent came into its seat, for its DECODE reply."""
    restored: bool = False      # its KV (or its document's) was loaded from host RAM
    forked: bool = False        # it shares its document's cells
    tier: str | None = None     # a request's cached opening came from: "pool", "host", "disk"
    swap_s: float = 0.0


class PoolHost(Protocol):
    """What a pool asks of the conductor that lends it memory (agents.py's Conductor): every
    byte a pool's context, a paused agent or a document's copy takes is booked there."""

    def new_context(self, loaded, n_ctx: int, n_seqs: int = 1, exact: bool = False) -> Context:
        """A llama context of the pool's model: n_ctx cells for n_seqs sequences."""

    def pause_seat(self, agent, ctx: Context, seat: Seat) -> None:
        """A leaving agent's KV kept in host RAM (booked to its owner), or only its tokens."""

    def keep_prefix(self, agent, snap: Snapshot) -> None:
        """The host copy of the agent's document, computed once for every agent over it."""

    def drop_saved(self, agent) -> None:
        """The agent's host copy is no longer needed (it is resident again)."""

    def pool_freed(self, key: PoolKey) -> None:
        """The pool's context went: what was booked for it alone goes too."""


class Pool(RequestCells):
    """One model's context and the sequences seated in it; what books memory is asked of
    `host` (PoolHost)."""

    def __init__(self, key: PoolKey, loaded, host: PoolHost, *, fixed: Fixed | None = None):
        self.key, self.loaded, self.exact = key, loaded, key.exact
        self.host = host
        self.fixed = fixed                        # a request pool's settings; None: sized for its agents
        self.store = fixed.store if fixed is not None else None
        self.ctx: Context | None = None
        self.seats: dict[str, Seat] = {}          # Agent.key -> its seat
        self.docs: dict[str, tuple[int, int]] = {}   # SharedPrefix.key -> (seq, cells)
        self.free_seqs: list[int] = []
        self.cells_free = 0
        self.scrambled = False
        self.resize = False
        self.tomb: int | None = None              # exact pools: the sequence that holds left cells
        self.tomb_cells = 0
        self.tomb_by: dict[int, int] = {}         # uid -> cells it left in the tomb
        self.rebuild_by: dict[int, float] = {}    # who pays the next rebuild (uid -> weight)
        self.rebuilds = 0                         # times it was reopened while open (STATUS)
        self.opens = 0                            # times its context was made (STATUS, /metrics)
        self.last: object | None = None           # the agent stepped last (the one reported evicted)
        self.cache = KeptCells(fixed is not None and fixed.share)   # finished requests' cells, and forks
        self.prefill_row_s: Callable[[], float | None] = lambda: None   # measured by the scheduler

    # ---- opening and closing ------------------------------------------------------------
    def size_for(self, agents: list) -> tuple[int, int]:
        """(cells, sequences) that seat every one of `agents` and their documents; an exact
        pool also has the tomb, and one agent's n_ctx of cells for it to fill. A request
        pool has the size it was given."""
        if self.fixed is not None:
            return self.fixed.cells, min(MAX_SEQS, self.fixed.seqs + self.exact)
        prefixes = {a.prefix.key for a in agents if a.prefix is not None}
        seqs = len(agents) + len(prefixes) + self.exact
        cells = sum(a.n_ctx for a in agents) + (self.exact and max((a.n_ctx for a in agents), default=0))
        return max(256, cells), max(1 + self.exact, min(MAX_SEQS, seqs))

    def open(self, agents: list) -> None:
        """Create the context for `agents` (every registered agent of this pool)."""
        n_ctx, n_seqs = self.size_for(agents)
        self.host.pool_freed(self.key)
        self.rebuilds += self.stale
        self.opens += 1
        self.ctx = self.host.new_context(self.loaded, n_ctx, n_seqs, self.exact)
        self.free_seqs = list(range(self.ctx.n_seq_max - 1, -1, -1))
        self.tomb = self.free_seqs.pop(0) if self.exact else None
        self.cells_free = self.ctx.n_ctx
        self.seats, self.docs, self.scrambled, self.resize = {}, {}, False, False
        self.cache.clear()
        self.tomb_cells, self.tomb_by, self.rebuild_by = 0, {}, {}

    def close(self) -> list:
        """Pause every resident agent and free the context; returns the agents paused."""
        paused = [s.agent for s in self.seats.values()]
        if self.ctx is not None:
            for seat in self.seats.values():
                self.host.pause_seat(seat.agent, self.ctx, seat)
        self.discard()
        return paused

    def discard(self) -> None:
        """Free the context without pausing anyone (the daemon stops, or the model went)."""
        if self.ctx is not None:
            self.ctx.close()
            self.host.pool_freed(self.key)
        self.ctx, self.seats, self.docs = None, {}, {}
        self.cache.clear()

    @property
    def is_open(self) -> bool:
        return self.ctx is not None

    # ---- seats ---------------------------------------------------------------------------
    def seat_of(self, agent) -> Seat | None:
        return self.seats.get(agent.key)

    def need(self, agent, whole: bool = False) -> tuple[int, int]:
        """(sequences, cells) seating `agent` takes now, its document included; whole: a
        request's cells up to its max_tokens, as if it booked them all at once."""
        p = agent.prefix
        if self.key.requests and agent.saved is None:      # a request pool seats requests
            return 1, self._first_reach(agent, whole) - self._will_fork(agent)
        if p is None or agent.saved is not None:
            return 1, agent.n_ctx
        if p.key in self.docs:
            return 1, agent.n_ctx - p.n_tokens
        return 2, agent.n_ctx

    def undersized(self, agents: list) -> bool:
        """Agents were registered since the context was made: it cannot seat them all."""
        n_ctx, n_seqs = self.size_for(agents)
        return self.fixed is None and (n_ctx > self.ctx.n_ctx or n_seqs > self.ctx.n_seq_max)

    def oversized(self, agents: list) -> bool:
        """Agents left: it holds more than one agent's n_ctx of cells beyond what the rest
        booked in the ledger (which books cells to agents only)."""
        if self.fixed is not None:
            return False
        booked = max(256, sum(a.n_ctx for a in agents))
        return self.ctx.n_ctx > booked + max((a.n_ctx for a in agents), default=0)

    @property
    def stale(self) -> bool:
        """It must be rebuilt before its next step."""
        return self.scrambled or self.resize

    def fits(self, agent) -> bool:
        seqs, cells = self.need(agent)
        return len(self.free_seqs) >= seqs and self.cells_free >= cells

    # ---- a request's reservation -----------------------------------------------------------
    def _first_reach(self, agent, whole: bool = False) -> int:
        """Positions a request's seat books when seated: its tokens so far (a preempted
        one's include what it generated) and RESERVE more, or all up to max_tokens (exact
        pools, a preempted request, or whole)."""
        if whole or self.exact or agent.preempted:
            return agent.n_ctx
        return min(agent.n_ctx, len(agent.history or agent.asked) + RESERVE)

    def reach(self, seat: Seat) -> int:
        """Positions of the seat's sequence that its booking, and the fork's, cover."""
        return self.cache.forked(seat.seq) + seat.cells

    def grow(self, seat: Seat, upto: int) -> bool:
        """Book room for the request's positions below `upto` (and RESERVE beyond, if the
        pool has it), evicting kept sequences as evict_for would; False when even that
        leaves too few free cells: someone must be preempted."""
        reach = self.reach(seat)
        if upto <= reach:
            return True
        least, most = upto - reach, min(seat.agent.n_ctx, upto + RESERVE) - reach
        if self.cells_free < least and not self._evict(seat.agent, 0, least - self.cells_free):
            return False
        take = min(most, self.cells_free)
        seat.cells += take
        self.cells_free -= take
        return True

    def seat(self, agent) -> Entry:
        """Give `agent` a sequence: its snapshot restored, its document forked, or its
        tokens left to re-read (kv_len 0). The caller checked fits()."""
        t0 = time.perf_counter()
        entry = Entry()
        seq = self.free_seqs.pop()
        try:
            if agent.saved is not None:
                agent.saved.restore(self.ctx, seq)
                kv_len, cells = len(agent.history), agent.n_ctx
                self.host.drop_saved(agent)
                entry.restored = True
            elif self.key.requests:
                kv_len = self._fork_kept(agent, seq, entry)
                cells = self._first_reach(agent) - self.cache.forked(seq)
            elif agent.prefix is not None and self._tokens_follow_document(agent):
                entry.restored = self._fork_document(agent, seq)
                entry.forked = True
                if not agent.history:
                    agent.history = list(agent.prefix.tokens)
                kv_len, cells = agent.prefix.n_tokens, agent.n_ctx - agent.prefix.n_tokens
            else:
                kv_len, cells = 0, agent.n_ctx      # cold, or paused without a snapshot: re-read
        except BaseException:
            self.cache.forks.pop(seq, None)
            self._retire(seq, 0, agent.owner)
            self.free_seqs.append(seq)
            raise
        own_from = agent.prefix.n_tokens if entry.forked and agent.prefix is not None else 0
        self.seats[agent.key] = Seat(seq, agent, kv_len, cells, own_from)
        self.cells_free -= cells
        agent.state = "active"
        entry.swap_s = time.perf_counter() - t0
        return entry

    @staticmethod
    def _tokens_follow_document(agent) -> bool:
        p = agent.prefix
        return not agent.history or agent.history[:p.n_tokens] == p.tokens

    def _fork_document(self, agent, seq: int) -> bool:
        """Share the document's cells with `seq`; load or compute the document first if
        this pool does not hold it. True when it came from the host copy."""
        p, restored = agent.prefix, False
        if p.key not in self.docs:
            doc_seq = self.free_seqs.pop()
            try:
                if p.snapshot is not None:
                    p.snapshot.restore(self.ctx, doc_seq)
                    restored = True
                else:
                    self.ctx.decode_tokens(p.tokens, 0, doc_seq, logits_last=False)
                    self.host.keep_prefix(agent, Snapshot.capture(self.ctx, doc_seq, p.tokens))
            except BaseException:
                self._retire(doc_seq, 0, agent.owner)
                self.free_seqs.append(doc_seq)
                raise
            self.docs[p.key] = (doc_seq, p.n_tokens)
            self.cells_free -= p.n_tokens
        self.ctx.seq_cp(self.docs[p.key][0], seq, 0, p.n_tokens)
        return restored

    def unseat(self, agent, pause: bool) -> None:
        """Free `agent`'s sequence; pause=True keeps its KV in host RAM first (or marks it
        to be rebuilt or re-read), pause=False drops it (RESET, UNREGISTER)."""
        seat = self.seats.pop(agent.key)
        if pause:
            self.host.pause_seat(agent, self.ctx, seat)
        self.cells_free += seat.cells - self._hand_down(seat.seq)
        self._retire(seat.seq, seat.own_from, agent.owner)
        self.ctx.seq_rm(seat.seq)
        self.free_seqs.append(seat.seq)
        if self.last is agent and not pause:
            self.last = None

    def trim(self, seat: Seat, n_keep: int) -> None:
        """Drop the sequence's cells from position n_keep on (a roll-back)."""
        if seat.kv_len > n_keep:
            self._retire(seat.seq, n_keep, seat.agent.owner)
        seat.kv_len = min(seat.kv_len, n_keep)
        held = self.ctx.seq_pos_max(seat.seq) + 1
        if held != seat.kv_len:
            raise RuntimeError(f"sequence {seat.seq} holds {held} positions after the roll-back, "
                               f"expected {seat.kv_len}")

    def drop_document(self, key: str, owner: int) -> None:
        """The last agent of `owner`'s document `key` left: free its sequence."""
        if key in self.docs and self.ctx is not None:
            seq, cells = self.docs.pop(key)
            self.cells_free += cells
            self._retire(seq, 0, owner)
            self.free_seqs.append(seq)

    # ---- the tomb (exact pools) --------------------------------------------------------------
    def _retire(self, seq: int, p0: int, owner: int) -> None:
        """Remove seq's cells from position p0 on. In an exact pool they stay occupied, by
        the tomb, while anyone else is in it: freeing them would let new tokens of another
        sequence land below its older cells (see the module's docstring)."""
        held = self.ctx.seq_pos_max(seq) + 1
        if self.exact and held > p0 and (self.seats or self.docs or self.cache.kept):
            self.ctx.seq_cp(seq, self.tomb, p0, -1)
            n = held - max(p0, 0)
            self.tomb_cells += n
            self.cells_free -= n
            self.tomb_by[owner] = self.tomb_by.get(owner, 0) + n
        self.ctx.seq_rm(seq, p0, -1)
        if self.exact and not (self.seats or self.docs or self.cache.kept):
            self.flush_tombs()          # nobody left whose order matters

    def fits_after_flush(self, agent) -> bool:
        seqs, cells = self.need(agent)
        return bool(self.tomb_cells) and len(self.free_seqs) >= seqs and self.cells_free + self.tomb_cells >= cells

    def flush_tombs(self) -> None:
        """Free the tomb's cells for new seats. The holes they leave would scramble the
        order of later tokens, so a pool with anyone left in it is rebuilt next, paid for
        by the users who filled the tomb."""
        if not self.tomb_cells:
            return
        if not (self.seats or self.docs):
            for seq in list(self.cache.kept):  # cheaper to drop than to rebuild
                self.evict(seq)
            if not self.tomb_cells:
                return
        self.ctx.seq_rm(self.tomb)
        self.cells_free += self.tomb_cells
        if self.seats or self.docs:
            self.scrambled = True
            for uid, n in self.tomb_by.items():
                self.rebuild_by[uid] = self.rebuild_by.get(uid, 0) + n
        self.tomb_cells, self.tomb_by = 0, {}
