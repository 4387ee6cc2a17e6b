"""A request pool's cells: a request forks the longest opening the pool holds (kept
cells of finished requests, or a running request's) or recalls it from the tiers below;
a finished request leaves its cells as a kept sequence; room is made by evicting kept
sequences, only as far as a request falls short. The tree of who forked what is
kvcache/device.py's KeptCells; this module is the pool's side of it (its free cells and
sequences, its context's seq_cp).

`RequestCells` is a part of the Pool (pool.py holds the state it reads: ctx, seats,
cache, store, cells_free, free_seqs).
"""
from __future__ import annotations

from ..kvcache.prefix import longest_common_prefix
from ..kvcache.thresholds import KEEP_MIN


class RequestCells:
    """The Pool's kept cells: the server's radix cache (kvcache/device.py)."""

    def _running(self, agent):
        """(owner, tokens held, seq) of the seated sequences other than `agent`'s."""
        return [(s.agent.owner, s.agent.history[:s.kv_len], s.seq) for s in self.seats.values() if s.agent is not agent]

    def match(self, agent) -> tuple[int, int | None]:
        """The longest prefix of the request's tokens (agent.asked, or a preempted one's
        history) this pool holds cells for that it may fork, and the sequence holding it."""
        return self.cache.match(agent.history or agent.asked, agent.owner, self._running(agent))

    def coming(self, agent) -> int:
        """The longest prefix of agent.asked that a running request of its owner (or of
        anyone, when shared) is about to decode but has not yet: worth waiting for."""
        best = 0
        for seat in self.seats.values():
            other = seat.agent
            if other is agent or not self.cache.may_fork(other.owner, agent.owner):
                continue
            n = min(longest_common_prefix(other.asked, agent.asked), len(agent.asked) - 1)
            if n > seat.kv_len:
                best = max(best, n)
        return best

    def _will_fork(self, agent) -> int:
        """The tokens seat() will fork for request `agent`, whose cells it will not book:
        none where it would restore from the store instead (restored cells are its own)."""
        n, _ = self.match(agent)
        return 0 if self.store is not None and n < self.store.min_tokens else n

    def _fork_kept(self, agent, seq: int, entry) -> int:
        """Fork the longest prefix of agent.asked the pool holds into `seq`; or, when that
        is short, restore a longer one from the store (kvcache.tier.PrefixTier). A long prefix
        forked from another request is one requests share: it goes to the store."""
        n, src = self.match(agent)
        wanted = agent.history or agent.asked
        if self.store is not None and n < self.store.min_tokens:
            got, tier = self._recall(agent, wanted, seq, n)
            if got:
                agent.history = agent.history or list(agent.asked[:got])
                entry.restored, entry.tier = True, tier
                return got
        if n:
            self.ctx.seq_cp(src, seq, 0, n)
            self.cache.fork(seq, src, n)
            agent.history = agent.history or list(agent.asked[:n])
            entry.forked, entry.tier = True, "pool"
            if self.store is not None:
                self.store.remember(agent.owner, agent.asked, self.ctx, seq, n)
        return n

    def _recall(self, agent, wanted: list[int], seq: int, n: int) -> tuple[int, str | None]:
        """Restore the longest opening of `wanted` a tier below holds into `seq` (its cells
        beyond that opening trimmed): how many tokens it holds and the tier, or (0, None).
        The restore may take the cells free beyond the request's own booking for the moment."""
        spare = self.cells_free - self._first_reach(agent)
        got, tier = self.store.recall(agent.owner, wanted, self.ctx, seq, more_than=n,
                                      spare=spare, prefill_s=self.prefill_row_s())
        if got and self.ctx.seq_pos_max(seq) + 1 > got:
            self._retire(seq, got, agent.owner)
        if got:
            self.store.remember(agent.owner, wanted, self.ctx, seq, got)   # an opening used twice
        return got, tier

    def keep(self, agent) -> None:
        """A finished request leaves its seat: its cells stay as a kept sequence (the
        unused rest of its n_ctx goes back to the pool), unless it is too short to keep."""
        seat = self.seats.get(agent.key)
        if seat is None:
            return
        if seat.kv_len < KEEP_MIN:
            self.unseat(agent, pause=False)
            return
        del self.seats[agent.key]
        if self.last is agent:
            self.last = None
        unused = self.reach(seat) - seat.kv_len    # booked for tokens it did not generate
        self.cells_free += unused
        self.cache.keep(seat.seq, agent.owner, agent.history[:seat.kv_len], seat.cells - unused)

    def evict(self, seq: int) -> None:
        """Drop a kept sequence; the store below keeps its KV if the cells it frees hold
        more than the prefix it forked from a sequence that stays (kvcache.tier.PrefixTier)."""
        kept = self.cache.kept[seq]
        if self.store is not None and self.cache.frees_prefix(seq, self.store.min_tokens):
            self.store.evicted(kept.owner, kept.tokens, self.ctx, seq)
        self.cache.drop(seq)
        self.cells_free += kept.cells - self._hand_down(seq)
        self._retire(seq, 0, kept.owner)
        self.free_seqs.append(seq)

    def shared(self, seq: int) -> int:
        return self.cache.shared(seq)

    def _hand_down(self, seq: int) -> int:
        """`seq` is going: its heir books the cells others forked from it (KeptCells);
        a seated heir's seat grows here. Returns the cells the heir took over, which
        leaving frees none of."""
        heir, took = self.cache.hand_down(seq)
        if heir is not None and heir not in self.cache.kept:
            next(s for s in self.seats.values() if s.seq == heir).cells += took
        return took

    def evict_for(self, agent) -> bool:
        """Make room for `agent` by dropping kept sequences, or drop none: only as many as
        its shortfall takes, never the one it is about to fork, its owner's own first
        (least recently used first), then others' only while their owner keeps more cells
        than its fair share of the pool. True when it fits."""
        seqs, cells = self.need(agent)
        return self._evict(agent, seqs - len(self.free_seqs), cells - self.cells_free) and self.fits(agent)

    def _evict(self, agent, short_seqs: int, short_cells: int) -> bool:
        """Drop kept sequences `agent` may evict until the shortfall is made up, or none."""
        chosen = []
        for seq in self._evictable(agent):
            if short_seqs <= 0 and short_cells <= 0:
                break
            chosen.append(seq)
            short_seqs, short_cells = short_seqs - 1, short_cells - self.cache.frees(seq)
        if short_seqs > 0 or short_cells > 0:
            return False            # it would not fit anyway: nothing is lost while it waits
        for seq in chosen:
            self.evict(seq)
        return True

    def could_hold(self, agent) -> bool:
        """Whether the request could run to its max_tokens here with nothing else running:
        its whole booking within the free cells, the tomb's, and the kept cells it may
        evict (pool.py's fair share)."""
        seqs, cells = self.need(agent, whole=True)
        evictable = sum(self.cache.frees(seq) for seq in self._evictable(agent))
        return len(self.free_seqs) + len(self.cache.kept) >= seqs and \
            self.cells_free + self.tomb_cells + evictable >= cells

    def _evictable(self, agent):
        """The kept sequences `agent` may evict, in the order it should (KeptCells.evictable)."""
        running = {s.agent.owner for s in self.seats.values()}
        return self.cache.evictable(agent.owner, self.match(agent)[1], running, self.ctx.n_ctx)

    def no_room(self, agent) -> str:
        """Why `agent` cannot be seated while nothing runs here, in numbers."""
        seqs, cells = self.need(agent, whole=True)
        return (f"the request needs {cells} KV cells and {seqs} sequence(s); the pool has {self.ctx.n_ctx} "
                f"cells, {self.cells_free} free and {len(self.free_seqs)} sequences free, and other keys keep "
                f"{self.cache.kept_by_others(agent.owner)} cells of cached prefixes, within their fair share "
                f"({self.cache.fair_share(agent.owner, set(), self.ctx.n_ctx)} cells each), which are not "
                "evicted for it: ask for fewer tokens (max_tokens), or retry later")
