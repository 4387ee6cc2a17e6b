"""Agents: registration under the ledger, their conversations, DECODE, RESET, KV swap.

Agents of one model decode together: they share one context (pool.py), a sequence each,
and the scheduler (scheduler.py) steps all their DECODEs with one llama_decode per
token. One pool is live at a time: serving an agent of another model pauses the live
pool's agents (each sequence's KV captured into a host-RAM snapshot) and frees its
context; their conversations continue exactly where they were when they come back. An
agent too large for the shared pool that another user's agents sit in decodes in a
context of its owner's own instead of making that pool reopen larger (own_context).

Agents belong to the uid that registered them and are named within it: two users may
both have an agent `a`, and every lookup is by (uid, id) at the moment of use, so no
request can reach another user's agent or learn whether it exists. The scheduler shares
the device fairly between users by time; REGISTER, STATUS and LIST never wait for it.
Per-user quotas (quotas.py) cap what one user may take of the agents, the device budget
and the swap budget; a paused agent whose KV does not fit the swap budget keeps its
tokens and re-reads them when it comes back.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import catalog
from ..admission.ledger import Ledger, LedgerDenied
from ..admission.quotas import UNLIMITED, Quotas
from ..context import Context
from ..errors import ModelLoadError, ModelNotFoundError, SwarmKVError
from ..kvcache.thresholds import REPLAY_MAX
from ..snapshot import Snapshot, tokens_hash
from . import sandbox
from .estimate import Estimate, estimate
from .modelfile import LoadableCopy, ModelFile, ModelSource, check_unchanged, fd_path
from .policy import Policy
from .pool import Fixed, Kind, Pool, PoolKey, Seat, key_for, pool_key
from .registry import Loaded, ModelRegistry
from .runs import Run, Stopping
from .scheduler import Scheduler

log = logging.getLogger("lmxd")

AGENT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ConductorError(SwarmKVError):
    """An error with a stable protocol code (UNKNOWN_AGENT, CONTEXT_FULL, …)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ContextFull(ConductorError):
    """A DECODE or a request that would take more cells than it may: the numbers, for each
    front to say in its own words (lmxd's line is the message)."""

    def __init__(self, message: str, limit: int, held: int, new: int, max_tokens: int):
        super().__init__("CONTEXT_FULL", message)
        self.limit, self.held, self.new, self.max_tokens = limit, held, new, max_tokens


def check_context(limit: int, held: int, new: int, max_tokens: int, who: str, advice: str) -> None:
    """The one context-length check, for conversations (Conductor.begin) and requests
    (RequestPool.submit): `held` tokens already in context, `new` ones to read and up to
    `max_tokens` to generate must fit in `limit` cells, and at least one token must be
    asked for. `who` starts the message and `advice` ends it."""
    need = held + new + max_tokens
    if need > limit or max_tokens < 1:
        raise ContextFull(f"{who}: {held} tokens in context + {new} new + max_tokens {max_tokens} = {need} > "
                          f"n_ctx {limit}; {advice}", limit, held, new, max_tokens)


MAX_PREFIX_BYTES = 8 << 20


@dataclass
class SharedPrefix:
    """A document that several agents of one model start from. Its KV is computed by the
    first agent that needs it and kept once in host RAM (booked once to the swap budget),
    for as long as one of its agents is registered."""
    key: str                              # owner:model file:tokens hash (never shared across users)
    owner: int
    tokens: list[int]
    snapshot: Snapshot | None = None
    agents: set[str] = field(default_factory=set)   # Agent.key of each

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)       # an agent is itself, not its fields: compared by identity
class Agent:
    id: str
    model_name: str
    path: Path
    n_ctx: int
    loaded: Loaded
    estimate: Estimate
    file: ModelFile                       # identity taken at REGISTER, never re-resolved
    owner: int = -1                       # uid of the client that registered it
    measured_bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)
    state: str = "cold"                   # cold | active (seated in the live pool) | suspended
    saved: Snapshot | None = None         # KV in host RAM while suspended
    history: list[int] = field(default_factory=list)   # tokens whose KV is in the state
    pending: int | None = None            # last generated token, not yet decoded
    prefix: SharedPrefix | None = None    # the document it starts from (REGISTER prefix=)
    decoded: bool = False                 # it has sent a DECODE (pools are sized for it)
    kind: Kind = Kind.CONVERSATION        # a conversation, a request, or a request pool's reservation
    asked: list[int] = field(default_factory=list)   # a request's prompt tokens (forked where the pool holds them)
    preempted: bool = False               # a request that gave its cells up: back, it books them all
    exact: bool = False                   # decodes in an exact pool without a document (a request pool's)
    booked_pool: PoolKey | None = None    # the pool whose compute buffer its admission counts on
    alone: bool = False                   # it decodes in its owner's own context (own_context)

    @property
    def key(self) -> str:
        """Unique across users: ledger keys and registry references use it."""
        return f"{self.owner}:{self.id}"

    @property
    def tokens_in_context(self) -> int:
        return len(self.history) + (self.pending is not None)


