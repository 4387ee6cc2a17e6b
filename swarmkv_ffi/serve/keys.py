"""API keys and the owners they stand for.

Each key is one owner, the conductor's name for the party a request belongs to (a uid on
lmxd's socket): the fair share, the in-flight quota and cache isolation are per owner.
Keys' owners are numbered from OWNER_BASE, above every 32-bit uid, so that under lmxd
--http they never collide with a user of the socket. Without keys every request is the
one owner OPEN (the server then listens on loopback only, unless told).
A key file holds one key per line, optionally followed by a name used in logs;
blank lines and lines starting with # are skipped.
"""
from __future__ import annotations

import asyncio
import hmac
from pathlib import Path

OWNER_BASE = 1 << 40
OPEN = OWNER_BASE

#: Requests of one key read, parsed and tokenized at once (Gates).
PREPARING_PER_KEY = 2


class Keys:
    def __init__(self, keys: dict[str, str] | None = None):
        self._keys = list((keys or {}).items())      # key -> name, in order

    @classmethod
    def from_file(cls, path: Path) -> "Keys":
        keys = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, name = line.partition(" ")
            if len(key) < 8:
                raise ValueError(f"{path}:{n}: an API key must be at least 8 characters")
            if key in keys:
                raise ValueError(f"{path}:{n}: this key appears twice")
            keys[key] = name.strip() or f"key{len(keys) + 1}"
        if not keys:
            raise ValueError(f"{path} holds no key")
        return cls(keys)

    def mapping(self) -> dict[str, str]:
        """key -> name, in order (the same owners when another process rebuilds it)."""
        return dict(self._keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def owner(self, authorization: str | None) -> int | None:
        """The owner of an `Authorization: Bearer KEY` header, or None. Every key is
        compared in constant time, so the answer's time tells nothing of the keys."""
        if not self._keys:
            return OPEN
        given = bearer(authorization)
        found = None
        for i, (key, _) in enumerate(self._keys):
            if hmac.compare_digest(given, key.encode()):
                found = OWNER_BASE + 1 + i
        return found

    def key_of(self, owner: int) -> bytes | None:
        """The API key `owner` stands for (None: the open server's one owner)."""
        return None if owner == OPEN else self._keys[owner - OWNER_BASE - 1][0].encode()

    def name(self, owner: int) -> str:
        return "open" if owner == OPEN else self._keys[owner - OWNER_BASE - 1][1]


class Gates:
    """Each owner's gate to read, parse and tokenize a request: PREPARING_PER_KEY at a time,
    the rest wait with their bodies unread (in the socket, not in memory), so one key's
    large bodies hold at most that many bodies and worker threads. The single server's
    routes and the Ray ingress each keep one (made on the event loop that uses it)."""

    def __init__(self):
        self._gates: dict[int, asyncio.Semaphore] = {}

    def of(self, owner: int) -> asyncio.Semaphore:
        if owner not in self._gates:
            self._gates[owner] = asyncio.Semaphore(PREPARING_PER_KEY)
        return self._gates[owner]


def presented(headers) -> str | None:
    """The credential a request carries, as an Authorization header: OpenAI's clients send
    `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY` (either is taken)."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key") is not None:
        return f"Bearer {headers.get('x-api-key')}"
    return authorization


def bearer(authorization: str | None) -> bytes:
    """The token of an `Authorization: Bearer TOKEN` header (empty without one)."""
    return (authorization or "").removeprefix("Bearer ").strip().encode()
