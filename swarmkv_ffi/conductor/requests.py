"""Request pools: the conductor's public door for one-shot requests (what serve/ uses).

A RequestPool books one model's pool once (its weights and every cell, in the ledger,
through a RESERVATION agent) and then runs requests in it:

    pool = RequestPool(conductor, "smollm2-135m", cells=32768, seqs=64)
    request = pool.submit(owner, tokens, max_tokens, sampling={"temp": 0.7, "seed": 1})
    result = request.result()        # blocks; request.cancel() rolls it back instead
    pool.close()

Each request is a short-lived agent of kind REQUEST, of its owner: the scheduler seats it
in the pool, where it forks the longest prefix of its tokens the pool holds (kvcache/device.py:
another request's cells, the owner's own unless the pool shares them) and decodes the
rest beside every other running request in one batch; when it ends its cells stay as
cache. Fairness between owners, admission and eviction are the conductor's as for its
conversations (policy.py, ledger.py, pool.py); the caller only says who asks what.
"""
from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..grammar import Compiled
from ..kvcache.tier import PrefixTier
from . import sandbox
from .agent import Agent, ConductorError, ContextFull, Kind, check_context, named_source
from .agents import Conductor
from .modelfile import LoadableCopy
from .pool import MAX_SEQS, Fixed, NoRoom
from .runs import Asked, Run, Stopping

#: What a caller of this door needs, all from here: the pool, its handles, the most
#: sequences a pool takes, and the four ways a request is refused (ContextFull is a
#: ConductorError; NoRoom: nothing running would free what it needs).
__all__ = ["MAX_SEQS", "ConductorError", "ContextFull", "NoRoom", "Request", "RequestPool",
           "RequestResult", "Stopping", "vetted"]

_pool_ids = itertools.count(1)


@dataclass
class RequestResult:
    """How a request ended: the tokens it generated, how many prompt tokens it forked
    instead of decoding, whether it stopped on end-of-generation, whether it was
    cancelled (then rolled back: its cells are not kept), and whether its grammar was
    complete (it ended there)."""
    generated: list[int]
    cached: int
    stopped_on_eog: bool
    cancelled: bool = False
    completed: bool = False
    tier: str | None = None     # where its cached tokens came from: "pool" (forked cells),
                                # "host" or "disk" (restored; kvcache/host.py, kvcache/disk.py)


class Request:
    """A submitted request: cancel() rolls it back (the client left), result() waits."""

    def __init__(self, run: Run, cancelled: threading.Event):
        self._run, self._cancelled = run, cancelled

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cached(self) -> int:
        """Prompt tokens whose cells were forked, not decoded: known once it is seated
        (before its first token), 0 until then."""
        return self._run.figures.cached

    def result(self) -> RequestResult:
        """Wait for the end; raises scheduler.Stopping (the conductor stopped first), a
        ConductorError (a request it cannot run) or what failed it."""
        run = self._run
        run.done.wait()
        if run.error is not None:
            raise run.error
        return RequestResult(list(run.generated), run.figures.cached, run.stopped_on_eog, run.cancelled, run.completed,
                             run.figures.tier)


