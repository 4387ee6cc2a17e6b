"""Agents, the one live compute context, and KV swap.

One context is live at a time. DECODE for agent B while agent A is
live: A's KV state is captured into a host-RAM snapshot and its context freed; B's
context is created and B's saved state (if any) restored. Each agent's conversation
persists across DECODEs, so an interrupted conversation continues exactly where it was.

Agents belong to the uid that registered them and are named within it: two users may
both have an agent `a`, and every lookup is by (uid, id) at the moment of use, so no
request can reach another user's agent or learn whether it exists. DECODEs take turns on
the compute slot, shared fairly between users by time held (slot.py), one slice (at most
SLICE_TOKENS tokens or SLICE_SECONDS) per turn when others wait; REGISTER, STATUS and
LIST never wait for it. Per-user quotas (quotas.py) cap what one user may take of the
agents, the device budget and the swap budget; a paused agent whose KV does not fit the
swap budget keeps its tokens and re-reads them when it comes back.
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import catalog
from ..context import Context
from ..errors import ModelLoadError, ModelNotFoundError, SwarmKVError
from ..generate import generate
from ..snapshot import Snapshot, tokens_hash
from ..procmem import rss_bytes
from . import sandbox
from .estimate import Estimate, estimate
from .ledger import Ledger, LedgerDenied
from .modelfile import LoadableCopy, ModelFile, ModelSource, check_unchanged, fd_path
from .quotas import UNLIMITED, Quotas
from .registry import Loaded, ModelRegistry
from .slot import FairSlot, SlotClosed

AGENT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ConductorError(SwarmKVError):
    """An error with a stable protocol code (UNKNOWN_AGENT, CONTEXT_FULL, …)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


#: A paused prefix agent keeps no KV of its own when its tokens after the document are at
#: most this many: it is rebuilt from the shared document and a re-decode of those tokens.
REPLAY_MAX = 2048
MAX_PREFIX_BYTES = 8 << 20
#: A DECODE's turn on the slot ends, when another user waits, after this many tokens or
#: this many seconds (its swap-in included), whichever comes first.
SLICE_TOKENS = 32
SLICE_SECONDS = 0.25
REPLAY_CHUNK = 64


class Preempted(Exception):
    """A turn given up before its work began (a re-read interrupted); queue again."""


