"""What a copy of KV costs, learnt as it happens: the measure every tier restores by."""
from __future__ import annotations


class Costs:
    """Seconds per token of copying KV between the pool and host RAM or disk (a tier's
    restores, a preempted request's swap), learnt from its own copies (each older one
    weighs FORGET times less). Before the first, copying is assumed cheaper than
    prefilling: its first use measures it."""
    FORGET = 0.8

    def __init__(self):
        self._tokens = self._seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self._tokens = self._tokens * self.FORGET + tokens
        self._seconds = self._seconds * self.FORGET + seconds

    def per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens else None

    def cheaper(self, restored: int, saved: int, prefill_s: float | None) -> bool:
        """Whether restoring `restored` tokens beats prefilling the `saved` tokens it spares,
        at prefill_s seconds a token (None: not measured yet)."""
        mine = self.per_token()
        return mine is None or prefill_s is None or mine * restored < prefill_s * saved