@dataclass
class DecodeResult:
    agent_id: str
    prompt_tokens: int
    generated_tokens: int
    stopped_on_eog: bool
    elapsed_ms: float
    evicted: str | None
    restored: bool
    text: str
    cancelled: bool = False
    queued_ms: float = 0.0     # waiting to join a batch (other pools' turns, a full batch)
    swap_ms: float = 0.0       # making the agent resident (pools switched, restore, fork)
    slices: int = 0            # times it joined a batch
    batch: int = 0             # the most agents decoded in one step with it
    forked: bool = False       # it shares its document's cells in the pool


def _mode(pool: PoolKey) -> str:
    return "exact" if pool.exact else "fast"


def compute_key_of(pool: PoolKey) -> str:
    """The ledger key of a pool's compute buffer: shared (no user is charged it), but a
    user's own context's, charged to that user."""
    if pool.alone:
        return f"alone:{pool.alone}:{pool.model}:{_mode(pool)}:compute"
    return f"compute:{pool.model}:{_mode(pool)}:{'requests' if pool.requests else 'agents'}"


#: The CPU priority (nice) of the threads that make and free users' own contexts: low, so
#: the decode threads win the cores, but not the lowest (19), under which a busy daemon
#: left an own context unmade for tens of seconds (#50's ladder: 8 steps in a phase).
NICE = 10


def excess_key_of(pool: PoolKey) -> str:
    """The ledger key of a pool's cells beyond its agents' bookings (Conductor.book_excess)."""
    return f"excess:{pool.model}:{_mode(pool)}:{pool.alone or 'shared'}"


def in_background(fn, name: str) -> None:
    """Run fn() on a thread of its own at a low CPU priority (NICE): making or freeing a
    user's own context (clearing or unmapping up to a gigabyte of KV) yields the cores to
    the scheduler's decode threads, so the users decoding meanwhile do not wait for it;
    its owner does."""
    def low() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)   # this thread (Linux)
        except (OSError, AttributeError):
            pass                   # elsewhere: it runs at the daemon's priority
        fn()
    threading.Thread(target=low, name=name, daemon=True).start()


def named_source(model: str) -> ModelSource:
    """A model named by a packaged short name (trusted: it skips the sandbox) or by a path
    the daemon may open itself (the operator's own, or one access.py vouched for)."""
    try:
        path = catalog.resolve(model)
    except ModelNotFoundError as exc:
        raise ConductorError("UNKNOWN_MODEL", str(exc)) from None
    return ModelSource(model, Path(os.path.realpath(path)), trusted=model in catalog.CATALOG)