@dataclass
class SharedPrefix:
    """A document that several agents of one model start from. Its KV is computed by the
    first agent that needs it and kept once in host RAM (booked once to the swap budget),
    for as long as one of its agents is registered."""
    key: str                              # owner:model file:tokens hash (never shared across users)
    tokens: list[int]
    snapshot: Snapshot | None = None
    agents: set[str] = field(default_factory=set)   # Agent.key of each

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
    replay: bool = False                  # paused without a snapshot: re-read history on resume
    running: bool = False                 # a DECODE of it is between its first and last slice
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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
    queued_ms: float = 0.0     # waiting for turns on the slot (other users' slices)
    swap_ms: float = 0.0       # making the agent live (snapshot out, restore or re-read in)
    slices: int = 0


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
                 admin_uid: int | None = None):
        self.ledger, self.table = ledger, table or {}
        self.swap = swap or Ledger(lambda: 1 << 62, name="SWAP")   # host RAM for paused KV
        self.agent_ttl, self.quotas = agent_ttl, quotas
        self.admin = os.getuid() if admin_uid is None else admin_uid   # not held to the quotas
        self.registry = ModelRegistry()
        self.agents: dict[tuple[int, str], Agent] = {}
        self._pending: set[tuple[int, str]] = set()   # (owner, id) being registered right now
        self._lock = threading.Lock()
        self._uid_gates: dict[int, threading.Lock] = {}
        self.slot = FairSlot()
        self.live: tuple[Agent, Context] | None = None
        self.decoding: Agent | None = None        # the agent whose DECODE holds the slot
        self.n_threads = n_threads
        self.prefixes: dict[str, SharedPrefix] = {}
        self._deadline: float | None = None       # shutdown: the running DECODE stops then

    # ---- REGISTER / UNREGISTER ------------------------------------------------------------
    def register(self, agent_id: str, model: str | ModelSource, n_ctx: int = 2048, owner: int | None = None,
                 prefix: str | None = None) -> Agent:
        """estimate → reserve → load → slot; any failure after the reservation undoes it.
        model: a short name or a path the daemon may open (the operator's), or a
        ModelSource the server built. prefix: a document the agent starts from, shared
        with every agent of the same owner and model over the same text (its KV is
        computed once, at the first DECODE that needs it)."""
        owner = self.admin if owner is None else owner
        if not AGENT_ID.match(agent_id):
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
                agent = self._register(agent_id, model, n_ctx, owner)
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

    def _register(self, agent_id: str, model: str | ModelSource, n_ctx: int, owner: int) -> Agent:
        source = model if isinstance(model, ModelSource) else named_source(model)
        try:
            with source.open() as (mf, sent), LoadableCopy(mf, sent) as fd:
                facts = None if source.trusted else sandbox.check(mf, fd, owner)
                est = self._estimate(source.name, mf, fd, n_ctx, facts)
                with self.registry.gate(mf.key):
                    loaded, measured = self._admit(f"{owner}:{agent_id}", owner, mf, fd, est, n_ctx, sent)
        except ModelLoadError as exc:
            raise ConductorError("MODEL_LOAD_FAILED", str(exc)) from None
        agent = Agent(agent_id, source.name, mf.path, n_ctx, loaded, est, mf, owner=owner,
                      measured_bytes=measured)
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
            shared = self.prefixes.setdefault(key, SharedPrefix(key, tokens))
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
               n_ctx: int, sent: int) -> tuple[Loaded, int]:
        """reserve → load → measure → book what was measured, all within the budget and
        the owner's share; any failure undoes every step. The caller holds the model's
        gate, so whether its weights are already booked cannot change under us. fd: what
        libllama loads; sent: the file as opened (checked unchanged)."""
        model_key, agent_key = f"model:{mf.key}", f"agent:{ref}"
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
                measured = self._measure_context(loaded, n_ctx, est.kv)
            except Exception as exc:
                raise ConductorError("MODEL_LOAD_FAILED", f"context for n_ctx={n_ctx} failed: {exc}") from None
            # Replace the estimate with what was measured; the weights are booked to the
            # model, once, and follow it until its last agent leaves.
            bookings = {agent_key: measured}
            if newly:
                bookings[model_key] = loaded.measured_bytes
            self.ledger.settle(bookings, cap=cap, base=self._weights_used_by(owner, mf.key))
        except BaseException:
            self.registry.release(mf.key, ref)
            self.ledger.release(agent_key)
            raise
        return loaded, measured

    def _estimate(self, name: str, mf: ModelFile, fd: int, n_ctx: int, facts: dict | None) -> Estimate:
        override = self.table.get(name) or self.table.get(str(mf.path))
        if override:
            return Estimate(weights=override, kv=0, compute=0, source="table")
        return estimate(mf, fd, n_ctx, facts)

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

    def unregister(self, agent_id: str, owner: int | None = None) -> Agent:
        owner = self.admin if owner is None else owner
        with self._slot_turn(owner):  # never free a context in the middle of its decode
            with self._lock:
                agent = self.agents.pop((owner, agent_id), None)
            if agent is None:
                raise ConductorError("UNKNOWN_AGENT", f"no agent {agent_id}")
            if self.live and self.live[0] is agent:
                self.live[1].close()
                self.live = None
            self._free(agent)
        return agent

    def _free(self, agent: Agent) -> None:
        """Release everything an agent that left the table holds: its saved KV, its share
        of a document, its bookings, its reference to the model."""
        self._drop_saved(agent)
        self._release_prefix(agent)
        self.ledger.release(f"agent:{agent.key}")
        with self.registry.gate(agent.file.key):
            if self.registry.release(agent.file.key, agent.key):
                self.ledger.release(f"model:{agent.file.key}")

    def expire_idle(self) -> list[str]:
        """Unregister agents unused for agent_ttl seconds (0: never); returns their ids."""
        if not self.agent_ttl:
            return []
        cutoff = time.monotonic() - self.agent_ttl
        with self._lock:
            stale = [a for a in self.agents.values() if a.last_used < cutoff]
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

    def owned_by(self, uid: int | None) -> list[Agent]:
        """uid's agents, or every agent (None)."""
        with self._lock:
            return [a for a in self.agents.values() if uid is None or a.owner == uid]

    # ---- DECODE / RESET ---------------------------------------------------------------------
    def decode(self, agent_id: str, max_tokens: int, prompt: str, should_stop=None,
               owner: int | None = None) -> DecodeResult:
        """Continue the agent's conversation by up to max_tokens tokens, one slice per turn
        on the slot. Cancelled (should_stop) or failed, it leaves the conversation exactly
        as it was before this DECODE, whichever slice it was in."""
        owner = self.admin if owner is None else owner
        if not 1 <= max_tokens <= 4096:
            raise ConductorError("BAD_REQUEST", f"max_tokens must be in 1..4096, got {max_tokens}")
        stop = lambda: bool(should_stop and should_stop()) or self._past_deadline()  # noqa: E731
        t0, run, waits, swaps = time.perf_counter_ns(), None, 0.0, 0.0
        while True:
            t_wait = time.perf_counter()
            with self._slot_turn(owner):
                waits += time.perf_counter() - t_wait
                try:
                    agent = self.get(agent_id, owner)       # the owner's agent, looked up now
                    if run is not None and agent is not run.agent:
                        raise ConductorError("UNKNOWN_AGENT", f"agent {agent_id} was unregistered during the DECODE")
                    agent.last_used = time.monotonic()
                    if run is None and stop():
                        return DecodeResult(agent_id, 0, 0, False, 0.0, None, False, "", cancelled=True)
                    with agent.lock:
                        t_swap = time.perf_counter()
                        try:
                            evicted, restored, ctx = self._swap_in(agent)
                        except Preempted:
                            swaps += time.perf_counter() - t_swap
                            continue
                        swaps += time.perf_counter() - t_swap
                        if run is None:
                            run = self._begin(agent, ctx, prompt, max_tokens, evicted, restored)
                            agent.running = True
                        if self._slice(run, ctx, stop):
                            agent.running = False
                            r = run.result(agent_id, (time.perf_counter_ns() - t0) / 1e6)
                            r.queued_ms, r.swap_ms, r.slices = waits * 1e3, swaps * 1e3, run.slices
                            return r
                except BaseException:
                    if run is not None:
                        run.agent.running = False
                        if run.slices and run.agent is self.agents.get((owner, agent_id)):
                            self._abandon(run)
                    raise

    def _abandon(self, run: "_Run") -> None:
        """A DECODE failed between slices (its agent may be paused): put the agent back as
        it was before the DECODE. Paused, it keeps its tokens and re-reads them."""
        agent = run.agent
        agent.history, agent.pending = agent.history[:run.n_history], run.pending
        if self.live and self.live[0] is agent:
            self._roll_back(run, self.live[1])
        elif agent.saved is not None or agent.state == "suspended":
            self._drop_saved(agent)
            agent.replay = bool(agent.history) and agent.prefix is None
            agent.state = "suspended" if agent.history else "cold"

    def _slot_turn(self, owner: int):
        """A turn on the slot; a DECODE queued when the daemon stops is CANCELLED."""
        return _Turn(self.slot, owner)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _begin(self, agent: Agent, ctx: Context, prompt: str, max_tokens: int, evicted, restored) -> "_Run":
        new = agent.loaded.model.tokenize(prompt, add_special=not agent.history and agent.pending is None)
        tokens = ([agent.pending] if agent.pending is not None else []) + [int(t) for t in new]
        if not tokens:
            raise ConductorError("BAD_REQUEST", "the prompt is empty")
        need = len(agent.history) + len(tokens) + max_tokens
        if need > ctx.n_ctx:
            raise ConductorError("CONTEXT_FULL", f"agent {agent.id}: {len(agent.history)} tokens in "
                                 f"context + {len(tokens)} new + max_tokens {max_tokens} = {need} > "
                                 f"n_ctx {ctx.n_ctx}; RESET it or register with a larger n_ctx")
        return _Run(agent, len(new), tokens, max_tokens, len(agent.history), agent.pending,
                    self._evicted_for(agent, evicted), restored)

    def _evicted_for(self, agent: Agent, evicted: Agent | None) -> str | None:
        """The agent swapped out, as the requester may see it: another user's agent is
        only 'another-user', never its id."""
        if evicted is None:
            return None
        return evicted.id if evicted.owner == agent.owner or agent.owner == self.admin else "another-user"

    def _slice(self, run: "_Run", ctx: Context, stop) -> bool:
        """Generate up to SLICE_TOKENS tokens (more while no other user waits); commit them
        to the agent's history. True when the DECODE is complete (or cancelled)."""
        agent = run.agent
        self.decoding = agent
        taken, yielded = [0], []

        def pause() -> bool:     # asked before each token is sampled
            if stop():
                return True
            if taken[0] and (taken[0] >= SLICE_TOKENS or self.slot.held_for() >= SLICE_SECONDS) \
                    and self.slot.others_waiting(agent.owner):
                yielded.append(True)
                return True
            taken[0] += 1
            return False
        try:
            gen = generate(ctx, run.tokens, max_tokens=run.left, pos0=len(agent.history), should_stop=pause)
        except BaseException as exc:
            self._roll_back(run, ctx, exc)
            raise
        finally:
            self.decoding = None
        if gen.cancelled and not yielded:   # the client left, or the daemon is stopping
            self._roll_back(run, ctx)
            run.cancelled = True
            return True
        if yielded:   # the last token was decoded already: drop its cell, keep it pending
            ctx.seq_rm(0, len(agent.history) + len(run.tokens) + len(gen.tokens) - 1, -1)
        # The last sampled token is in the KV only if another was sampled after it:
        # after an end-of-generation stop all of them are; otherwise the last one waits
        # to be decoded with the next prompt (or the next slice).
        if gen.stopped_on_eog or not gen.tokens:
            agent.history += run.tokens + gen.tokens
            agent.pending = None
        else:
            agent.history += run.tokens + gen.tokens[:-1]
            agent.pending = gen.tokens[-1]
        run.generated += gen.tokens
        run.stopped_on_eog = gen.stopped_on_eog
        run.slices += 1
        if gen.stopped_on_eog or run.left == 0:
            return True
        run.tokens, agent.pending = [agent.pending], None
        return False

    def _roll_back(self, run: "_Run", ctx: Context, cause: BaseException | None = None) -> None:
        """Leave the agent as it was before the DECODE began (its history, its pending
        token) and the live context holding exactly that history, so one failed DECODE
        cannot break the next one, this agent's or another's. If the cells cannot be
        removed, the live state is dropped and the agent starts over."""
        agent, n_keep = run.agent, run.n_history
        agent.history, agent.pending = agent.history[:n_keep], run.pending
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
        agent.saved, agent.replay = None, False
        self.swap.release(f"swap:{agent.key}")

    def _swap_in(self, agent: Agent) -> tuple[Agent | None, bool, Context]:
        """Make `agent` the live one; returns (evicted agent, restored?, its context)."""
        if self.live and self.live[0] is agent:
            return None, False, self.live[1]
        evicted = None
        if self.live:
            other, ctx = self.live
            self._pause(other, ctx)
            ctx.close()
            self.live, evicted = None, other
        ctx = self._new_context(agent.loaded, agent.n_ctx, exact=agent.prefix is not None)
        restored = False
        try:
            if agent.saved is not None:
                agent.saved.restore(ctx, 0)
                self._drop_saved(agent)
                restored = True
            elif agent.prefix is not None:
                restored = self._start_from_prefix(agent, ctx)
            elif agent.replay:
                self._replay(agent, ctx)
        except BaseException:
            ctx.close()
            raise
        agent.state = "active"
        self.live = (agent, ctx)
        return evicted, restored, ctx

    def _replay(self, agent: Agent, ctx: Context) -> None:
        """Re-read a paused agent's history (its KV did not fit the swap budget), a chunk
        at a time: when another user who has used less of the slot waits, give the turn
        up (Preempted) and start again at a later turn, so a long re-read cannot hold
        the others (it is its owner's cost, not theirs)."""
        history = agent.history
        for start in range(0, len(history), REPLAY_CHUNK):
            if start and self.slot.held_for() >= SLICE_SECONDS and self.slot.others_waiting(agent.owner):
                raise Preempted()
            ctx.decode_tokens(history[start:start + REPLAY_CHUNK], start, logits_last=False)
        agent.replay = False

    def _pause(self, other: Agent, ctx: Context) -> None:
        """Keep the live agent's KV in host RAM, booked to its owner's swap share. If that
        share (or the whole budget) is full, the agent keeps only its tokens and its next
        DECODE re-reads them: a full swap budget slows its owner's agents down, and never
        refuses anyone's DECODE (one user's hoard cannot block another's)."""
        replayable = bool(other.history) and self._replayable(other)
        if other.history and not replayable:
            key = f"swap:{other.key}"
            try:
                self.swap.reserve(key, max(1, ctx.seq_state_size(0)),
                                  cap=self._cap(self.swap, self.quotas.swap_share, other.owner))
            except LedgerDenied:
                other.replay = True
            else:
                try:
                    other.saved = Snapshot.capture(ctx, 0, other.history)
                except BaseException:
                    self.swap.release(key)
                    raise
        other.state = "suspended" if other.saved or replayable or other.replay else "cold"

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
            self.swap.reserve(f"prefix:{p.key}", snap.nbytes,        # booked once, for all its agents
                              cap=self._cap(self.swap, self.quotas.swap_share, agent.owner))
            p.snapshot, restored = snap, False
        else:
            p.snapshot.restore(ctx, 0)
            restored = True
        if not agent.history:
            agent.history = list(p.tokens)
        elif len(agent.history) > p.n_tokens:
            ctx.decode_tokens(agent.history[p.n_tokens:], p.n_tokens, logits_last=False)
        agent.replay = False
        return restored

    def reset(self, agent_id: str, owner: int | None = None) -> None:
        """Clear the agent's conversation. An agent that is neither live nor in a DECODE
        is cleared at once; otherwise the RESET waits for a turn on the slot."""
        owner = self.admin if owner is None else owner
        agent = self.get(agent_id, owner)
        with agent.lock:        # held by a turn that is swapping this agent in or decoding it
            if not agent.running and not (self.live and self.live[0] is agent):
                agent.last_used = time.monotonic()
                agent.history, agent.pending = [], None
                self._drop_saved(agent)
                agent.state = "cold"
                return
        with self._slot_turn(owner):
            agent = self.get(agent_id, owner)
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

    def shutdown(self, grace_s: float) -> None:
        """Stop: queued DECODEs are CANCELLED now, the running one within grace_s (rolled
        back like a disconnect)."""
        self._deadline = time.monotonic() + grace_s
        self.slot.close()

    def close(self) -> None:
        """Free everything (after shutdown, or in-process use)."""
        with self._lock:
            agents = list(self.agents.values())
            self.agents.clear()
        if self.live:
            self.live[1].close()
            self.live = None
        for agent in agents:
            self._free(agent)


