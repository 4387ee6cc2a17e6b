"""Requests as short-lived agents on lmxd's engine.

The server owns one lmxd Conductor (ledger, scheduler, fair policy) over one model. At
start it registers a base agent whose n_ctx is the whole pool (`--ctx-size` cells): that
loads the model and books its weights and every cell in the ledger, once. Each request
choice then becomes an Agent of the base's model, of the request's principal, whose
`want` is its prompt's tokens; the scheduler seats it in the pool, where it forks the
longest prefix the pool already holds (kept.py) and decodes the rest with the others in
one batch, and when it ends its cells stay as cache. The HTTP front (app.py) only turns
bodies into Jobs and events into responses.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..conductor.agents import Agent, Conductor, ConductorError
from ..conductor.ledger import Ledger
from ..conductor.memory import DeviceMemory
from ..conductor.policy import Policy
from ..conductor.pool import MAX_SEQS, Pool
from ..conductor.scheduler import Run, Stopping

BASE_ID = "serve"


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


class ServeConductor(Conductor):
    """lmxd's conductor with the server's pools: fixed in size, and keeping a finished
    request's cells as cache instead of freeing them."""

    def __init__(self, *args, cells: int, seqs: int, share_prefixes: bool, **kw):
        super().__init__(*args, **kw)
        self.pool_size, self.share_prefixes = (cells, seqs), share_prefixes

    def open_pool(self, key, loaded) -> Pool:
        return Pool(key, loaded, new_context=self._new_context, pause=self._pause,
                    keep_prefix=self._keep_prefix, drop_saved=self._drop_saved,
                    fixed=self.pool_size, share_kept=self.share_prefixes)

    def begin(self, run: Run) -> None:
        """The request's tokens after what its seat forked."""
        agent = run.agent
        run.cached = len(agent.history)
        run.prompt_tokens, run.feed = len(agent.want), agent.want[len(agent.history):]
        run.n_history, run.pending, run.began = len(agent.history), None, True

    def finished(self, run: Run) -> None:
        pool = self.scheduler.live
        if pool is not None and pool.is_open and pool.key == run.pool_key:
            pool.keep(run.agent)
        self._drop_saved(run.agent)


class ServeEngine:
    """One model served to principals (API keys). `cells`: the pool's KV cells, all
    requests and the cache together; `seqs`: sequences (requests running plus kept)."""

    def __init__(self, model: str, *, cells: int = 32768, seqs: int = 64, threads: int | None = None,
                 exact: bool = False, share_prefixes: bool = False, budget_bytes: int | None = None,
                 max_requests: int = 256, max_per_principal: int = 64, policy: Policy | None = None):
        if not 2 <= seqs <= MAX_SEQS - 1:
            raise ValueError(f"--parallel must be in 2..{MAX_SEQS - 1}, got {seqs}")
        self.memory = DeviceMemory(budget_bytes=budget_bytes)
        self.conductor = ServeConductor(Ledger(self.memory.budget), n_threads=threads, cells=cells, seqs=seqs,
                                        share_prefixes=share_prefixes, policy=policy)
        try:
            self.base = self.conductor.register(BASE_ID, model, n_ctx=cells)
        except BaseException:
            self.memory.close()
            raise
        # The base agent never decodes: its REGISTER must not make the first requests
        # look as if another user shared the device (their steps would be kept short).
        self.conductor.scheduler.policy.forget(self.base.owner)
        self.model = self.base.loaded.model
        self.cells, self.exact = cells, exact
        self.max_requests, self.max_per_principal = max_requests, max_per_principal
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
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
        """Stop: new requests get 503, queued ones are refused, running ones cancelled
        after grace_s; then free the model."""
        with self._lock:
            self.stopping = True
        self.conductor.shutdown(grace_s)
        self.conductor.close()
        self.memory.close()