class Conductor:
    def __init__(self, ledger: Ledger, table: dict[str, int] | None = None, n_threads: int | None = None,
                 swap: Ledger | None = None, agent_ttl: float = 0, quotas: Quotas = UNLIMITED,
                 admin_uid: int | None = None, policy: Policy | None = None):
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
                    loaded, measured = self._admit(f"{owner}:{agent_id}", owner, mf, fd, est, n_ctx, sent, pool)
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
            self.swap.release(f"prefix:{shared.key}")
            for pool in self.scheduler.pools.values():
                pool.drop_document(shared.key, shared.owner)

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

    def _admit(self, ref: str, owner: int, mf: ModelFile, fd: int, est: Estimate,
               n_ctx: int, sent: int, pool: PoolKey) -> tuple[Loaded, int]:
        """reserve → load → measure → book what was measured, all within the budget and
        the owner's share; any failure undoes every step. The caller holds the model's
        gate, so whether its weights (and the compute buffer of the pool it decodes in,
        `pool`) are already booked cannot change under us. fd: what libllama loads; sent:
        the file as opened (checked unchanged)."""
        model_key, agent_key, compute_key = f"model:{mf.key}", f"agent:{ref}", compute_key_of(pool)
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
            ctx = self._new_context(loaded, 512)
            try:
                loaded.context_bytes = (ctx.n_ctx, *ctx.memory_bytes())
            finally:
                ctx.close()
        cells, kv, compute = loaded.context_bytes
        return max(1, -(-kv * n_ctx // cells)), compute

    def _new_context(self, loaded: Loaded, n_ctx: int, n_seqs: int = 1, exact: bool = False) -> Context:
        kw = {"n_threads": self.n_threads} if self.n_threads else {}
        # swa_full: a sliding-window model (Gemma 3) keeps every cell, so rolling a
        # conversation back after a cancel or a failure restores exactly what was there.
        # exact (prefix agents): batch-invariant kernels, so an agent's tokens are the same
        # batched with others as alone, and re-reading its tokens in one batch rebuilds the
        # very KV bytes they had when decoded one by one. kv_unified: the pool's agents
        # share one cell buffer, so a document's cells can be shared by seq_cp.
        return Context(loaded.model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=n_seqs,
                       kv_unified=n_seqs > 1, flash_attn="on", swa_full=True, batch_invariant=exact, **kw)

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
        self._drop_saved(agent)
        self._release_prefix(agent)

    def _free(self, agent: Agent, forget: bool = True) -> None:
        """Release its bookings and its reference to the model; the last reference frees
        the model, after its pools (forget=False: they are gone already). On the caller's
        thread, never the scheduler's: the model's gate may be held for seconds by a
        REGISTER measuring a context, and no user's DECODE may wait for that."""
        self.ledger.release(f"agent:{agent.key}")
        with self.registry.gate(agent.file.key):
            pool = agent.booked_pool
            if pool is not None:
                self._computes[pool] -= 1
                if not self._computes[pool]:
                    del self._computes[pool]
                    self.ledger.release(compute_key_of(pool))
            last = self.registry.release(agent.file.key, agent.key)
            if last is not None:
                self.ledger.release(f"model:{agent.file.key}")
        if last is not None:
            if forget:
                self.scheduler.call(lambda: self.scheduler.forget_model(last))
            last.model.close()

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
        run = Run(agent, owner, prompt, max_tokens, should_stop or (lambda: False))
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
        evicted = self._evicted_for(run.agent, run.evicted)
        if run.cancelled:
            return DecodeResult(agent_id, run.prompt_tokens, 0, False, 0.0, evicted, run.restored, "",
                                cancelled=True)
        model = run.agent.loaded.model
        text = b"".join(model.token_bytes(t) for t in run.generated).decode("utf-8", "replace")
        return DecodeResult(agent_id, run.prompt_tokens, len(run.generated), run.stopped_on_eog, elapsed_ms,
                            evicted, run.restored, text, queued_ms=run.queued_s * 1e3,
                            swap_ms=run.swap_s * 1e3, slices=run.slices, batch=run.batch_max,
                            forked=run.forked)

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
            run.cached = len(agent.history)
            run.prompt_tokens, run.feed = len(agent.asked), agent.asked[len(agent.history):]
            run.n_history, run.pending, run.began = len(agent.history), None, True
            return
        new = agent.loaded.model.tokenize(run.prompt, add_special=not agent.history and agent.pending is None)
        tokens = ([agent.pending] if agent.pending is not None else []) + [int(t) for t in new]
        if not tokens:
            raise ConductorError("BAD_REQUEST", "the prompt is empty")
        check_context(agent.n_ctx, len(agent.history), len(tokens), run.max_tokens, f"agent {agent.id}",
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
        self._drop_saved(run.agent)

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
        return Pool(key, loaded, new_context=self._new_context, pause=self._pause,
                    keep_prefix=self._keep_prefix, drop_saved=self._drop_saved, fixed=fixed,
                    freed=lambda k: self.ledger.release(excess_key_of(k)))

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

    def _keep_prefix(self, agent: Agent, snap: Snapshot) -> None:
        """The document's KV, computed once, kept in host RAM for every agent over it
        (booked once to the swap budget, to the first agent's owner). With the owner's
        share full it is not kept: the document stays in the pool, and is computed again
        should the pool lose it (a full swap share slows its owner, never refuses it)."""
        p = agent.prefix
        try:
            self.swap.reserve(f"prefix:{p.key}", snap.nbytes,
                              cap=self._cap(self.swap, self.quotas.swap_share, agent.owner))
        except LedgerDenied:
            return
        p.snapshot = snap

    def _pause(self, agent: Agent, ctx: Context, seat: Seat) -> None:
        """Keep a leaving agent's KV in host RAM, booked to its owner's swap share. A prefix
        agent that can be rebuilt from its document needs none; if the share (or the
        whole budget) is full, the agent keeps only its tokens and its next DECODE
        re-reads them: a full swap budget slows its owner's agents down, and never
        refuses anyone's DECODE (one user's hoard cannot block another's)."""
        complete = seat.kv_len == len(agent.history)
        if agent.history and complete and not self._replayable(agent):
            key = f"swap:{agent.key}"
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

    def _drop_saved(self, agent: Agent) -> None:
        agent.saved = None
        self.swap.release(f"swap:{agent.key}")

    def rewind_paused(self, agent: Agent) -> None:
        """A DECODE was undone while its agent was paused: a snapshot taken mid-DECODE
        holds too much, so the agent keeps its tokens and re-reads them."""
        self._drop_saved(agent)
        agent.state = "suspended" if agent.history else "cold"

    def forget_conversation(self, agent: Agent) -> None:
        agent.history, agent.pending, agent.state = [], None, "cold"
        self._drop_saved(agent)

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

    # ---- a context of a user's own (on the scheduler's thread, but the building) ---------------
    def own_context(self, pool: Pool, run: Run) -> bool:
        """`run` cannot be seated in the shared `pool` unless it reopens larger. If another
        user's agent sits in it, the run's agent decodes in a context of its owner's own
        instead, beside the owner's other agents that outgrew it: joined now if it has
        room, else made (or rebuilt larger) on a thread of its own while the scheduler goes
        on stepping the others; True: the run waits for it. Reopening would pause every
        resident to host RAM and back, once per growth step, at the cost of users who
        asked for nothing (issue #50). Its compute buffer is booked to the owner (its
        agents' cells are their own bookings already); a rebuild pauses the owner's agents
        only. False (no other user there, or no room in the ledger or the owner's share
        for that buffer): the scheduler reopens the shared pool as before."""
        agent = run.agent
        key = pool.key._replace(alone=str(agent.owner))
        if agent.kind is not Kind.CONVERSATION or key in self._unmade or \
                not any(s.agent.owner != agent.owner for s in pool.seats.values()):
            return False
        own = self.scheduler.pools.get(key)
        if own is not None and own.is_open and own.fits(agent):
            agent.alone = True          # its run joins that pool from the next step
            return True
        return self._build_own(key, agent)

    def _build_own(self, key: PoolKey, agent: Agent) -> bool:
        """Make uid key.alone's own context on a thread of its own, sized for `agent` and
        the owner's agents of that model and mode not seated in the shared pool (those
        already in its own context, those that have not decoded or wait to: all decode
        there once it is made, in place of the one of that key, if any). False if its
        compute buffer does not fit the ledger."""
        if key in self._building:
            return True
        if not self.ledger.held(compute_key_of(key)):
            owner = int(key.alone)
            try:
                self.ledger.reserve(compute_key_of(key), agent.loaded.context_bytes[2],
                                    cap=self._cap(self.ledger, self.quotas.ledger_share, owner),
                                    base=self._weights_used_by(owner))
            except LedgerDenied:
                return False
        mine = self._outside_shared(key)
        self._building.add(key)
        in_background(lambda: self._open_own(key, agent, mine), f"lmxd-own-{key.alone}")
        return True

    def _outside_shared(self, key: PoolKey, among: list[Agent] | None = None) -> list[Agent]:
        """(On the scheduler's thread.) The registered agents of uid key.alone of that
        model and mode (of `among`, if given) not seated in the shared pool."""
        shared_key = key._replace(alone="")
        shared = self.scheduler.pools.get(shared_key)
        with self._lock:
            agents = [a for a in self.agents.values() if a.owner == int(key.alone)] if among is None else \
                [a for a in among if self.agents.get((a.owner, a.id)) is a]
        return [a for a in agents if a.kind is Kind.CONVERSATION and pool_key(a)._replace(alone="") == shared_key
                and (shared is None or not shared.is_open or shared.seat_of(a) is None)]

    def _open_own(self, key: PoolKey, agent: Agent, sized_for: list[Agent]) -> None:
        """(A thread of its own.) Open the context, then hand it to the scheduler."""
        own = self.open_pool(key, agent.loaded)
        try:
            own.open(sized_for)
        except Exception:              # noqa: BLE001 - the run is told by the reopen that follows
            log.exception("opening uid %s's own context failed", key.alone)
            own = None

        def adopt() -> bool:
            self._building.discard(key)
            if own is None:
                self._unmade.add(key)
            here = self._outside_shared(key, among=sized_for)
            if own is None or not here:
                if key not in self.scheduler.pools:
                    self.ledger.release(compute_key_of(key))
                return False
            self.scheduler.adopt(own)
            for a in here:
                a.alone = True
            return True
        if not self.scheduler.call(adopt) and own is not None:
            own.discard()

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
