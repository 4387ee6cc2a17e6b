"""Shared prefixes on disk: a restarted server answers a known document without prefilling it.

A tier.PrefixTier on the file store (files.py). Two kinds of
prefix come here, each captured on the scheduler's thread and written by a thread of its
own, keyed by the model, the pool's KV layout, the tokens and the owner's API key (a name
derived from it, `_signature`):
- a prefix the pool evicts, or that its host-RAM tier lets go (host.py), which
  would otherwise be prefilled again;
- a prefix of DISK_MIN tokens or more that a request forks from another request's
  cells: one that requests share (a document, a system prompt, a conversation's opening).
A request whose pool holds less than DISK_MIN tokens of its prompt looks for the longest
stored prefix of it, of its own owner, and restores it instead of decoding it, as long as
the disk has proved cheaper per token than prefilling (`Costs`).

A store that fails (a full disk, a read-only folder) logs one line and the server goes
on; a corrupt entry is dropped by the cache with a notice. Nothing here can fail a request.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from ..errors import SwarmKVError, describe
from ..snapshot import Snapshot, context_signature, tokens_hash
from .costs import Costs
from .files import PrefixCache
from .thresholds import DISK_MIN

log = logging.getLogger("swarmkv.serve")


class DiskTier:
    """tier.PrefixTier on a PrefixCache, with a writer thread of its own."""
    min_tokens = DISK_MIN

    def __init__(self, cache: PrefixCache, key_of: Callable[[int], bytes | None]):
        self.cache = cache
        self._key_of = key_of        # owner -> its API key (None: no keys)
        self._stored: set[tuple[int, str]] = set()          # (owner, tokens hash) written or queued
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self.costs = Costs()                                 # seconds a token, lookup and restore
        self._thread = threading.Thread(target=self._write, name="serve-prefix-store", daemon=True)
        self._thread.start()

    def _signature(self, ctx, owner: int) -> dict:
        """Entries are signed with a name derived from the owner's API key and the
        folder's secret, never with the owner's number: that is the key's place in the key
        file, and a reordered file (or another server on the folder) would hand one key's
        prefixes to another."""
        key = self._key_of(owner)
        return {**context_signature(ctx), "owner": "open" if key is None else self.cache.name_for(key)}

    def remember(self, owner: int, tokens: list[int], ctx, seq: int, n: int) -> None:
        """`seq` holds exactly tokens[:n], a prefix another request shared: store it once
        (on the scheduler's thread only the capture; the write is the writer's)."""
        tokens = tokens[:n]
        if n < DISK_MIN or (owner, tokens_hash(tokens)) in self._stored or self._queue.full():
            return
        try:
            snap = Snapshot.capture(ctx, seq, tokens)
        except SwarmKVError as exc:
            log.warning("prefix store: capture of %d tokens failed (%s); answers are unaffected", n, describe(exc))
            return
        self.keep(owner, snap, ctx)

    def evicted(self, owner: int, tokens: list[int], ctx, seq: int) -> None:
        """The pool drops `seq` (no host tier above this store): store what it held."""
        self.remember(owner, tokens, ctx, seq, len(tokens))

    def keep(self, owner: int, snapshot: Snapshot, ctx) -> None:
        """Queue `snapshot` for the disk, once per owner and tokens (dropped if the writer
        is four behind: the disk is a cache, never a wait)."""
        ident = (owner, snapshot.header.tokens_hash)
        if snapshot.header.n_tokens < DISK_MIN or ident in self._stored or self._queue.full():
            return
        self._stored.add(ident)
        self._queue.put((snapshot, self._signature(ctx, owner)))

    def recall(self, owner: int, tokens: list[int], ctx, seq: int, more_than: int, spare: int = 0,
               prefill_s: float | None = None) -> tuple[int, str | None]:
        """Restore into the empty `seq` the longest stored prefix of `tokens` (all but the
        last) of `owner`'s, if longer than `more_than` and the disk has been cheaper than
        prefilling (a lookup reads the file: the choice is made by rates, before it)."""
        if len(tokens) <= DISK_MIN or not self.costs.cheaper(1, 1, prefill_s):
            return 0, None
        t0 = time.perf_counter()
        try:
            snap = self.cache.lookup(ctx.model.fingerprint, self._signature(ctx, owner), tokens[:-1])
            if snap is None or snap.header.n_tokens <= more_than:
                return 0, None
            snap.restore(ctx, seq)
        except (SwarmKVError, OSError) as exc:
            log.warning("prefix store: lookup failed (%s); decoding the prompt instead", describe(exc))
            return 0, None
        self.costs.observe(snap.header.n_tokens, time.perf_counter() - t0)
        self._stored.add((owner, tokens_hash(tokens[:snap.header.n_tokens])))
        return snap.header.n_tokens, "disk"

    def _write(self) -> None:
        while True:
            snap, signature = self._queue.get()
            try:
                self.cache.offer([snap], signature, head=f"{snap.header.n_tokens} tokens (swarmkv serve)")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued prefix is written (tests, a clean stop)."""
        self._queue.join()
