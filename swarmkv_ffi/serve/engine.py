"""Requests as short-lived agents on lmxd's engine.

The server runs on an lmxd Conductor (ledger, scheduler, fair policy): its own for
`swarmkv serve`, lmxd's for `lmxd --http`. At start it registers a holder agent whose
n_ctx is the whole pool (`--ctx-size` cells): that loads the model and books its weights
and every cell in the ledger, once. Each request choice then becomes an Agent of that
model, of the request's principal, whose `want` is its prompt's tokens; the scheduler
seats it in the pool, where it forks the longest prefix the pool already holds (kept.py)
and decodes the rest with the others in one batch, and when it ends its cells stay as
cache. The HTTP front (app.py) only turns bodies into Jobs and events into responses.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..conductor.agents import Agent, Conductor, ConductorError
from ..conductor.ledger import Ledger
from ..conductor.memory import DeviceMemory
from ..conductor.policy import Policy
from ..conductor.pool import MAX_SEQS
from ..conductor.scheduler import Run, Stopping
from ..prefix_cache import PrefixCache
from .persist import PrefixStore

BASE_ID = "http-pool"


class Refused(Exception):
    """A request the engine will not run; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class Job:
    """One choice of one request. on_token(token, logprobs) runs on the scheduler's thread
    after each generated token and returns False to end the choice there (a stop string)."""
    principal: int
    tokens: list[int]
    max_tokens: int
    on_token: Callable[[int, object], bool]
    sampling: dict = field(default_factory=dict)
    top_logprobs: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)   # the client left


class ServeEngine:
    """One model served to principals (API keys). `cells`: the pool's KV cells, all
    requests and the cache together; `seqs`: sequences (requests running plus kept).
    conductor: lmxd's (lmxd --http), else one of its own with its own ledger."""

    def __init__(self, model: str, *, cells: int = 32768, seqs: int = 64, threads: int | None = None,
                 exact: bool = False, share_prefixes: bool = False, budget_bytes: int | None = None,
                 max_requests: int = 256, max_per_principal: int = 64, policy: Policy | None = None,
                 conductor: Conductor | None = None, cache_dir: Path | None = None):
        if not 2 <= seqs <= MAX_SEQS - 1:
            raise ValueError(f"--parallel must be in 2..{MAX_SEQS - 1}, got {seqs}")
        self.memory = None if conductor is not None else DeviceMemory(budget_bytes=budget_bytes)
        self.conductor = conductor or Conductor(Ledger(self.memory.budget), n_threads=threads, policy=policy)
        self.conductor.served_pool, self.conductor.share_prefixes = (cells, seqs), share_prefixes
        cache = PrefixCache.open_optional(cache_dir) if cache_dir is not None else None
        self.store = PrefixStore(cache) if cache is not None else None
        self.conductor.served_store = self.store
        try:
            self.base = self.conductor.register(BASE_ID, model, n_ctx=cells)
        except BaseException:
            if self.memory is not None:
                self.memory.close()
            raise
        self.base.holder = True
        if self.memory is not None:
            # The holder never decodes: its REGISTER must not make the first requests look
            # as if another user shared the device (their steps would be kept short).
            self.conductor.scheduler.policy.forget(self.base.owner)
        self.model = self.base.loaded.model
        self.cells, self.exact = cells, exact
        self.max_requests, self.max_per_principal = max_requests, max_per_principal
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # notified when no choice is in flight
        self._running: dict[int, int] = {}      # principal -> choices in flight
        self.stopping = False

    @property
    def max_context(self) -> int:
        """A request's prompt plus max_tokens may take at most this many cells."""
        return min(self.cells, self.model.n_ctx_train) - 1

    def admit(self, principal: int, n: int) -> None:
        """Count n choices in flight for principal, or refuse (429: over its share, 503:
        the server is full or stopping). Pair with leave()."""
        with self._lock:
            if self.stopping:
                raise Refused(503, "the server is stopping", "server_stopping")
            mine, total = self._running.get(principal, 0), sum(self._running.values())
            if mine + n > self.max_per_principal:
                raise Refused(429, f"this key has {mine} choices running; the limit per key is "
                              f"{self.max_per_principal} (--max-requests-per-key)", "rate_limit_exceeded")
            if total + n > self.max_requests:
                raise Refused(503, f"{total} choices are running; the server takes at most "
                              f"{self.max_requests} (--max-requests)", "server_busy")
            self._running[principal] = mine + n

    def leave(self, principal: int, n: int) -> None:
        with self._lock:
            self._running[principal] -= n
            if not self._running[principal]:
                del self._running[principal]
            if not self._running:
                self._idle.notify_all()

    def run(self, job: Job) -> Run:
        """Run one choice to its end (blocks): its Run, with generated tokens, cached
        prompt tokens and whether it stopped on end-of-generation."""
        base = self.base
        agent = Agent(f"req{next(self._ids)}", base.model_name, base.path, len(job.tokens) + job.max_tokens + 1,
                      base.loaded, base.estimate, base.file, owner=job.principal, want=list(job.tokens),
                      exact=self.exact, decoded=True)
        run = Run(agent, job.principal, "", job.max_tokens, job.cancelled.is_set, sampling=job.sampling,
                  top_logprobs=job.top_logprobs, on_token=job.on_token)
        try:
            self.conductor.scheduler.submit(run)
        except Stopping:
            run.error = Stopping()
        if isinstance(run.error, Stopping):
            raise Refused(503, "the server is stopping; this request was not run", "server_stopping")
        if isinstance(run.error, ConductorError):
            raise Refused(400, str(run.error), run.error.code.lower())
        if run.error is not None:
            raise run.error
        return run

    def close(self, grace_s: float = 5.0) -> None:
        """Stop: new requests get 503; with a conductor of its own, queued ones are refused
        and running ones cancelled after grace_s, then everything is freed. On lmxd's, the
        running requests end first (they are refused once the daemon stops) and the pool's
        booking is released."""
        with self._lock:
            self.stopping = True
        if self.store is not None:
            self.store.flush()              # prefixes captured are written before we go
        if self.memory is None:
            with self._idle:
                self._idle.wait_for(lambda: not self._running)
            sched = self.conductor.scheduler
            sched.call(lambda: sched.drop([k for k in sched.pools if k[2]]))    # the served pools
            self.conductor._leave(self.base)
            return
        self.conductor.shutdown(grace_s)
        self.conductor.close()
        self.memory.close()
