"""Agents: registration under the ledger, their conversations, DECODE, RESET, KV swap.

Agents of one model decode together: they share one context (pool.py), a sequence each,
and the scheduler (scheduler.py) steps all their DECODEs with one llama_decode per
token. One pool is live at a time: serving an agent of another model pauses the live
pool's agents (each sequence's KV captured into a host-RAM snapshot: swap.py) and frees its
context; their conversations continue exactly where they were when they come back. An
agent too large for the shared pool that another user's agents sit in decodes in a
context of its owner's own instead of making that pool reopen larger (own.py).

Agents belong to the uid that registered them and are named within it: two users may
both have an agent `a`, and every lookup is by (uid, id) at the moment of use, so no
request can reach another user's agent or learn whether it exists. The scheduler shares
the device fairly between users by time; REGISTER, STATUS and LIST never wait for it.
What an agent books is booking.py's; per-user quotas (admission/quotas.py) cap what one user may take of the agents, the device budget
and the swap budget; a paused agent whose KV does not fit the swap budget keeps its
tokens and re-reads them when it comes back.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from ..admission import keys
from ..admission.ledger import Ledger
from ..admission.quotas import UNLIMITED, Quotas
from ..errors import ModelLoadError
from ..snapshot import tokens_hash
from . import sandbox
from .agent import (AGENT_ID, MAX_PREFIX_BYTES, Agent, ConductorError, ContextFull, DecodeResult, SharedPrefix,
                    check_context, named_source)
from .booking import Booking, compute_key_of, excess_key_of
from .modelfile import LoadableCopy, ModelSource
from .own import OwnContexts, in_background
from .policy import Policy
from .agent import Kind, key_for, pool_key
from .pool import Fixed, Pool, PoolKey
from .registry import Loaded, ModelRegistry
from .runs import Asked, Run, Stopping
from .scheduler import Scheduler
from .swap import Swap

log = logging.getLogger("lmxd")

__all__ = ["AGENT_ID", "MAX_PREFIX_BYTES", "Agent", "Conductor", "ConductorError", "ContextFull", "DecodeResult",
           "check_context", "excess_key_of", "named_source"]


class Conductor(Booking, Swap, OwnContexts):
    """Agents under the ledger: REGISTER (Booking: what each books), DECODE through the
    scheduler, RESET, UNREGISTER; paused agents' KV in host RAM (Swap) and users' own
    contexts (OwnContexts) are its parts in their own modules."""

    def __init__(self, ledger: Ledger, table: dict[str, int] | None = None, n_threads: int | None = None,
                 swap: Ledger | None = None, agent_ttl: float = 0, quotas: Quotas = UNLIMITED,
                 admin_uid: int | None = None, policy: Policy | None = None, n_batch: int = 512):
        self.ledger, self.table = ledger, table or {}
        self.swap = swap or Ledger(lambda: 1 << 62, name="SWAP")   # host RAM for paused KV
        self.agent_ttl, self.quotas = agent_ttl, quotas
        self.admin = os.getuid() if admin_uid is None else admin_uid   # not held to the quotas
        self.registry = ModelRegistry()
        self.agents: dict[tuple[int, str], Agent] = {}
        self._pending: set[tuple[int, str]] = set()   # (owner, id) being registered right now
        self._lock = threading.Lock()
        self._uid_gates: dict[int, threading.Lock] = {}
        self.scheduler = Scheduler(self, policy)
        self.n_threads = n_threads
        self.n_batch = n_batch          # the most tokens one step of a pool carries
        self.prefixes: dict[str, SharedPrefix] = {}
        self.request_pools: dict[PoolKey, Fixed] = {}   # requests.py's pools, by key
        self._computes: dict[PoolKey, int] = {}         # agents admitted per pool: its compute buffer's refs
        self._building: set[PoolKey] = set()            # users' own contexts being made (own_context)
        self._unmade: set[PoolKey] = set()              # ... whose making failed: that user reopens the shared pool from now on

    # ---- REGISTER / UNREGISTER ------------------------------------------------------------
    def register(self, agent_id: str, model: str | ModelSource, n_ctx: int = 2048, owner: int | None = None,
                 prefix: str | None = None, kind: Kind = Kind.CONVERSATION, exact: bool = False) -> Agent:
        """estimate → reserve → load → slot; any failure after the reservation undoes it.
        model: a short name or a path the daemon may open (the operator's), or a
        ModelSource the server built. prefix: a document the agent starts from, shared
        with every agent of the same owner and model over the same text (its KV is
        computed once, at the first DECODE that needs it). kind RESERVATION (requests.py):
        an agent that books a request pool, named so that no client can name it."""
        owner = self.admin if owner is None else owner
        if kind is Kind.CONVERSATION and not AGENT_ID.match(agent_id):
            raise ConductorError("BAD_REQUEST", "agent_id must be 1-64 of [A-Za-z0-9_.:-]")
        if not 256 <= n_ctx <= 1 << 20:
            raise ConductorError("BAD_REQUEST", f"n_ctx must be in 256..1048576, got {n_ctx}")
        ident = (owner, agent_id)
        with self._lock:
            if ident in self.agents or ident in self._pending:
                raise ConductorError("DUPLICATE_AGENT", f"agent {agent_id} is already registered")
            mine = sum(1 for o, _ in list(self.agents) + list(self._pending) if o == owner)
            if owner != self.admin and mine >= self.quotas.agents:
                raise ConductorError("QUOTA", f"uid {owner} has {mine} agents; the limit per user is "
                                     f"{self.quotas.agents} (--max-agents-per-uid)")
            self._pending.add(ident)
            gate = self._uid_gates.setdefault(owner, threading.Lock())
        try:
            with gate:   # one admission per user at a time: its share is checked against settled bookings
                agent = self._register(agent_id, model, n_ctx, owner, kind, exact, prefix is not None)
            if prefix is not None:
                try:
                    self._attach_prefix(agent, prefix)
                except BaseException:
                    self.unregister(agent_id, owner)
                    raise
            return agent
        finally:
            with self._lock:
                self._pending.discard(ident)

    def _register(self, agent_id: str, model: str | ModelSource, n_ctx: int, owner: int, kind: Kind,
                  exact: bool, with_prefix: bool = False) -> Agent:
        source = model if isinstance(model, ModelSource) else named_source(model)
        try:
            with source.open() as (mf, sent), LoadableCopy(mf, sent) as fd:
                facts = None if source.trusted else sandbox.check(mf, fd, owner)
                est = self._estimate(source.name, mf, fd, n_ctx, facts)
                pool = key_for(mf.key, exact, with_prefix, kind)
                with self.registry.gate(mf.key):
                    loaded, measured = self._admit(agent_id, owner, mf, fd, est, n_ctx, sent, pool)
        except ModelLoadError as exc:
            raise ConductorError("MODEL_LOAD_FAILED", str(exc)) from None
        agent = Agent(agent_id, source.name, mf.path, n_ctx, loaded, est, mf, owner=owner,
                      measured_bytes=measured, kind=kind, exact=exact, booked_pool=pool)
        if kind is Kind.CONVERSATION:     # about to DECODE: it shares the device from now (a
            self.scheduler.policy.seen(owner)   # reservation never decodes: it shares nothing)
        with self._lock:
            self.agents[(owner, agent_id)] = agent
        return agent

    def _attach_prefix(self, agent: Agent, text: str) -> None:
        tokens = [int(t) for t in agent.loaded.model.tokenize(text)]
        if not tokens or len(tokens) + 16 > agent.n_ctx:
            raise ConductorError("BAD_PREFIX", f"the prefix document is {len(tokens)} tokens; "
                                 f"n_ctx={agent.n_ctx} leaves no room after it")
        key = f"{agent.owner}:{agent.file.key}:{tokens_hash(tokens)}"
        with self._lock:
            shared = self.prefixes.setdefault(key, SharedPrefix(key, agent.owner, tokens))
            shared.agents.add(agent.key)
            agent.prefix = shared

    def _release_prefix(self, agent: Agent) -> None:
        shared = agent.prefix
        if shared is None:
            return
        with self._lock:
            shared.agents.discard(agent.key)
            last = not shared.agents and self.prefixes.get(shared.key) is shared
            if last:
                del self.prefixes[shared.key]
        if last:
            self.swap.release(keys.prefix(shared.owner, shared.key))
            for pool in self.scheduler.pools.values():
                pool.drop_document(shared.key, shared.owner)

    def unregister(self, agent_id: str, owner: int | None = None) -> Agent:
        """Waits for the agent's DECODEs in flight, then frees what it holds."""
        owner = self.admin if owner is None else owner
        agent = self._usable(agent_id, owner)
        self._leave(agent)
        return agent

    def _leave(self, agent: Agent) -> None:
        owner, agent_id = agent.owner, agent.id

        def leave() -> None:
            with self._lock:
                if self.agents.get((owner, agent_id)) is not agent:
                    raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
                del self.agents[(owner, agent_id)]
            self._unseat(agent)
            self._leave_pools(agent)
            key = pool_key(agent)
            left, pool = self.agents_of(key), self.scheduler.pools.get(key)
            if not agent.alone:
                self.scheduler.shrink(key, left, agent.owner)
            elif not left:                # the owner's last agent in its own context: it goes
                self.ledger.release(compute_key_of(key))
                return self.scheduler.detach(key)
            elif pool is not None and pool.oversized(left):
                self._build_own(key, left[0])      # smaller, made apart as it was
            return None
        own = self.scheduler.call(leave, agent)
        if own is not None:        # (freeing a large context takes a while: not on the scheduler's thread)
            in_background(own.discard, f"lmxd-free-{own.key.alone}")
        self._free(agent)

    def _leave_pools(self, agent: Agent) -> None:
        """What an agent that left the table holds in the pools: its saved KV, its share of
        a document (on the scheduler's thread, which owns the pools)."""
        self.drop_saved(agent)
        self._release_prefix(agent)

    def expire_idle(self) -> list[str]:
        """Unregister agents unused for agent_ttl seconds (0: never); returns their ids."""
        if not self.agent_ttl:
            return []
        cutoff = time.monotonic() - self.agent_ttl
        with self._lock:
            stale = [a for a in self.agents.values() if a.last_used < cutoff and a.kind is Kind.CONVERSATION]
        expired = []
        for agent in stale:
            try:
                self.unregister(agent.id, agent.owner)
                expired.append(agent.id)
            except ConductorError:
                pass  # unregistered meanwhile
        return expired

    def get(self, agent_id: str, owner: int | None = None) -> Agent:
        """`owner`'s agent `agent_id`; another user's agent of that name is not there."""
        with self._lock:
            agent = self.agents.get((self.admin if owner is None else owner, agent_id))
        if agent is None:
            raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
        return agent

    def _usable(self, agent_id: str, owner: int | None) -> Agent:
        """get(), refusing an agent that books a request pool: it leaves when that pool
        closes, not by a DECODE, RESET or UNREGISTER on the socket."""
        agent = self.get(agent_id, owner)
        if agent.kind is Kind.RESERVATION:
            raise ConductorError("BAD_REQUEST", f"agent {agent_id} books a request pool; "
                                 "it leaves when that pool closes")
        return agent

    def owned_by(self, uid: int | None) -> list[Agent]:
        """uid's agents, or every agent (None)."""
        with self._lock:
            return [a for a in self.agents.values() if uid is None or a.owner == uid]

    # ---- DECODE / RESET ---------------------------------------------------------------------
    def decode(self, agent_id: str, max_tokens: int, prompt: str, should_stop=None,
               owner: int | None = None) -> DecodeResult:
        """Continue the agent's conversation by up to max_tokens tokens, in the batch of its
        model's pool. Cancelled (should_stop) or failed, it leaves the conversation exactly
        as it was before this DECODE, however far it had gone."""
        owner = self.admin if owner is None else owner
        if not 1 <= max_tokens <= 4096:
            raise ConductorError("BAD_REQUEST", f"max_tokens must be in 1..4096, got {max_tokens}")
        agent = self._usable(agent_id, owner)   # the owner's agent, looked up now
        agent.last_used, agent.decoded = time.monotonic(), True
        run = Run(agent, owner, Asked(prompt, max_tokens, should_stop or (lambda: False)))
        t0 = time.perf_counter_ns()
        try:
            self.scheduler.submit(run)
        except Stopping:
            run.error = Stopping()
        if isinstance(run.error, Stopping):
            raise ConductorError("CANCELLED", "the daemon is stopping; this request was not run") from None
        if run.error is not None:
            raise run.error
        return self._result(run, agent_id, (time.perf_counter_ns() - t0) / 1e6)

    def _result(self, run: Run, agent_id: str, elapsed_ms: float) -> DecodeResult:
        evicted = self._evicted_for(run.agent, run.figures.evicted)
        if run.cancelled:
            return DecodeResult(agent_id, run.prompt_tokens, 0, False, 0.0, evicted, run.figures.restored, "",
                                cancelled=True)
        model = run.agent.loaded.model
        text = b"".join(model.token_bytes(t) for t in run.generated).decode("utf-8", "replace")
        return DecodeResult(agent_id, run.prompt_tokens, len(run.generated), run.stopped_on_eog, elapsed_ms,
                            evicted, run.figures.restored, text, queued_ms=run.figures.queued_s * 1e3,
                            swap_ms=run.figures.swap_s * 1e3, slices=run.figures.slices, batch=run.figures.batch_max,
                            forked=run.figures.forked)

    def _evicted_for(self, agent: Agent, evicted: Agent | None) -> str | None:
        """The agent swapped out, as the requester may see it: another user's agent is
        only 'another-user', never its id."""
        if evicted is None:
            return None
        return evicted.id if evicted.owner == agent.owner or agent.owner == self.admin else "another-user"

    # ---- what the scheduler asks of the conductor (on its thread) -------------------------
    def begin(self, run: Run) -> None:
        """The DECODE's first step: its prompt as tokens after the agent's conversation
        (the pending token first), checked against the agent's n_ctx. A request's tokens
        come after what its seat forked (kvcache/device.py); it was checked when submitted."""
        agent = run.agent
        if agent.kind is Kind.REQUEST:
            run.figures.cached = len(agent.history)
            run.prompt_tokens, run.feed = len(agent.asked), agent.asked[len(agent.history):]
            run.n_history, run.pending, run.began = len(agent.history), None, True
            return
        new = agent.loaded.model.tokenize(run.asked.prompt, add_special=not agent.history and agent.pending is None)
        tokens = ([agent.pending] if agent.pending is not None else []) + [int(t) for t in new]
        if not tokens:
            raise ConductorError("BAD_REQUEST", "the prompt is empty")
        check_context(agent.n_ctx, len(agent.history), len(tokens), run.asked.max_tokens, f"agent {agent.id}",
                      "RESET it or register with a larger n_ctx")
        run.prompt_tokens, run.feed = len(new), tokens
        run.n_history, run.pending = len(agent.history), agent.pending
        agent.pending, run.began = None, True

    def finished(self, run: Run) -> None:
        """A DECODE has ended (the scheduler's thread). Conversations keep their seats; a
        request leaves its cells in the pool as cache (kvcache/device.py)."""
        if run.agent.kind is not Kind.REQUEST:
            return
        pool = self.scheduler.pools.get(run.pool_key)
        if pool is not None and pool.is_open:
            pool.keep(run.agent)
        self.drop_saved(run.agent)

    def agents_of(self, key: PoolKey, sizing_for: set[int] | None = None) -> list[Agent]:
        """The registered agents a pool serves: one model, exact (prefix) or not. With
        `sizing_for` (the users a pool (re)opens for), only the agents that have DECODEd
        and every agent of those users: a pool is never sized for another user's agents
        that were only registered, so a REGISTER of a huge n_ctx costs only its owner."""
        with self._lock:
            return [a for a in self.agents.values() if pool_key(a) == key and a.kind is Kind.CONVERSATION
                    and (sizing_for is None or a.decoded or a.owner in sizing_for)]

    def open_pool(self, key: PoolKey, loaded: Loaded) -> Pool:
        """Conversations' pools are sized for their agents; a request pool has the size its
        reservation booked and keeps finished requests' cells."""
        with self._lock:
            fixed = self.request_pools.get(key) if key.requests else None
        return Pool(key, loaded, self, fixed=fixed)

    # ---- request pools (requests.py) ---------------------------------------------------------
    def add_request_pool(self, reservation: Agent, fixed: Fixed) -> PoolKey:
        """Settle the pool that `reservation` booked: its requests decode with these
        settings. A second pool of the same key would be the same Pool: refused, and the
        reservation freed."""
        key = pool_key(reservation)
        with self._lock:
            duplicate = key in self.request_pools
            if not duplicate:
                self.request_pools[key] = fixed
        if duplicate:
            self._leave(reservation)
            raise ConductorError("DUPLICATE_POOL", f"{reservation.model_name} already has "
                                 f"{'an exact' if key.exact else 'a fast'} request pool on this conductor")
        return key

    def close_request_pool(self, reservation: Agent) -> None:
        """Free a request pool's context and cells, then its reservation (its requests have
        ended: the caller waited for them)."""
        key, sched = pool_key(reservation), self.scheduler
        sched.call(lambda: sched.drop([key] if key in sched.pools else []))
        with self._lock:
            self.request_pools.pop(key, None)
        self._leave(reservation)

    def reset(self, agent_id: str, owner: int | None = None) -> None:
        """Clear the agent's conversation (a prefix agent goes back to its document), once
        its DECODEs in flight have ended."""
        owner = self.admin if owner is None else owner
        agent = self._usable(agent_id, owner)

        def clear() -> None:
            if self.agents.get((owner, agent_id)) is not agent:
                raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
            agent.last_used = time.monotonic()
            self._unseat(agent)
            self.forget_conversation(agent)
        self.scheduler.call(clear, agent)

    def shutdown(self, grace_s: float) -> None:
        """Stop: queued DECODEs are CANCELLED now, the running ones within grace_s (rolled
        back like a disconnect)."""
        self.scheduler.close(grace_s)

    def close(self) -> None:
        """Free everything (after shutdown, or in-process use)."""
        def close_pools() -> None:
            for pool in self.scheduler.pools.values():
                pool.discard()
            self.scheduler.live = None
        self.scheduler.call(close_pools)
        self.scheduler.stop()
        with self._lock:
            agents = list(self.agents.values())
            self.agents.clear()
        for agent in agents:
            self._leave_pools(agent)
            self._free(agent, forget=False)
