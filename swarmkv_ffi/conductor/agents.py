"""Agents, the one live compute context, and KV swap.

One context is live at a time. DECODE for agent B while agent A is
live: A's KV state is captured into a host-RAM snapshot and its context freed; B's
context is created and B's saved state (if any) restored. Each agent's conversation
persists across DECODEs, so an interrupted conversation continues exactly where it was.

DECODEs take turns on the compute slot in arrival order (FIFO); REGISTER, STATUS and
LIST never wait for it.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .. import catalog
from ..context import Context
from ..errors import ModelLoadError, ModelNotFoundError, SwarmKVError
from ..generate import generate
from ..snapshot import Snapshot, tokens_hash
from ..procmem import rss_bytes
from .estimate import Estimate, estimate
from .ledger import Ledger
from .modelfile import ModelFile, OpenModel, check_unchanged, fd_path
from .registry import Loaded, ModelRegistry

AGENT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ConductorError(SwarmKVError):
    """An error with a stable protocol code (UNKNOWN_AGENT, CONTEXT_FULL, …)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class FifoLock:
    """A lock granted in arrival order, so DECODEs are served first come, first served."""

    def __init__(self):
        self._cv = threading.Condition()
        self._queue: deque = deque()

    def __enter__(self):
        ticket = object()
        with self._cv:
            self._queue.append(ticket)
            while self._queue[0] is not ticket:
                self._cv.wait()
        return self

    def __exit__(self, *exc):
        with self._cv:
            self._queue.popleft()
            self._cv.notify_all()

    @property
    def waiting(self) -> int:
        with self._cv:
            return max(0, len(self._queue) - 1)


#: A paused prefix agent keeps no KV of its own when its tokens after the document are at
#: most this many: it is rebuilt from the shared document and a re-decode of those tokens.
REPLAY_MAX = 2048
MAX_PREFIX_BYTES = 8 << 20


@dataclass
class SharedPrefix:
    """A document that several agents of one model start from. Its KV is computed by the
    first agent that needs it and kept once in host RAM (booked once to the swap budget),
    for as long as one of its agents is registered."""
    key: str
    tokens: list[int]
    snapshot: Snapshot | None = None
    agents: set[str] = field(default_factory=set)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
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
    state: str = "cold"                   # cold | active | suspended
    saved: Snapshot | None = None         # KV in host RAM while suspended
    history: list[int] = field(default_factory=list)   # tokens whose KV is in the state
    pending: int | None = None            # last generated token, not yet decoded
    prefix: SharedPrefix | None = None    # the document it starts from (REGISTER prefix=)

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


