"""What the conductor keeps of an agent, the pool its kind and mode decide, and the
errors its doors raise: plain records (the Conductor that acts on them: agents.py).
The pool and the scheduler never ask an agent's kind: a request pool seats requests."""
from __future__ import annotations

import enum
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import catalog
from ..errors import ModelNotFoundError, SwarmKVError
from ..snapshot import Snapshot
from .estimate import Estimate
from .modelfile import ModelFile, ModelSource
from .pool import PoolKey
from .registry import Loaded

class Kind(enum.Enum):
    """What an agent is, which decides the pool it decodes in and how it ends."""
    CONVERSATION = "conversation"   # lmxd's: registered, DECODEs continue its history
    REQUEST = "request"             # one prompt (Agent.asked) run once in a request pool;
                                    # it forks kept cells and leaves its own as cache
    RESERVATION = "reservation"     # books a request pool's cells and weights; never decodes


def pool_key(agent) -> PoolKey:
    """The pool an agent decodes in."""
    return key_for(agent.file.key, agent.exact, agent.prefix is not None, agent.kind,
                   str(agent.owner) if agent.alone else "")


def key_for(model: str, exact: bool, with_prefix: bool, kind: "Kind", alone: str = "") -> PoolKey:
    """The pool of an agent of this model file, mode and kind (before it exists, as
    admission needs it): exact with a document or when asked; a request pool's or one
    of lmxd's pools sized for its conversations; `alone`: the uid whose own context it is."""
    return PoolKey(model, with_prefix or exact, kind is not Kind.CONVERSATION, alone)


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


def named_source(model: str) -> ModelSource:
    """A model named by a packaged short name (trusted: it skips the sandbox) or by a path
    the daemon may open itself (the operator's own, or one access.py vouched for)."""
    try:
        path = catalog.resolve(model)
    except ModelNotFoundError as exc:
        raise ConductorError("UNKNOWN_MODEL", str(exc)) from None
    return ModelSource(model, Path(os.path.realpath(path)), trusted=model in catalog.CATALOG)