class RequestPool:
    """One model's request pool on `conductor`: `cells` KV cells and `seqs` sequences for
    running requests and kept prefixes together; `exact`: batch-invariant kernels;
    `share`: every owner may fork every owner's kept cells; `store`: long shared
    prefixes kept below the cells (kvcache.tier.PrefixTier), or None."""

    def __init__(self, conductor: Conductor, model: str, *, cells: int = 32768, seqs: int = 64,
                 exact: bool = False, share: bool = False, store: PrefixTier | None = None):
        if not 2 <= seqs <= MAX_SEQS - 1:
            raise ValueError(f"a request pool takes 2..{MAX_SEQS - 1} sequences, got {seqs}")
        self.conductor, self.exact = conductor, exact
        self.reservation = conductor.register(f"#requests-{next(_pool_ids)}", model, n_ctx=cells,
                                              kind=Kind.RESERVATION, exact=exact)
        self.key = conductor.add_request_pool(self.reservation, Fixed(cells, seqs, share, store))
        self.cells, self.seqs = cells, seqs
        self._ids = itertools.count(1)

    @property
    def model(self):
        """The loaded Model (tokenizer, chat template, token bytes)."""
        return self.reservation.loaded.model

    @property
    def path(self):
        return self.reservation.path

    @property
    def max_context(self) -> int:
        """A request's prompt plus max_tokens may take at most this many cells."""
        return min(self.cells, self.model.n_ctx_train) - 1

    def check(self, n_prompt: int, max_tokens: int) -> None:
        """Raise agents.ContextFull unless a prompt of n_prompt tokens and max_tokens more fit."""
        check_context(self.max_context, 0, n_prompt, max_tokens, "the request",
                      "shorten the prompt or ask for fewer tokens")

    def submit(self, owner: int, tokens: list[int], max_tokens: int, *, sampling: dict | None = None,
               top_logprobs: int | None = None, on_token: Callable[[int, object], bool] | None = None,
               cancelled: threading.Event | None = None, grammar: "str | Compiled | None" = None,
               on_prompt: Callable[[int, int], None] | None = None) -> Request:
        """Queue one request of `owner`'s. on_token(token, logprobs or None) runs on the
        scheduler's thread after each generated token and returns False to end the
        request there (a stop string); on_prompt(tokens in cells, of them forked) there
        after each chunk of the prompt but the last (its progress, for a client that
        asks); `cancelled`, once set, rolls it back; `grammar`
        (grammar.py: its text, or a Compiled one that several requests copy) constrains
        every token and ends the request once complete. Raises
        ContextFull when it cannot fit, Stopping once the conductor stops."""
        if not tokens:
            raise ConductorError("BAD_REQUEST", "the prompt is empty")
        self.check(len(tokens), max_tokens)
        cancelled = cancelled or threading.Event()
        asked = Asked("", max_tokens, cancelled.is_set, dict(sampling or {}), top_logprobs, grammar, on_token,
                      on_prompt)
        run = Run(self._agent(owner, tokens, max_tokens), owner, asked)
        self.conductor.scheduler.enqueue(run)
        return Request(run, cancelled)

    def _agent(self, owner: int, tokens: list[int], max_tokens: int) -> Agent:
        """The request as an agent of the reserved model, as long as it may grow."""
        base = self.reservation
        return Agent(f"request-{next(self._ids)}", base.model_name, base.path, len(tokens) + max_tokens + 1,
                     base.loaded, base.estimate, base.file, owner=owner, kind=Kind.REQUEST,
                     asked=list(tokens), exact=self.exact, decoded=True)

    def stats(self) -> dict:
        """What the pool holds now and what its steps have carried, for operators: how
        many times its context was made, cells (all, free, booked by running requests,
        booked by kept ones), sequences (running, kept), requests waiting for a seat, and
        its StepTally. Read from another thread without stopping the scheduler: each
        figure is current, the set of them nearly so."""
        scheduler = self.conductor.scheduler
        pool = scheduler.pools.get(self.key)
        seats = list(pool.seats.values()) if pool is not None and pool.is_open else []
        kept = list(pool.cache.kept.values()) if pool is not None and pool.is_open else []
        free = pool.cells_free if pool is not None and pool.is_open else self.cells
        tally = scheduler.tally.get(self.key)
        return {"opens": pool.opens if pool is not None else 0, "cells": self.cells, "cells_free": free,
                "cells_running": sum(s.cells for s in seats), "cells_kept": sum(k.cells for k in kept),
                "running": len(seats), "kept": len(kept), "waiting": scheduler.waiting(), "steps": tally}

    def close(self) -> None:
        """Free the pool and its booking. Call once no request of it is running."""
        self.conductor.close_request_pool(self.reservation)


def vetted(model: str) -> Path:
    """The file of `model` (a packaged short name or a path), loaded first in a sandboxed
    child unless it is a packaged one (sandbox.py), as the conductor loads a client's
    file: a crafted GGUF that crashes libllama's loader fails with the cause, and the
    process goes on. Read it before sizing a pool from the file, which opens it here."""
    source = named_source(model)
    if not source.trusted:
        with source.open() as (mf, sent), LoadableCopy(mf, sent) as fd:
            sandbox.check(mf, fd, os.getuid())
    return source.path