class Conductor:
    def __init__(self, ledger: Ledger, table: dict[str, int] | None = None, n_threads: int | None = None,
                 swap: Ledger | None = None, agent_ttl: float = 0):
        self.ledger, self.table = ledger, table or {}
        self.swap = swap or Ledger(lambda: 1 << 62, name="SWAP")   # host RAM for paused KV
        self.agent_ttl = agent_ttl
        self.registry = ModelRegistry()
        self.agents: dict[str, Agent] = {}
        self._pending: set[str] = set()        # ids being registered right now
        self._lock = threading.Lock()
        self.slot = FifoLock()
        self.live: tuple[Agent, Context] | None = None
        self.decoding: str | None = None        # the agent whose DECODE holds the slot
        self.n_threads = n_threads
        self.prefixes: dict[str, SharedPrefix] = {}

    # ---- REGISTER / UNREGISTER ------------------------------------------------------------
    def register(self, agent_id: str, model: str, n_ctx: int = 2048, owner: int = -1,
                 prefix: str | None = None) -> Agent:
        """estimate → reserve → load → slot; any failure after the reservation undoes it.
        prefix: a document the agent starts from, shared with every agent of the same model
        over the same text (its KV is computed once, at the first DECODE that needs it)."""
        if not AGENT_ID.match(agent_id):
            raise ConductorError("BAD_REQUEST", "agent_id must be 1-64 of [A-Za-z0-9_.:-]")
        if not 256 <= n_ctx <= 1 << 20:
            raise ConductorError("BAD_REQUEST", f"n_ctx must be in 256..1048576, got {n_ctx}")
        with self._lock:
            if agent_id in self.agents or agent_id in self._pending:
                raise ConductorError("DUPLICATE_AGENT", f"agent {agent_id} is already registered")
            self._pending.add(agent_id)
        try:
            agent = self._register(agent_id, model, n_ctx, owner)
            if prefix is not None:
                try:
                    self._attach_prefix(agent, prefix)
                except BaseException:
                    self.unregister(agent_id)
                    raise
            return agent
        finally:
            with self._lock:
                self._pending.discard(agent_id)

    def _register(self, agent_id: str, model: str, n_ctx: int, owner: int) -> Agent:
        try:
            path = catalog.resolve(model)
        except ModelNotFoundError as exc:
            raise ConductorError("UNKNOWN_MODEL", str(exc)) from None
        try:
            with OpenModel(path) as (mf, fd):
                est = self._estimate(model, mf, fd, n_ctx)
                with self.registry.gate(mf.key):
                    loaded, measured = self._admit(agent_id, mf, fd, est, n_ctx)
        except ModelLoadError as exc:
            raise ConductorError("MODEL_LOAD_FAILED", str(exc)) from None
        agent = Agent(agent_id, model, path, n_ctx, loaded, est, mf, owner=owner, measured_bytes=measured)
        with self._lock:
            self.agents[agent_id] = agent
        return agent

    def _attach_prefix(self, agent: Agent, text: str) -> None:
        tokens = [int(t) for t in agent.loaded.model.tokenize(text)]
        if not tokens or len(tokens) + 16 > agent.n_ctx:
            raise ConductorError("BAD_PREFIX", f"the prefix document is {len(tokens)} tokens; "
                                 f"n_ctx={agent.n_ctx} leaves no room after it")
        key = f"{agent.file.key}:{tokens_hash(tokens)}"
        with self._lock:
            shared = self.prefixes.setdefault(key, SharedPrefix(key, tokens))
            shared.agents.add(agent.id)
            agent.prefix = shared

    def _release_prefix(self, agent: Agent) -> None:
        shared = agent.prefix
        if shared is None:
            return
        with self._lock:
            shared.agents.discard(agent.id)
            last = not shared.agents and self.prefixes.get(shared.key) is shared
            if last:
                del self.prefixes[shared.key]
        if last:
            self.swap.release(f"prefix:{shared.key}")

    def _admit(self, agent_id: str, mf: ModelFile, fd: int, est: Estimate, n_ctx: int) -> tuple[Loaded, int]:
        """reserve → load → measure → book what was measured, all within the budget; any
        failure undoes every step. The caller holds the model's gate, so whether its
        weights are already booked cannot change under us."""
        model_key, agent_key = f"model:{mf.key}", f"agent:{agent_id}"
        shared = self.registry.loaded(mf.key) is not None
        # This agent's KV + compute, plus the weights unless another agent holds them. A
        # --vram-table figure has no split: a second agent reserves all of it again.
        self.ledger.reserve(agent_key, est.agent_bytes if shared and est.agent_bytes else est.total)
        try:
            check_unchanged(mf, fd)
            loaded, newly = self.registry.acquire(mf.key, fd_path(fd), agent_id, name=str(mf.path))
        except BaseException:
            self.ledger.release(agent_key)
            raise
        try:
            try:
                measured = self._measure_context(loaded, n_ctx, est.kv)
            except Exception as exc:
                raise ConductorError("MODEL_LOAD_FAILED", f"context for n_ctx={n_ctx} failed: {exc}") from None
            # Replace the estimate with what was measured; the weights are booked to the
            # model, once, and follow it until its last agent leaves.
            bookings = {agent_key: measured}
            if newly:
                bookings[model_key] = loaded.measured_bytes
            self.ledger.settle(bookings)
        except BaseException:
            self.registry.release(mf.key, agent_id)
            self.ledger.release(agent_key)
            raise
        return loaded, measured

    def _estimate(self, name: str, mf: ModelFile, fd: int, n_ctx: int) -> Estimate:
        override = self.table.get(name) or self.table.get(str(mf.path))
        if override:
            return Estimate(weights=override, kv=0, compute=0, source="table")
        return estimate(mf, fd, n_ctx)

    def _measure_context(self, loaded: Loaded, n_ctx: int, kv_estimate: int) -> int:
        """Create the agent's context once and decode one token in it, so the compute
        buffers are really touched; measure the RSS growth; free it (the agent starts cold).

        The KV cache fills only as the conversation grows, so the booking is the larger of
        what was measured and the KV the agent's n_ctx will need."""
        before = rss_bytes()
        ctx = self._new_context(loaded, n_ctx)
        try:
            ctx.decode_tokens([loaded.model.bos if loaded.model.bos >= 0 else 0])
            used = rss_bytes() - before
        finally:
            ctx.close()
        return max(1, used, kv_estimate)

    def _new_context(self, loaded: Loaded, n_ctx: int, exact: bool = False) -> Context:
        kw = {"n_threads": self.n_threads} if self.n_threads else {}
        # swa_full: a sliding-window model (Gemma 3) keeps every cell, so rolling a
        # conversation back after a cancel or a failure restores exactly what was there.
        # exact (prefix agents): batch-invariant kernels, so re-decoding an agent's tokens
        # in one batch rebuilds the very KV bytes they had when decoded one by one.
        return Context(loaded.model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn="on",
                       swa_full=True, batch_invariant=exact, **kw)

    def unregister(self, agent_id: str) -> Agent:
        with self.slot:  # never free a context in the middle of its decode
            with self._lock:
                agent = self.agents.pop(agent_id, None)
            if agent is None:
                raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
            if self.live and self.live[0] is agent:
                self.live[1].close()
                self.live = None
            self._drop_saved(agent)
            self._release_prefix(agent)
        self.ledger.release(f"agent:{agent_id}")
        with self.registry.gate(agent.file.key):
            if self.registry.release(agent.file.key, agent_id):
                self.ledger.release(f"model:{agent.file.key}")
        return agent

    def expire_idle(self) -> list[str]:
        """Unregister agents unused for agent_ttl seconds (0: never); returns their ids."""
        if not self.agent_ttl:
            return []
        cutoff = time.monotonic() - self.agent_ttl
        with self._lock:
            stale = [a.id for a in self.agents.values() if a.last_used < cutoff]
        expired = []
        for agent_id in stale:
            try:
                self.unregister(agent_id)
                expired.append(agent_id)
            except ConductorError:
                pass  # unregistered meanwhile
        return expired

    def get(self, agent_id: str) -> Agent:
        with self._lock:
            agent = self.agents.get(agent_id)
        if agent is None:
            raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
        return agent

    # ---- DECODE / RESET ---------------------------------------------------------------------
    def decode(self, agent_id: str, max_tokens: int, prompt: str, should_stop=None) -> DecodeResult:
        if not 1 <= max_tokens <= 4096:
            raise ConductorError("BAD_REQUEST", f"max_tokens must be in 1..4096, got {max_tokens}")
        with self.slot:
            t0 = time.perf_counter_ns()
            agent = self.get(agent_id)
            agent.last_used = time.monotonic()
            if should_stop and should_stop():
                return DecodeResult(agent_id, 0, 0, False, 0.0, None, False, "", cancelled=True)
            evicted, restored, ctx = self._swap_in(agent)
            model = agent.loaded.model
            new = model.tokenize(prompt, add_special=not agent.history and agent.pending is None)
            tokens = ([agent.pending] if agent.pending is not None else []) + [int(t) for t in new]
            if not tokens:
                raise ConductorError("BAD_REQUEST", "the prompt is empty")
            need = len(agent.history) + len(tokens) + max_tokens
            if need > ctx.n_ctx:
                raise ConductorError("CONTEXT_FULL", f"agent {agent_id}: {len(agent.history)} tokens in "
                                     f"context + {len(tokens)} new + max_tokens {max_tokens} = {need} > "
                                     f"n_ctx {ctx.n_ctx}; RESET it or register with a larger n_ctx")
            before = len(agent.history)
            self.decoding = agent_id
            try:
                gen = generate(ctx, tokens, max_tokens=max_tokens, pos0=before, should_stop=should_stop)
            except BaseException as exc:
                self._roll_back(agent, ctx, before, exc)
                raise
            finally:
                self.decoding = None
            if gen.cancelled:  # the client left: the conversation is as it was before
                self._roll_back(agent, ctx, before)
                return DecodeResult(agent_id, len(new), 0, False, 0.0, evicted, restored, "", cancelled=True)
            # The last sampled token is in the KV only if another was sampled after it:
            # after an end-of-generation stop all of them are; after max_tokens the last
            # one waits to be decoded with the next prompt.
            if gen.stopped_on_eog or not gen.tokens:
                agent.history += tokens + gen.tokens
                agent.pending = None
            else:
                agent.history += tokens + gen.tokens[:-1]
                agent.pending = gen.tokens[-1]
            return DecodeResult(agent_id, len(new), len(gen.tokens), gen.stopped_on_eog,
                                (time.perf_counter_ns() - t0) / 1e6, evicted, restored, gen.text)

    def _roll_back(self, agent: Agent, ctx: Context, n_keep: int, cause: BaseException | None = None) -> None:
        """Leave the live context holding exactly the agent's history (positions < n_keep),
        so one failed DECODE cannot break the next one, this agent's or another's. If the
        cells cannot be removed, the live state is dropped and the agent starts over."""
        try:
            ctx.seq_rm(0, n_keep, -1)
            if ctx.seq_pos_max(0) != n_keep - 1:
                raise RuntimeError(f"cells past position {n_keep - 1} remain")
        except Exception as exc:
            ctx.close()
            self.live = None
            agent.history, agent.pending, agent.state = [], None, "cold"
            self._drop_saved(agent)
            raise ConductorError("INTERNAL", f"agent {agent.id}: {cause or 'cancelled'}; rolling back "
                                 f"failed ({exc}), so its conversation was reset") from cause
        agent.state = "active"

    def _drop_saved(self, agent: Agent) -> None:
        agent.saved = None
        self.swap.release(f"swap:{agent.id}")

    def _swap_in(self, agent: Agent) -> tuple[str | None, bool, Context]:
        """Make `agent` the live one; returns (evicted agent id, restored?, its context)."""
        if self.live and self.live[0] is agent:
            return None, False, self.live[1]
        evicted = None
        if self.live:
            other, ctx = self.live
            replayable = bool(other.history) and self._replayable(other)
            if other.history and not replayable:
                # Host RAM for the paused KV comes out of the swap budget, or nothing moves.
                self.swap.reserve(f"swap:{other.id}", max(1, ctx.seq_state_size(0)))
                try:
                    other.saved = Snapshot.capture(ctx, 0, other.history)
                except BaseException:
                    self.swap.release(f"swap:{other.id}")
                    raise
            other.state = "suspended" if other.saved or replayable else "cold"
            ctx.close()
            self.live, evicted = None, other.id
        ctx = self._new_context(agent.loaded, agent.n_ctx, exact=agent.prefix is not None)
        restored = False
        try:
            if agent.saved is not None:
                agent.saved.restore(ctx, 0)
                self._drop_saved(agent)
                restored = True
            elif agent.prefix is not None:
                restored = self._start_from_prefix(agent, ctx)
        except BaseException:
            ctx.close()
            raise
        agent.state = "active"
        self.live = (agent, ctx)
        return evicted, restored, ctx

    def _replayable(self, agent: Agent) -> bool:
        """A prefix agent whose KV can be rebuilt from the shared document plus a
        re-decode of at most REPLAY_MAX tokens of its own: it needs no snapshot."""
        p = agent.prefix
        return (p is not None and p.snapshot is not None and agent.history[:p.n_tokens] == p.tokens
                and len(agent.history) - p.n_tokens <= REPLAY_MAX)

    def _start_from_prefix(self, agent: Agent, ctx: Context) -> bool:
        """Load the shared document (computing it if no agent has yet), then re-decode the
        agent's own tokens after it. Returns True when the document was restored."""
        p = agent.prefix
        if p.snapshot is None:
            ctx.decode_tokens(p.tokens, logits_last=False)
            snap = Snapshot.capture(ctx, 0, p.tokens)
            self.swap.reserve(f"prefix:{p.key}", snap.nbytes)   # booked once, for all its agents
            p.snapshot, restored = snap, False
        else:
            p.snapshot.restore(ctx, 0)
            restored = True
        if not agent.history:
            agent.history = list(p.tokens)
        elif len(agent.history) > p.n_tokens:
            ctx.decode_tokens(agent.history[p.n_tokens:], p.n_tokens, logits_last=False)
        return restored

    def reset(self, agent_id: str) -> None:
        with self.slot:
            agent = self.get(agent_id)
            agent.last_used = time.monotonic()
            if self.live and self.live[0] is agent:
                if agent.prefix is not None:   # back to the document: the next DECODE reloads it
                    self.live[1].close()
                    self.live = None
                else:
                    self.live[1].clear()
            agent.history, agent.pending = [], None
            self._drop_saved(agent)
            agent.state = "active" if self.live and self.live[0] is agent else "cold"

    def close(self) -> None:
        with self.slot:
            if self.live:
                self.live[1].close()
                self.live = None
        for agent_id in list(self.agents):
            self.unregister(agent_id)
