"""Responses kept for `previous_response_id` (the Responses API's `store`), per API key.

A stored response keeps the conversation it ended (its input and its output, as chat
messages, without `instructions`: OpenAI does not carry those over), so the next turn
names it instead of sending the conversation again. Its tokens need no store here: the
turn's sequence stays in the model's pool as the key's own kept prefix (and, evicted,
in the host or disk tier), and the next turn, rendered from this conversation, starts
with those tokens and forks them.

Bounded three ways, each per key, so one key cannot grow the server or push out
another's: at most `max_entries` responses, at most `max_bytes` of their text (the least
recently used go first), and each is forgotten `ttl` seconds after it was made or last
used. A key asking for another key's response id is told it does not exist, as for an
id never made: ids are random, and a lookup says nothing of other keys.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    messages: list[dict]          # the conversation so far (chat messages), output included
    response: dict                # the response object as it was answered (GET /v1/responses/{id})
    nbytes: int
    used: float


class StoredResponses:
    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20, ttl: float = 3600.0,
                 clock=time.monotonic):
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._lock = threading.Lock()
        self._by_owner: dict[int, OrderedDict[str, Stored]] = {}

    def put(self, owner: int, response_id: str, messages: list[dict], response: dict) -> None:
        """Keep `owner`'s response; older ones of the key's go past its bounds. A
        conversation larger than the key's whole budget is not kept."""
        nbytes = len(json.dumps(messages)) + len(json.dumps(response))
        if self.max_entries <= 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            mine = self._by_owner.setdefault(owner, OrderedDict())
            self._expire(mine)
            mine[response_id] = Stored(messages, response, nbytes, self.clock())
            while len(mine) > self.max_entries or sum(s.nbytes for s in mine.values()) > self.max_bytes:
                mine.popitem(last=False)

    def get(self, owner: int, response_id: str) -> Stored | None:
        """`owner`'s response of that id (now the most recently used), or None."""
        with self._lock:
            mine = self._by_owner.get(owner)
            if mine is None:
                return None
            self._expire(mine)
            found = mine.get(response_id)
            if found is not None:
                found.used = self.clock()
                mine.move_to_end(response_id)
            return found

    def delete(self, owner: int, response_id: str) -> bool:
        with self._lock:
            return self._by_owner.get(owner, {}).pop(response_id, None) is not None

    def count(self, owner: int | None = None) -> int:
        with self._lock:
            return sum(len(m) for o, m in self._by_owner.items() if owner is None or o == owner)

    def _expire(self, mine: OrderedDict) -> None:
        """Drop the key's entries unused for ttl (oldest first: the dict is in use order)."""
        limit = self.clock() - self.ttl
        while mine and next(iter(mine.values())).used < limit:
            mine.popitem(last=False)
