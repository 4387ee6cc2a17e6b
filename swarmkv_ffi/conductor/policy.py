"""Who runs next and how many rows a step may carry: lmxd's scheduling policy, no llama calls.

The scheduler (scheduler.py) is the mechanism: it builds each step's batch, decodes and
samples. This module decides, from costs alone, so it can be tested with made-up ones:

- **Virtual time per user** (as Linux's CFS keeps a vruntime per task): each step's
  seconds are charged to the users in it by the batch rows each put in (a prompt chunk
  of 64 rows costs 64 times a decode row). The least-charged user goes first, and a
  user more than SLICE_SECONDS ahead of another user in the batch sits steps out until
  that one catches up.
- **A floor that never goes back** (CFS's min_vruntime): the least virtual time of the
  active users, kept while the daemon is idle. A user who arrives (no DECODE queued or
  running) is placed within [floor - IDLE_CREDIT, floor + SLICE_SECONDS]: a newcomer
  never starts at zero (it would take the device from everyone with history until it
  caught up), an occasional short request still runs ahead of a busy stream, and a
  user's own history neither banks credit nor counts against it for more than a slice.
- **A step budget** (as chunked-prefill schedulers cap a step's tokens): while two or
  more users share the device, a step may carry only as many rows as keep its predicted
  time within STEP_RATIO of a step of its decode rows alone, so one user's long prompt
  goes in chunk by chunk beside the others' decodes instead of as 512-row steps that
  stall them. The prediction is fitted on the pool's own recent steps (StepCost), so
  the budget follows the machine it runs on: no row count tuned on one CPU.
- **Growth per user**: a pool reopened larger for a user's new agents pauses everyone
  in it; a user may cause at most GROWS_PER_MINUTE such reopens a minute.
"""
from __future__ import annotations

import time
from collections import deque

SLICE_SECONDS = 0.25
IDLE_CREDIT = 0.5
#: A step beside other users' decodes may take at most this times a step of the decode
#: rows alone (predicted): another user's per-token time stays within it.
STEP_RATIO = 2.0
#: A user whose last DECODE ended this recently still counts as sharing the device: a
#: victim between two DECODEs must not meet a 512-row step when it comes back.
SHARING_WINDOW = 2.0
GROWS_PER_MINUTE = 4


class StepCost:
    """step seconds ~ base + per_row * rows, fitted by least squares on recent steps of
    one pool (each older step weighs FORGET times less)."""

    FORGET = 0.9

    def __init__(self):
        self._n = self._r = self._t = self._rr = self._rt = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        f = self.FORGET
        self._n = self._n * f + 1
        self._r = self._r * f + rows
        self._t = self._t * f + seconds
        self._rr = self._rr * f + rows * rows
        self._rt = self._rt * f + rows * seconds

    def model(self) -> tuple[float, float] | None:
        """(base, per_row) seconds, or None before any step. With steps of one size only,
        or a fit that makes no sense, time is taken as proportional to rows (base 0): the
        cautious reading, which gives the smallest budget."""
        if self._n == 0 or self._r <= 0:
            return None
        var = self._rr * self._n - self._r ** 2
        if var > 1e-9 * self._n ** 2:
            per_row = (self._rt * self._n - self._r * self._t) / var
            base = (self._t - per_row * self._r) / self._n
            if per_row > 0 and base >= 0:
                return base, per_row
            if per_row <= 0:
                return max(0.0, self._t / self._n), 0.0       # rows cost nothing more: no cap
        return 0.0, self._t / self._r

    def rows_within(self, ratio: float, decode_rows: int, limit: int) -> int:
        """Most rows whose predicted time is within `ratio` times that of `decode_rows`
        rows alone (one at least), never more than `limit`."""
        fit = self.model()
        floor = max(1, decode_rows)
        if fit is None:
            return min(limit, floor + 1)
        base, per_row = fit
        if per_row <= 0:
            return limit
        target = ratio * (base + per_row * floor)
        return max(floor, min(limit, int((target - base) / per_row + 1e-6)))


class Policy:
    """Virtual time, the floor, the step budget and growth limits of every user.
    step_tokens > 0 fixes the step budget at that many rows instead of STEP_RATIO."""

    def __init__(self, step_ratio: float = STEP_RATIO, step_tokens: int = 0, clock=time.monotonic):
        self.vtime: dict[int, float] = {}
        self.floor = 0.0
        self.step_ratio, self.step_tokens = step_ratio, step_tokens
        self._clock = clock
        self._seen: dict[int, float] = {}           # uid -> when it last had a DECODE
        self._grows: dict[int, deque] = {}

    # ---- virtual time ---------------------------------------------------------------------
    def arrive(self, uid: int, active: set[int]) -> None:
        """uid has a DECODE and had none queued or running; `active`: the users who do."""
        others = active - {uid}
        floor = min(self.key(u) for u in others) if others else self.floor
        own = self.vtime.get(uid, floor - IDLE_CREDIT)
        self.vtime[uid] = min(max(own, floor - IDLE_CREDIT), floor + SLICE_SECONDS)
        self.seen(uid)

    def charge(self, costs: dict[int, float], active: set[int]) -> None:
        """Add each user's seconds; the floor follows the least-charged active user up."""
        for uid, seconds in costs.items():
            self.vtime[uid] = self.vtime.get(uid, self.floor) + seconds
        if active:
            self.floor = max(self.floor, min(self.vtime.get(u, self.floor) for u in active))

    def key(self, uid: int) -> float:
        return self.vtime.get(uid, self.floor)

    def stepping(self, owners: set[int]) -> set[int]:
        """The users whose runs take this step: all, but those more than SLICE_SECONDS ahead
        of the least-charged user in it."""
        if len(owners) < 2:
            return set(owners)
        least = min(self.key(u) for u in owners)
        return {u for u in owners if self.key(u) <= least + SLICE_SECONDS}

    @staticmethod
    def by_rows(rows: dict[int, float], seconds: float) -> dict[int, float]:
        """A step's seconds split by the rows each user put in it."""
        total = sum(rows.values())
        return {uid: seconds * n / total for uid, n in rows.items()} if total else {}

    # ---- the step budget ------------------------------------------------------------------
    def seen(self, uid: int) -> None:
        self._seen[uid] = self._clock()

    def sharing(self, users: set[int]) -> bool:
        """Two or more users have DECODEs now or had one within SHARING_WINDOW."""
        now = self._clock()
        recent = {u for u, t in self._seen.items() if now - t < SHARING_WINDOW}
        return len(users | recent) >= 2

    def step_rows(self, cost: StepCost, decode_rows: int, n_batch: int, sharing: bool) -> int:
        """Rows the next step may carry: n_batch for one user alone; else the budget."""
        if not sharing:
            return n_batch
        if self.step_tokens > 0:
            return min(n_batch, max(decode_rows + 1, self.step_tokens))
        return max(decode_rows + 1, cost.rows_within(self.step_ratio, decode_rows, n_batch))

    # ---- growth ---------------------------------------------------------------------------
    def may_grow(self, uid: int) -> bool:
        """uid may cause another reopen of a pool larger (GROWS_PER_MINUTE a minute)."""
        recent = self._grows.setdefault(uid, deque())
        while recent and self._clock() - recent[0] > 60:
            recent.popleft()
        return len(recent) < GROWS_PER_MINUTE

    def grew(self, uid: int) -> None:
        self._grows.setdefault(uid, deque()).append(self._clock())
