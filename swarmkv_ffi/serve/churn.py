"""Model churn charged to the key that causes it.

Where memory holds fewer models than the keys ask for, loading one unloads another
(loading.py). Unloading a model that other keys are using costs them its reload and
every prefix it had cached, so one key's 1-token requests to model B before each of a
victim's requests to model A made the victim wait for A's reload every time (p50
0.04 s -> 1.50 s) and paid nothing. Now:

- a load that unloads a model another key used within `window` seconds *displaces* it,
  and the key whose request asked for the load pays: each key may displace once per
  window; past it, its request is refused (429, saying how long to wait) instead of
  queued;
- a model displaced within the window comes back for free, whoever asks: its users do
  not pay for the churn another key caused;
- a model only the asking keys used, or nobody used within the window, unloads as
  before, for free (one user alternating models never pays).
"""
from __future__ import annotations

import math
from collections.abc import Iterable


class Churn:
    """Who has displaced what, and when (time.monotonic seconds)."""

    def __init__(self, window: float):
        self.window = window
        self.paid: dict[int | None, float] = {}       # key -> when it last displaced a model
        self.displaced: dict[str, float] = {}         # model -> when a displacement unloaded it

    def payer(self, model: str, victim_users: dict, asking: Iterable, now: float,
              paying=None) -> tuple[bool, object]:
        """May loading `model` for the keys `asking` unload a model whose users (key -> last
        use) are `victim_users`? (True, None): free; (True, key): that key pays; (False,
        None): every asking key has displaced within the window. `paying`: the key already
        charged for this load, which pays for every model the load unloads."""
        asking = set(asking)
        others = [k for k, t in victim_users.items() if k not in asking and now - t < self.window]
        if not others or now - self.displaced.get(model, -math.inf) < self.window:
            return True, None
        if paying is not None:
            return True, paying
        for key in sorted(asking, key=lambda k: self.paid.get(k, -math.inf)):
            if now - self.paid.get(key, -math.inf) >= self.window:
                return True, key
        return False, None

    def charge(self, key, victim: str, now: float) -> None:
        self.paid[key] = now
        self.displaced[victim] = now

    def wait_s(self, asking: Iterable, now: float) -> float:
        """Seconds until one of the asking keys may displace again."""
        return max(0.0, min((self.paid.get(k, -math.inf) + self.window - now for k in asking), default=0.0))
