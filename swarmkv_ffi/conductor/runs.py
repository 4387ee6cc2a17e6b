"""What the scheduler holds of a DECODE (`Run`) and what it counts of a pool's steps
(`StepTally`): plain records, apart from the thread that acts on them (scheduler.py)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..grammar import Compiled, Constraint
from ..sampler import Sampler
from .agent import pool_key
from .pool import PoolKey


class Stopping(Exception):
    """The daemon is stopping: this DECODE was not run."""


@dataclass
class Figures:
    """How a run went, for its reply (DecodeResult, RequestResult, STATUS): the scheduler
    writes them and decides nothing by them."""
    queued_s: float = 0.0         # waiting to join a batch (other pools' turns, a full batch)
    swap_s: float = 0.0           # making its agent resident (pools switched, restores, forks)
    slices: int = 0               # times it joined a batch
    batch_max: int = 0            # the most runs stepped with it at once
    restored: bool = False        # its KV (or its document's) came back from host RAM
    forked: bool = False          # it shares cells it did not decode
    tier: str | None = None       # where a request's cached opening came from (pool.Entry.tier)
    cached: int = 0               # prompt tokens whose cells were forked, not decoded (a request)
    evicted: object | None = None     # the agent paused to make room for this one


@dataclass(frozen=True)
class Asked:
    """What a DECODE asked for, fixed from its arrival: the scheduler reads it and never
    changes it (where the run stands and what it gave are the Run's own fields)."""
    prompt: str                   # an agent's new text (a request's tokens are its agent's)
    max_tokens: int
    should_stop: Callable[[], bool] = lambda: False
    sampling: dict = field(default_factory=dict)   # Sampler settings (temp, top_p, seed)
    top_logprobs: int | None = None   # report each token's logprob and this many alternatives
    grammar: "str | Compiled | None" = None   # the output must follow it (grammar.py); Run.constraint: its state
    on_token: Callable | None = None  # (token, logprobs or None) after each one; False ends the run
    on_prompt: Callable | None = None  # (its tokens in cells, of them forked) after each chunk of a prompt but the last


@dataclass
class Run:
    """One DECODE, from its arrival to its reply: whose it is and what it asked (`Asked`),
    where it stands, what it gave, and its figures."""
    agent: object
    owner: int
    asked: Asked
    # where it stands (the scheduler's)
    arrival: int = 0
    began: bool = False
    feed: list[int] = field(default_factory=list)   # tokens for the next steps, not in history yet
    n_history: int = 0            # the history's length before the DECODE (for a roll-back)
    pending: int | None = None    # the agent's pending token before the DECODE
    stepped: bool = False         # it has been in a step (its prompt is no longer whole)
    slice_tokens: int = 0         # tokens since it last joined the batch (SLICE_TOKENS)
    since: float = field(default_factory=time.perf_counter)   # when it last began waiting
    sampler: Sampler | None = None
    constraint: Constraint | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # what it gave
    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    stopped_on_eog: bool = False
    completed: bool = False       # the grammar allowed nothing more: the output is whole
    cancelled: bool = False
    error: BaseException | None = None
    figures: Figures = field(default_factory=Figures)

    @property
    def pool_key(self) -> PoolKey:
        return pool_key(self.agent)


@dataclass
class StepTally:
    """A pool's steps since it opened, for operators (serve's /metrics): how many, the
    rows they carried, their seconds, and how many steps carried each number of decode rows."""
    steps: int = 0
    decode_rows: int = 0
    prompt_rows: int = 0
    seconds: float = 0.0
    by_decode_rows: dict[int, int] = field(default_factory=dict)
    preemptions: int = 0         # requests that gave their cells up for others to grow
    swapped: int = 0             # of those, how many kept their KV in host RAM (not re-read)

    def step(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        self.steps += 1
        self.decode_rows += decode_rows
        self.prompt_rows += prompt_rows
        self.seconds += seconds
        self.by_decode_rows[decode_rows] = self.by_decode_rows.get(decode_rows, 0) + 1
