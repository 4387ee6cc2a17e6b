"""What the Conductor books in the ledger for an agent: its KV cells, its model's
weights once, a compute buffer per pool (shared, or its owner's for an own context),
and a pool's cells beyond its agents' bookings; all measured from what libllama
allocates, within the budget and the owner's share (admission/).

`Booking` is a part of the Conductor (agents.py holds the state it reads: ledger,
registry, agents, quotas).
"""
from __future__ import annotations

from ..admission import keys
from ..admission.keys import Key
from ..admission.ledger import Ledger, LedgerDenied
from ..context import Context
from .estimate import Estimate, estimate
from .modelfile import ModelFile, check_unchanged, fd_path
from .pool import Pool, PoolKey
from .registry import Loaded
from .agent import Agent, ConductorError


def _mode(pool: PoolKey) -> str:
    return "exact" if pool.exact else "fast"


def compute_key_of(pool: PoolKey) -> Key:
    """The ledger key of a pool's compute buffer: shared (no user is charged it), but a
    user's own context's, charged to that user."""
    if pool.alone:
        return Key("compute", int(pool.alone), f"{pool.model}:{_mode(pool)}:alone")
    return Key("compute", None, f"{pool.model}:{_mode(pool)}:{'requests' if pool.requests else 'agents'}")


def excess_key_of(pool: PoolKey) -> Key:
    """The ledger key of a pool's cells beyond its agents' bookings (Conductor.book_excess):
    shared, as the pool is."""
    return Key("excess", None, f"{pool.model}:{_mode(pool)}:{pool.alone or 'shared'}")


