"""The served models: requests of API keys' owners run on a conductor's request pools.

The server runs on an lmxd Conductor (ledger, scheduler, fair policy): its own for
`swarmkv serve`, lmxd's for `lmxd --http`. Each model it serves (lineup.py) gets a
RequestPool (conductor/requests.py, through hosted.py), which loads the model and books
its weights and every cell in the ledger, once: at start for each `--model`, on its
first request for the others, which are unloaded again when idle (loading.py). Each
choice of a request is submitted to the pool of the model it names, as the request's
owner's; the pool forks the longest prefix it already holds and decodes the rest with
the others in one batch. This module adds what only an HTTP server has: a cap on
choices in flight per key and in all (every model's together), a stopping state, and
the disk store below every pool (--cache-dir, kvcache/disk.py). The routes (routes.py) turn
bodies into Jobs and results into responses.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..conductor import Conductor, DeviceMemory, Ledger, Policy, Request, RequestResult
from ..kvcache.files import PrefixCache
from .errors import Refused, refused
from . import sizing
from .hosted import HostedModel
from .keys import Keys
from .loading import Loadable, Loader, Use
from .metrics import Tally
from ..kvcache.disk import DiskTier
from .settings import Settings


@dataclass
class Job:
    """One choice of one request, to the loaded `model`. on_token(token,
    logprobs) runs on the scheduler's thread after each generated token and returns False
    to end the choice there (a stop string)."""
    model: HostedModel
    owner: int
    tokens: list[int]
    max_tokens: int
    on_token: Callable[[int, object], bool]
    sampling: dict = field(default_factory=dict)
    top_logprobs: int | None = None
    grammar: object = None             # the output follows it: a grammar's text, or grammar.Compiled
    on_prompt: Callable[[int, int], None] | None = None   # (prompt tokens in cells, forked) per chunk but the last
    cancelled: threading.Event = field(default_factory=threading.Event)   # the client left
    stopped: bool = False              # cancelled because the server stops (engine.drain)
    request: Request | None = None     # once submitted: how much of the prompt was cached


class ServeEngine:
    """The `--model`s served to owners (API keys, `keys`), as `settings` say. conductor:
    lmxd's (lmxd --http), else one of its own with its own ledger (budget_bytes) and threads; there,
    one key alone gets whole n_batch steps, as llama-server's slots do, and between keys
    lmxd's fair step cap applies."""

    def __init__(self, settings: Settings, keys: Keys, *, threads: int | None = None,
                 budget_bytes: int | None = None, conductor: Conductor | None = None, batch_size: int = 512):
        self.settings = settings
        self.memory = None if conductor is not None else DeviceMemory(budget_bytes=budget_bytes)
        self.conductor = conductor or Conductor(Ledger(self.memory.budget), n_threads=threads,
                                                policy=Policy(lone_step_seconds=None), n_batch=batch_size)
        self.models = Loader(settings.specs(), self._open, shared=len(keys.mapping()) > 1,
                             churn_window=settings.model_churn_window)
        self.host_bytes = sizing.host_cache_bytes(settings.host_cache_mib) // len(self.models.entries)
        try:
            cache = PrefixCache.open_optional(settings.cache_dir) if settings.cache_dir is not None else None
            self.disk = DiskTier(cache, keys.key_of) if cache is not None else None
            self.models.start()
        except BaseException:
            self.models.stop()               # what opened before the failure is booked no more
            if self.memory is not None:
                self.conductor.shutdown(0)
                self.conductor.close()
                self.memory.close()
            raise
        self.max_requests, self.max_per_owner = settings.max_requests, settings.per_key(len(keys.mapping()))
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # notified when no choice is in flight
        self._running: dict[int, int] = {}      # owner -> choices in flight
        self._job_of: dict[int, Job] = {}        # id -> each Job running, for wait_drained()
        self.tally = Tally()                     # each key's request and token counters (/metrics)
        self.started_unix = int(time.time())     # /metrics' Process-Start-Time-Unix, as llama-server's
        self.stopping = False

    def _open(self, spec) -> HostedModel:
        """Load and book one model's pool (the loader's thread, or start)."""
        return HostedModel.open(self.conductor, spec, self.settings, self.disk, self.host_bytes)

    def resolve(self, name: str | None) -> str:
        """The id of the model a request names: that id if served; on a server of one
        model, that model whatever the request names (or when it names none), as
        llama-server answers; else a 404 in OpenAI's words naming those served."""
        if name in self.models.named:
            return name
        if len(self.models.named) == 1:
            return next(iter(self.models.named))
        if name is None:
            raise Refused(400, f"model: name one of the models served: {', '.join(self.models.named)}",
                          "model_required", "model")
        raise Refused(404, f"The model `{name}` does not exist; this server serves "
                      f"{', '.join(f'`{n}`' for n in self.models.named)}", "model_not_found", "model")

    def model_named(self, name: str | None) -> Loadable:
        """The model a request names (resolve())."""
        return self.models.named[self.resolve(name)]

    async def use(self, owner: int, name: str | None, keep_alive: float | None = None) -> Use:
        """Hold the model clients call `name` loaded for one of owner's requests (loading
        it first, the request queued meanwhile, counted as one choice in flight of its
        key's: a key cannot pile up waiting bodies). 404 for a name not served, 429/503 as
        admit(), the load's error if it fails. Release the Use when the request has ended."""
        entry = self.model_named(name)
        self.admit(owner, 1)
        try:
            return await self.models.use(entry, keep_alive, owner)
        finally:
            self.leave(owner, 1)

    def bounds(self) -> list[tuple[int, int]] | None:
        """(max context, longest token's characters) of every model served, or None while
        some model has never been loaded (what its vocabulary holds is not known yet)."""
        known = [e.bounds for e in self.models.entries]
        return None if None in known else known

    def admit(self, owner: int, n: int) -> None:
        """Count n choices in flight for owner, or refuse (400: more than a key may ever
        run at once, so retrying cannot help; 429: over its share now; 503: the server is
        full or stopping). Pair with leave()."""
        if n > min(self.max_per_owner, self.max_requests):
            raise Refused(400, f"this request asks for {n} choices (n x prompts); a key may run at most "
                          f"{min(self.max_per_owner, self.max_requests)} at once (--max-requests-per-key, "
                          "--max-requests): split it", "too_many_choices", "n")
        with self._lock:
            if self.stopping:
                raise Refused(503, "the server is stopping", "server_stopping")
            mine, total = self._running.get(owner, 0), sum(self._running.values())
            if mine + n > self.max_per_owner:
                raise Refused(429, f"this key has {mine} choices running; the limit per key is "
                              f"{self.max_per_owner} (--max-requests-per-key)", "rate_limit_exceeded")
            if total + n > self.max_requests:
                raise Refused(503, f"{total} choices are running; the server takes at most "
                              f"{self.max_requests} (--max-requests)", "server_busy")
            self._running[owner] = mine + n

    def in_flight(self, owner: int | None = None) -> int:
        """Choices admitted and not ended: owner's, or (None) everyone's."""
        with self._lock:
            return sum(self._running.values()) if owner is None else self._running.get(owner, 0)

    def leave(self, owner: int, n: int) -> None:
        with self._lock:
            self._running[owner] -= n
            if not self._running[owner]:
                del self._running[owner]
            if not self._running:
                self._idle.notify_all()

    def run(self, job: Job) -> RequestResult:
        """Run one choice to its end (blocks): its generated tokens, the prompt tokens it
        forked and whether it stopped on end-of-generation; a Refused if it cannot run
        (or the server stopped it: drain)."""
        with self._lock:
            self._job_of[id(job)] = job
        try:
            job.request = job.model.pool.submit(job.owner, job.tokens, job.max_tokens, sampling=job.sampling,
                                                top_logprobs=job.top_logprobs, on_token=job.on_token,
                                                cancelled=job.cancelled, grammar=job.grammar,
                                                on_prompt=job.on_prompt)
            result = job.request.result()
        except Exception as exc:
            raise refused(exc) from None
        finally:
            with self._lock:
                self._job_of.pop(id(job), None)
        if job.stopped:
            raise Refused(503, "the server stopped before this request ended", "server_stopping")
        return result

    def drain(self) -> None:
        """Take no new request (503; /health says draining); running ones go on."""
        with self._lock:
            self.stopping = True

    def wait_drained(self, grace_s: float) -> bool:
        """After drain(): wait up to grace_s for the running choices to end, then end the
        rest with an error (a stream gets it as its last event) and wait for them to roll
        back. True when every choice ended within grace_s."""
        with self._idle:
            if self._idle.wait_for(lambda: not self._running, timeout=grace_s):
                return True
            for job in self._job_of.values():
                job.stopped = True
                job.cancelled.set()
            self._idle.wait_for(lambda: not self._running, timeout=30)
        return False

    def close(self, grace_s: float = 5.0) -> None:
        """Stop: new requests get 503; with a conductor of its own, queued ones are refused
        and running ones cancelled after grace_s, then everything is freed. On lmxd's, the
        running requests end first (they are refused once the daemon stops) and the pool's
        booking is released."""
        self.drain()
        if self.disk is not None:
            self.disk.flush()               # prefixes captured are written before we go
        if self.memory is None:
            with self._idle:
                self._idle.wait_for(lambda: not self._running)
            self.models.stop()              # (lmxd's ledgers are the daemon's to book again)
            return
        self.models.stop_loading()
        self.conductor.shutdown(grace_s)
        self.conductor.close()
        self.memory.close()
