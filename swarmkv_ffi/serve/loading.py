"""Models loaded on demand under the memory ledger, unloaded when idle.

Every pool the server may serve (one or more model ids naming it, lineup.py) is a
Loadable: unloaded, loading, loaded or failed. A request takes a Use of its model
(Loader.use): at once when it is loaded, else it waits, queued, while the loader's
thread loads it. Loading books the model's measured estimate in the ledger before it
reads a byte (conductor.register); when the ledger has no room, the loader unloads the
least recently used idle model (no request running or waiting, not pinned) and tries
again, and with none idle it drains the least used busy one (its running requests end,
its new ones wait) and unloads it. A model idle past its keep_alive is unloaded by the
same thread. Loads and unloads happen on that thread
only: a request for a loaded model never waits for another model's load.

A load that fails (a crafted file, a budget too small for the model) is that model's
error: its waiting requests get it, the other models go on; the next request for it
tries again (the file may have been replaced). A load that would unload a model other
keys are using is charged to a key that asked for it (churn.py); when every asking key
has had its turn in the window, the load is refused to them (429).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time

from ..conductor import LedgerDenied
from .churn import Churn
from .errors import Refused
from .hosted import HostedModel
from .lineup import FOREVER, ModelSpec, pools

log = logging.getLogger(__name__)

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"
ROOM_WAIT_S = 0.5         # how often a load waiting for room looks again (besides being notified)


class Loadable:
    """One pool the server may serve, under every id that names it, and its state."""

    def __init__(self, specs: list[ModelSpec]):
        self.spec, self.names = specs[0], [s.name for s in specs]
        self.state = UNLOADED
        self.hosted: HostedModel | None = None
        self.error: Refused | None = None      # why the last load failed
        self.failures = 0                      # loads that failed, ever
        self.uses = 0                          # requests holding it loaded
        self.waiting = 0                       # requests waiting for it to load
        self.owed = 0                          # requests that waited for its load, not yet served
        self.expires = FOREVER                 # when it is unloaded if still idle (time.monotonic)
        self.last_used = 0.0
        self.used_by: dict = {}                # key -> when it last took or released a Use
        self.waiting_by: collections.Counter = collections.Counter()   # key -> its requests waiting
        self.paid_by = None                    # the key charged for the load under way (churn.py)
        self.loads = self.unloads = 0
        self.bounds: tuple[int, int] | None = None   # (max_context, longest token's chars) once loaded
        self.wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def idle(self) -> bool:
        """Loaded and wanted by no request: it may be unloaded."""
        return self.state == LOADED and self.uses == 0 and self.waiting == 0


class Use:
    """A request's hold on its loaded model; release() once, when the request has ended,
    with the request's keep_alive (None: the model's)."""

    def __init__(self, loader: "Loader", entry: Loadable, keep_alive: float | None, owner=None):
        self.loader, self.entry, self.keep_alive, self.owner = loader, entry, keep_alive, owner
        self.hosted = entry.hosted
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.loader.release(self.entry, self.keep_alive, self.owner)


class Loader:
    """Every pool the server may serve (from `specs`), opened by `open_hosted(spec)`;
    the thread that loads and unloads them. `shared`: several API keys use the server,
    so a request's keep_alive may keep a model longer than its own, never shorter (else
    one key's keep_alive 0 would throw away every key's cached prefixes, and time its
    reloads to learn when the others ask). `churn_window`: churn.py's window, seconds."""

    def __init__(self, specs: list[ModelSpec], open_hosted, shared: bool = False, churn_window: float = 60.0):
        self.entries = [Loadable(group) for group in pools(specs)]
        self.named = {name: entry for entry in self.entries for name in entry.names}
        self._open, self.shared = open_hosted, shared
        self.churn = Churn(churn_window)
        self._cond = threading.Condition()
        self._queue: collections.deque[Loadable] = collections.deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="serve-loader")

    def start(self) -> None:
        """Load the models that load at start (raising the first failure), then start the
        loader's thread."""
        for entry in self.entries:
            if entry.spec.at_start:
                self._opened(entry, self._open(entry.spec))
        self._thread.start()

    def loaded(self) -> list[tuple[str, HostedModel]]:
        """(its first id, the model) of each model loaded now."""
        with self._cond:
            return [(e.names[0], e.hosted) for e in self.entries if e.state == LOADED]

    # ---- a request's side --------------------------------------------------------------------
    async def use(self, entry: Loadable, keep_alive: float | None = None, owner=None) -> Use:
        """Hold `entry` loaded for one of `owner`'s requests: at once if it is, else after
        the loader has loaded it (the request waits meanwhile, costing no thread). Raises
        the load's Refused if the load this request waited for failed."""
        loop = asyncio.get_running_loop()
        with self._cond:
            failures = entry.failures
            entry.waiting += 1
            entry.waiting_by[owner] += 1
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        raise Refused(503, "the server is stopping", "server_stopping")
                    if entry.state == LOADED:
                        entry.uses += 1
                        entry.owed = max(0, entry.owed - 1)
                        entry.used_by[owner] = time.monotonic()
                        self._cond.notify_all()
                        return Use(self, entry, keep_alive, owner)
                    if entry.state == FAILED and entry.failures > failures:
                        raise entry.error
                    if entry.state in (UNLOADED, FAILED):
                        entry.state = LOADING
                        self._queue.append(entry)
                        self._cond.notify_all()
                    woken = loop.create_future()
                    entry.wakers.append((loop, woken))
                try:
                    await woken
                finally:
                    with self._cond:
                        if (loop, woken) in entry.wakers:
                            entry.wakers.remove((loop, woken))
        finally:
            with self._cond:
                entry.waiting -= 1
                entry.waiting_by[owner] -= 1
                if not entry.waiting_by[owner]:
                    del entry.waiting_by[owner]
                entry.owed = min(entry.owed, entry.waiting)     # one that gave up is owed nothing
                self._cond.notify_all()

    def release(self, entry: Loadable, keep_alive: float | None, owner=None) -> None:
        """A request of `owner`'s is done with `entry`: the last one starts its keep_alive."""
        with self._cond:
            entry.uses -= 1
            entry.last_used = entry.used_by[owner] = time.monotonic()
            if entry.uses == 0:
                keep = entry.spec.keep_alive
                if keep_alive is not None:
                    keep = max(keep, keep_alive) if self.shared else keep_alive
                entry.expires = entry.last_used + keep
            self._cond.notify_all()

    # ---- the loader's thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                work = self._next()
            if work is None:
                return
            load, entry = work
            try:
                self._load(entry) if load else self._unload(entry)
            except Exception:                # a bug here must not leave every later request waiting
                log.exception("%s: %s failed", entry.spec.name, "loading" if load else "unloading")
                with self._cond:
                    self._failed(entry, Refused(500, f"the model `{entry.spec.name}` failed to "
                                                f"{'load' if load else 'unload'} (the server's log says why)",
                                                "model_load_failed", "model"))

    def _next(self) -> tuple[bool, Loadable] | None:
        """(True, a model to load) or (False, one past its keep_alive), waiting for either;
        None once stopping. Holds the lock."""
        while not self._stopping:
            if self._queue:
                return True, self._queue.popleft()
            now = time.monotonic()
            unloadable = [e for e in self.entries if e.idle and not e.spec.pinned and e.expires < FOREVER]
            first = min(unloadable, key=lambda e: e.expires, default=None)
            if first is not None and first.expires <= now:
                first.state = UNLOADING
                return False, first
            self._cond.wait(timeout=None if first is None else first.expires - now)
        return None

    def _load(self, entry: Loadable) -> None:
        """Open `entry`, unloading idle models for room while the ledger has none."""
        entry.paid_by = None
        while True:
            try:
                hosted = self._open(entry.spec)
            except LedgerDenied as exc:
                if self._make_room(entry, exc):
                    continue
                return
            except Exception as exc:        # the cause names the server's files: the log's, not the client's
                log.warning("%s: loading failed: %s", entry.spec.name, exc)
                with self._cond:
                    self._failed(entry, Refused(500, f"the model `{entry.spec.name}` failed to load (the "
                                                "server's log says why); the other models are served",
                                                "model_load_failed", "model"))
                return
            self._opened(entry, hosted)
            return

    def _make_room(self, entry: Loadable, denied: LedgerDenied) -> bool:
        """Unload the least recently used idle model; with none idle, drain the least used
        busy one (its new requests wait, queued, its running ones finish) and unload it,
        so that a model in steady use cannot keep another out forever: when memory does
        not fit both, they take turns. A model loaded for waiting requests serves them
        first (else two models asked at once would unload each other before either
        answered). A model others are using goes only at the cost of an asking key
        (churn.py); a model free to unload is preferred. False (the load failed) when
        nothing that may be unloaded is loaded, or when every asking key has displaced a
        model within the churn window."""
        with self._cond:
            while True:
                others = [e for e in self.entries if e is not entry and e.state == LOADED and not e.spec.pinned]
                if not others:
                    self._failed(entry, Refused(
                        503, f"the model `{entry.spec.name}` does not fit the memory budget beside the models "
                        f"that stay loaded ({denied})", "model_does_not_fit", "model"))
                    return False
                idle, served = [e for e in others if e.idle], [e for e in others if not e.owed]
                if idle or served:
                    now = time.monotonic()
                    fee = {e: self.churn.payer(entry.spec.name, e.used_by, entry.waiting_by, now, entry.paid_by)
                           for e in idle + served}
                    cost = lambda e: fee[e][1] is not None or not fee[e][0]      # noqa: E731 (free first)
                    victim = min(idle, key=lambda e: (cost(e), e.last_used)) if idle else \
                        min(served, key=lambda e: (cost(e), e.uses))
                    allowed, payer = fee[victim]
                    if not allowed:
                        return self._refuse_churn(entry, victim, now)
                    if payer is not None:
                        self.churn.charge(payer, victim.spec.name, now)
                        entry.paid_by = payer
                    break
                self._cond.wait(timeout=ROOM_WAIT_S)
                if self._stopping:
                    return False
            victim.state = UNLOADING
            while victim.uses and not self._stopping:
                self._cond.wait(timeout=ROOM_WAIT_S)
            if self._stopping:
                return False
        self._unload(victim, why=f"room for {entry.spec.name}")
        return True

    def _refuse_churn(self, entry: Loadable, victim: Loadable, now: float) -> bool:
        """Fail `entry`'s load with a 429 for its waiting requests: each of their keys
        unloaded a model others used within the churn window (the lock is held)."""
        wait = math.ceil(self.churn.wait_s(entry.waiting_by, now))
        self._failed(entry, Refused(
            429, f"the model `{entry.spec.name}` is not loaded, and loading it would unload "
            f"`{victim.spec.name}`, which other keys are using; this key unloaded a model they were using "
            f"less than {self.churn.window:g} s ago (--model-churn-window): retry in {wait} s",
            "model_churn", "model", retry_after=wait))
        return False

    def _opened(self, entry: Loadable, hosted: HostedModel) -> None:
        with self._cond:
            entry.hosted, entry.state, entry.loads = hosted, LOADED, entry.loads + 1
            entry.owed = entry.waiting
            entry.bounds = (hosted.max_context, hosted.longest_token)
            entry.expires = time.monotonic() + entry.spec.keep_alive    # loaded for nothing: not forever
            entry.last_used = time.monotonic()
            self._wake(entry)
        log.info("%s: loaded (%d cells)", entry.spec.name, hosted.cells)

    def _failed(self, entry: Loadable, error: Refused) -> None:
        """Its load failed with `error`, for the requests waiting on it (the lock is held)."""
        entry.state, entry.error, entry.failures = FAILED, error, entry.failures + 1
        self._wake(entry)

    def _unload(self, entry: Loadable, why: str = "keep_alive ran out") -> None:
        """Close `entry`'s pool (marked UNLOADING: no request holds or waits for it)."""
        entry.hosted.close()
        with self._cond:
            entry.hosted, entry.unloads = None, entry.unloads + 1
            entry.state = UNLOADED
            if entry.waiting:              # asked for while it went: load it again
                entry.state = LOADING
                self._queue.append(entry)
            self._cond.notify_all()
        log.info("%s: unloaded (%s)", entry.spec.name, why)

    def _wake(self, entry: Loadable) -> None:
        """Wake the requests waiting on `entry` (the lock is held)."""
        for loop, woken in entry.wakers:
            loop.call_soon_threadsafe(_settle, woken)
        entry.wakers.clear()
        self._cond.notify_all()

    def stop_loading(self) -> None:
        """Load and unload nothing more; requests waiting for a load get 503."""
        with self._cond:
            self._stopping = True
            for entry in self.entries:
                self._wake(entry)
        if self._thread.is_alive():
            self._thread.join()

    def stop(self) -> None:
        """stop_loading(), then close every loaded pool (no request runs)."""
        self.stop_loading()
        for entry in self.entries:
            if entry.hosted is not None:
                entry.hosted.close()
                entry.hosted, entry.state = None, UNLOADED


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