class Booking:
    """The Conductor's bookings."""

    def _cap(self, ledger: Ledger, share: float, owner: int) -> int | None:
        return None if owner == self.admin else int(ledger.limit() * share)

    def _weights_used_by(self, owner: int, also: str | None = None) -> int:
        """The weights of every loaded model `owner`'s agents use (plus `also`): each user's
        share is charged the full weights it relies on, shared or not."""
        with self._lock:
            keys = {a.file.key for a in self.agents.values() if a.owner == owner}
        if also:
            keys.add(also)
        return sum(e.measured_bytes for k in keys if (e := self.registry.loaded(k)) is not None)

    def _admit(self, agent_id: str, owner: int, mf: ModelFile, fd: int, est: Estimate,
               n_ctx: int, sent: int, pool: PoolKey) -> tuple[Loaded, int]:
        """reserve → load → measure → book what was measured, all within the budget and
        the owner's share; any failure undoes every step. The caller holds the model's
        gate, so whether its weights (and the compute buffer of the pool it decodes in,
        `pool`) are already booked cannot change under us. fd: what libllama loads; sent:
        the file as opened (checked unchanged)."""
        ref = f"{owner}:{agent_id}"              # the agent's reference to the model (registry.py)
        model_key, agent_key, compute_key = keys.model(mf.key), keys.agent(owner, agent_id), compute_key_of(pool)
        shared = self.registry.loaded(mf.key) is not None
        cap = self._cap(self.ledger, self.quotas.ledger_share, owner)
        # This agent's KV + compute, plus the weights unless another agent holds them. A
        # --vram-table figure has no split: a second agent reserves all of it again.
        self.ledger.reserve(agent_key, est.agent_bytes if shared and est.agent_bytes else est.total,
                            cap=cap, base=self._weights_used_by(owner, mf.key))
        try:
            check_unchanged(mf, sent)
            loaded, newly = self.registry.acquire(mf.key, fd_path(fd), ref, name=str(mf.path))
        except BaseException:
            self.ledger.release(agent_key)
            raise
        try:
            try:
                measured, compute = self._measure_context(loaded, n_ctx)
            except Exception as exc:
                raise ConductorError("MODEL_LOAD_FAILED", f"context for n_ctx={n_ctx} failed: {exc}") from None
            # Replace the estimate with what libllama allocated: the agent's KV cells to
            # the agent; the weights to the model, once, until its last agent leaves; a
            # compute buffer to each pool of the model (its one context, whatever its
            # number of agents), once, until the pool's last agent leaves: every pool may
            # stay open beside the others, as booked.
            bookings = {agent_key: measured}
            if newly:
                bookings[model_key] = loaded.measured_bytes
            if not self._computes.get(pool):
                bookings[compute_key] = compute
            self.ledger.settle(bookings, cap=cap, base=self._weights_used_by(owner, mf.key))
            self._computes[pool] = self._computes.get(pool, 0) + 1
        except BaseException:
            last = self.registry.release(mf.key, ref)
            if last is not None:
                last.model.close()       # loaded for this agent alone: no pool holds a context over it
            self.ledger.release(agent_key)
            raise
        return loaded, measured

    def _estimate(self, name: str, mf: ModelFile, fd: int, n_ctx: int, facts: dict | None) -> Estimate:
        override = self.table.get(name) or self.table.get(str(mf.path))
        if override:
            return Estimate(weights=override, kv=0, compute=0, source="table")
        return estimate(mf, fd, n_ctx, facts)

    def _measure_context(self, loaded: Loaded, n_ctx: int) -> tuple[int, int]:
        """(the KV bytes of the agent's n_ctx cells, a pool's compute buffer bytes), as
        libllama allocates them for a context of this model (patch 0004): what a context
        holds, never the process's growth, which any other user's work inflates. Measured
        once per loaded model on a 512-cell context (n_ubatch cells, as every pool has,
        so its compute buffer is a pool's) and scaled to the agent's cells: a REGISTER of
        a huge n_ctx allocates nothing (the caller holds the model's gate)."""
        if loaded.context_bytes is None:
            ctx = self.new_context(loaded, 512)
            try:
                loaded.context_bytes = (ctx.n_ctx, *ctx.memory_bytes())
            finally:
                ctx.close()
        cells, kv, compute = loaded.context_bytes
        return max(1, -(-kv * n_ctx // cells)), compute

    def new_context(self, loaded: Loaded, n_ctx: int, n_seqs: int = 1, exact: bool = False) -> Context:
        kw = {"n_threads": self.n_threads} if self.n_threads else {}
        # swa_full: a sliding-window model (Gemma 3) keeps every cell, so rolling a
        # conversation back after a cancel or a failure restores exactly what was there.
        # exact (prefix agents): batch-invariant kernels, so an agent's tokens are the same
        # batched with others as alone, and re-reading its tokens in one batch rebuilds the
        # very KV bytes they had when decoded one by one. kv_unified: the pool's agents
        # share one cell buffer, so a document's cells can be shared by seq_cp.
        # n_ubatch stays at most 512, as every estimate measured it (estimate_bytes).
        n_batch = min(self.n_batch, n_ctx)
        return Context(loaded.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512), n_seq_max=n_seqs,
                       kv_unified=n_seqs > 1, flash_attn="on", swa_full=True, batch_invariant=exact, **kw)

    def _free(self, agent: Agent, forget: bool = True) -> None:
        """Release its bookings and its reference to the model; the last reference frees
        the model, after its pools (forget=False: they are gone already). On the caller's
        thread, never the scheduler's: the model's gate may be held for seconds by a
        REGISTER measuring a context, and no user's DECODE may wait for that."""
        self.ledger.release(keys.agent(agent.owner, agent.id))
        with self.registry.gate(agent.file.key):
            pool = agent.booked_pool
            if pool is not None:
                self._computes[pool] -= 1
                if not self._computes[pool]:
                    del self._computes[pool]
                    self.ledger.release(compute_key_of(pool))
            last = self.registry.release(agent.file.key, agent.key)
            if last is not None:
                self.ledger.release(keys.model(agent.file.key))
        if last is not None:
            if forget:
                self.scheduler.call(lambda: self.scheduler.forget_model(last))
            last.model.close()

    def book_excess(self, pool: Pool, agents: list[Agent]) -> bool:
        """(On the scheduler's thread.) Book the cells of `pool` beyond its agents' own
        bookings as the pool's (shared, as its compute buffer is), until its context goes:
        True, or False when the ledger has no room for them (the pool must shrink now)."""
        cells, kv, _ = pool.loaded.context_bytes
        extra = pool.ctx.n_ctx - sum(a.n_ctx for a in agents)
        try:
            self.ledger.settle({excess_key_of(pool.key): max(1, -(-kv * extra // cells))})
        except LedgerDenied:
            return False
        return True

    def pool_freed(self, key: PoolKey) -> None:
        """A pool's context went: the cells booked beyond its agents' go with it."""
        self.ledger.release(excess_key_of(key))
