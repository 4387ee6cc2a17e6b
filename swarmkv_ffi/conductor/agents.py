"""Agents, the one live compute context, and KV swap.

Like the original, one context is live at a time. DECODE for agent B while agent A is
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
from ..snapshot import Snapshot
from .estimate import Estimate, estimate
from .ledger import Ledger
from ..procmem import rss_bytes
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


@dataclass
class Agent:
    id: str
    model_name: str
    path: Path
    n_ctx: int
    loaded: Loaded
    estimate: Estimate
    measured_bytes: int = 0
    state: str = "cold"                   # cold | active | suspended
    saved: Snapshot | None = None         # KV in host RAM while suspended
    history: list[int] = field(default_factory=list)   # tokens whose KV is in the state
    pending: int | None = None            # last generated token, not yet decoded

    @property
    def tokens_in_context(self) -> int:
        return len(self.history) + (self.pending is not None)


@dataclass
class DecodeResult:
    agent_id: str
    prompt_tokens: int
    generated_tokens: int
    stopped_on_eos: bool
    elapsed_ms: float
    evicted: str | None
    restored: bool
    text: str
    cancelled: bool = False


class Conductor:
    def __init__(self, ledger: Ledger, table: dict[str, int] | None = None, n_threads: int | None = None):
        self.ledger, self.table = ledger, table or {}
        self.registry = ModelRegistry()
        self.agents: dict[str, Agent] = {}
        self._pending: set[str] = set()        # ids being registered right now
        self._lock = threading.Lock()
        self.slot = FifoLock()
        self.live: tuple[Agent, Context] | None = None
        self.n_threads = n_threads

    # ---- REGISTER / UNREGISTER ------------------------------------------------------------
    def register(self, agent_id: str, model: str, n_ctx: int = 2048) -> Agent:
        """estimate → reserve → load → slot; any failure after the reservation undoes it."""
        if not AGENT_ID.match(agent_id):
            raise ConductorError("BAD_REQUEST", "agent_id must be 1-64 of [A-Za-z0-9_.:-]")
        if not 256 <= n_ctx <= 1 << 20:
            raise ConductorError("BAD_REQUEST", f"n_ctx must be in 256..1048576, got {n_ctx}")
        with self._lock:
            if agent_id in self.agents or agent_id in self._pending:
                raise ConductorError("DUPLICATE_AGENT", f"agent {agent_id} is already registered")
            self._pending.add(agent_id)
        try:
            return self._register(agent_id, model, n_ctx)
        finally:
            with self._lock:
                self._pending.discard(agent_id)

    def _register(self, agent_id: str, model: str, n_ctx: int) -> Agent:
        try:
            path = catalog.resolve(model)
        except ModelNotFoundError as exc:
            raise ConductorError("UNKNOWN_MODEL", str(exc)) from None
        est = self._estimate(model, path, n_ctx)
        model_key, agent_key = f"model:{path.resolve()}", f"agent:{agent_id}"
        shared = self.ledger.held(model_key) > 0
        # Reserve: this agent's KV + compute, and the weights unless another agent holds them.
        self.ledger.reserve(agent_key, est.agent_bytes if shared else est.total)
        try:
            loaded, _ = self.registry.acquire(path, agent_id)
        except ModelLoadError as exc:
            self.ledger.release(agent_key)
            raise ConductorError("MODEL_LOAD_FAILED", str(exc)) from None
        except BaseException:
            self.ledger.release(agent_key)
            raise
        try:
            measured = self._measure_context(loaded, n_ctx, est.kv)
        except BaseException as exc:
            self.registry.release(path, agent_id)
            self.ledger.release(agent_key)
            raise ConductorError("MODEL_LOAD_FAILED", f"context for n_ctx={n_ctx} failed: {exc}") from None
        # Correct the estimate with what was measured; the weights are booked to the
        # model, once, and follow it until its last agent leaves.
        self.ledger.adjust(agent_key, measured)
        self.ledger.book_once(model_key, loaded.measured_bytes)
        agent = Agent(agent_id, model, path, n_ctx, loaded, est, measured_bytes=measured)
        with self._lock:
            self.agents[agent_id] = agent
        return agent

    def _estimate(self, name: str, path: Path, n_ctx: int) -> Estimate:
        override = self.table.get(name) or self.table.get(str(path))
        if override:
            return Estimate(weights=override, kv=0, compute=0, source="table")
        try:
            return estimate(path, n_ctx)
        except ModelLoadError as exc:
            raise ConductorError("MODEL_LOAD_FAILED", str(exc)) from None

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

    def _new_context(self, loaded: Loaded, n_ctx: int) -> Context:
        kw = {"n_threads": self.n_threads} if self.n_threads else {}
        return Context(loaded.model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn="on", **kw)

    def unregister(self, agent_id: str) -> Agent:
        with self.slot:  # never free a context in the middle of its decode
            with self._lock:
                agent = self.agents.pop(agent_id, None)
            if agent is None:
                raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
            if self.live and self.live[0] is agent:
                self.live[1].close()
                self.live = None
            agent.saved = None
        self.ledger.release(f"agent:{agent_id}")
        if self.registry.release(agent.path, agent_id):
            self.ledger.release(f"model:{agent.path.resolve()}")
        return agent

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
            gen = generate(ctx, tokens, max_tokens=max_tokens, pos0=before, should_stop=should_stop)
            if gen.cancelled:  # the client left: the conversation is as it was before
                ctx.seq_rm(0, before, -1)
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

    def _swap_in(self, agent: Agent) -> tuple[str | None, bool, Context]:
        """Make `agent` the live one; returns (evicted agent id, restored?, its context)."""
        if self.live and self.live[0] is agent:
            return None, False, self.live[1]
        evicted = None
        if self.live:
            other, ctx = self.live
            other.saved = Snapshot.capture(ctx, 0, other.history) if other.history else None
            other.state = "suspended" if other.saved else "cold"
            ctx.close()
            self.live, evicted = None, other.id
        ctx = self._new_context(agent.loaded, agent.n_ctx)
        restored = False
        if agent.saved is not None:
            try:
                agent.saved.restore(ctx, 0)
            except BaseException:
                ctx.close()
                raise
            agent.saved, restored = None, True
        agent.state = "active"
        self.live = (agent, ctx)
        return evicted, restored, ctx

    def reset(self, agent_id: str) -> None:
        with self.slot:
            agent = self.get(agent_id)
            if self.live and self.live[0] is agent:
                self.live[1].clear()
            agent.history, agent.pending, agent.saved = [], None, None
            agent.state = "active" if self.live and self.live[0] is agent else "cold"

    def close(self) -> None:
        with self.slot:
            if self.live:
                self.live[1].close()
                self.live = None
        for agent_id in list(self.agents):
            self.unregister(agent_id)
