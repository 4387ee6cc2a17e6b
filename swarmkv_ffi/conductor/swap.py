"""Paused agents' KV in host RAM: a leaving agent's sequence captured into a snapshot,
booked to its owner's swap share (or, with the share full, only its tokens kept, to be
re-read); a document's KV kept once; what a roll-back or a RESET does to it.

`Swap` is a part of the Conductor (agents.py holds the state it reads: swap, quotas,
scheduler).
"""
from __future__ import annotations

from ..admission import keys
from ..admission.ledger import LedgerDenied
from ..context import Context
from ..kvcache.thresholds import REPLAY_MAX
from ..snapshot import Snapshot
from .agent import Agent, ConductorError
from .agent import pool_key
from .pool import Seat


class Swap:
    """The Conductor's host-RAM copies of agents' KV."""

    def keep_prefix(self, agent: Agent, snap: Snapshot) -> None:
        """The document's KV, computed once, kept in host RAM for every agent over it
        (booked once to the swap budget, to the first agent's owner). With the owner's
        share full it is not kept: the document stays in the pool, and is computed again
        should the pool lose it (a full swap share slows its owner, never refuses it)."""
        p = agent.prefix
        try:
            self.swap.reserve(keys.prefix(agent.owner, p.key), snap.nbytes,
                              cap=self._cap(self.swap, self.quotas.swap_share, agent.owner))
        except LedgerDenied:
            return
        p.snapshot = snap

    def pause_seat(self, agent: Agent, ctx: Context, seat: Seat) -> None:
        """Keep a leaving agent's KV in host RAM, booked to its owner's swap share. A prefix
        agent that can be rebuilt from its document needs none; if the share (or the
        whole budget) is full, the agent keeps only its tokens and its next DECODE
        re-reads them: a full swap budget slows its owner's agents down, and never
        refuses anyone's DECODE (one user's hoard cannot block another's)."""
        complete = seat.kv_len == len(agent.history)
        if agent.history and complete and not self._replayable(agent):
            key = keys.swap(agent.owner, agent.id)
            try:
                self.swap.reserve(key, max(1, ctx.seq_state_size(seat.seq)),
                                  cap=self._cap(self.swap, self.quotas.swap_share, agent.owner))
            except LedgerDenied:
                pass              # it keeps its tokens: its next seat re-reads them
            else:
                try:
                    agent.saved = Snapshot.capture(ctx, seat.seq, agent.history)
                except BaseException:
                    self.swap.release(key)
                    raise
        agent.state = "suspended" if agent.history else "cold"

    def _replayable(self, agent: Agent) -> bool:
        """A prefix agent whose KV can be rebuilt from the shared document plus a
        re-read of at most REPLAY_MAX tokens of its own: it needs no snapshot."""
        p = agent.prefix
        return (p is not None and p.snapshot is not None and agent.history[:p.n_tokens] == p.tokens
                and len(agent.history) - p.n_tokens <= REPLAY_MAX)

    def drop_saved(self, agent: Agent) -> None:
        agent.saved = None
        self.swap.release(keys.swap(agent.owner, agent.id))

    def rewind_paused(self, agent: Agent) -> None:
        """A DECODE was undone while its agent was paused: a snapshot taken mid-DECODE
        holds too much, so the agent keeps its tokens and re-reads them."""
        self.drop_saved(agent)
        agent.state = "suspended" if agent.history else "cold"

    def forget_conversation(self, agent: Agent) -> None:
        agent.history, agent.pending, agent.state = [], None, "cold"
        self.drop_saved(agent)

    @staticmethod
    def reset_error(agent: Agent, exc: Exception) -> ConductorError:
        return ConductorError("INTERNAL", f"agent {agent.id}: rolling back failed ({exc}), so its "
                              "conversation was reset")

    def _unseat(self, agent: Agent) -> None:
        """Drop the agent's sequence from its pool, if it has one there (no snapshot): the
        live pool or one that stays open beside it."""
        pool = self.scheduler.pools.get(pool_key(agent))
        if pool is not None and pool.is_open and pool.seat_of(agent) is not None:
            pool.unseat(agent, pause=False)