class _Turn:
    """`with _Turn(slot, uid):` a turn on the slot; SlotClosed becomes CANCELLED."""

    def __init__(self, slot: FairSlot, uid: int):
        self._cm = slot.turn(uid)

    def __enter__(self):
        try:
            return self._cm.__enter__()
        except SlotClosed:
            raise ConductorError("CANCELLED", "the daemon is stopping; this request was not run") from None

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


@dataclass
class _Run:
    """One DECODE across its slices: what it started from (for a roll-back) and what it made."""
    agent: Agent
    prompt_tokens: int
    tokens: list[int]                 # to decode at the next slice's start
    max_tokens: int
    n_history: int                    # the history's length before the DECODE
    pending: int | None               # the pending token before the DECODE
    evicted: str | None
    restored: bool
    generated: list[int] = field(default_factory=list)
    stopped_on_eog: bool = False
    cancelled: bool = False
    slices: int = 0

    @property
    def left(self) -> int:
        return self.max_tokens - len(self.generated)

    def result(self, agent_id: str, elapsed_ms: float) -> DecodeResult:
        if self.cancelled:
            return DecodeResult(agent_id, self.prompt_tokens, 0, False, 0.0, self.evicted, self.restored, "",
                                cancelled=True)
        model = self.agent.loaded.model
        text = b"".join(model.token_bytes(t) for t in self.generated).decode("utf-8", "replace")
        return DecodeResult(agent_id, self.prompt_tokens, len(self.generated), self.stopped_on_eog,
                            elapsed_ms, self.evicted, self.restored, text)
