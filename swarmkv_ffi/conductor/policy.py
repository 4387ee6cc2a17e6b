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
  running) starts at its own time, raised to floor - IDLE_CREDIT if below: a newcomer
  never starts at zero (it would take the device from everyone with history until it
  caught up), idleness banks no more than IDLE_CREDIT (an occasional short request
  still runs ahead of a busy stream), and a user who has used more than the others
  keeps that debt however often it stops and starts (its DECODEs sit steps out).
- **A step cap** (as chunked-prefill schedulers cap a step's tokens): while two or
  more users share the device, a step carries every decode row (or, with none, the
  shortest prompt) and only as many more prompt rows as keep its time within
  STEP_RATIO of a step of those alone, or as many as fill MAX_STEP_SECONDS if that is
  more, so one user's long prompt goes in chunk by chunk beside the
  others' decodes instead of as 512-row steps that stall them (and, where a decode step
  is short beside a prompt row's cost, as on a CPU, not a few rows a step: two keys of
  8 agents over a 1.6k-token document each took 1.9x their time alone twice over in
  1,300 steps of 3 prompt rows; with the floor, 1.16x in process, 1.15x / 1.11x
  through `swarmkv bench serve --scenarios keys`); one user alone gets
  steps of up to MAX_STEP_SECONDS, so whoever arrives waits for no more than that. Both come from the pool's own steps (StepCost: a fit
  of its decode-only steps, and the prompt rows steered by what shared steps really
  took), so the cap follows the machine and the context depth it runs at: no row
  count tuned on one CPU.
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
#: A user whose last DECODE ended (or who registered) this recently still counts as
#: sharing the device: a victim between two DECODEs must not meet a 512-row step when
#: it comes back.
SHARING_WINDOW = 2.0
#: One user alone still gets no step predicted longer than this: whoever arrives waits
#: for at most one such step. (On a CPU a prompt row costs about as much in a step of 64
#: rows as of 512, so this costs the lone user little.)
MAX_STEP_SECONDS = 0.25
GROWS_PER_MINUTE = 4


class StepCost:
    """What a step of one pool costs, learnt from its own steps: decode-only steps fit
    seconds ~ base + per_row * rows, and shared steps give what a prompt row adds beyond
    that (a prompt row deep in a long context costs far more than a decode row, so no
    single per-row figure would do). Least squares and ratios of sums in which each older
    step weighs FORGET times less."""

    FORGET = 0.9

    def __init__(self):
        self._n = self._r = self._t = self._rr = self._rt = 0.0
        self._extra = self._prompt = 0.0     # seconds beyond the decodes' prediction, prompt rows

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        f = self.FORGET
        if prompt_rows == 0:
            self._n = self._n * f + 1
            self._r = self._r * f + decode_rows
            self._t = self._t * f + seconds
            self._rr = self._rr * f + decode_rows * decode_rows
            self._rt = self._rt * f + decode_rows * seconds
            return
        alone = self.predict(decode_rows) if decode_rows else 0.0
        if alone is not None:
            self._extra = self._extra * f + max(0.0, seconds - alone)
            self._prompt = self._prompt * f + prompt_rows

    def predict(self, decode_rows: int) -> float | None:
        """Seconds of a step of `decode_rows` decode rows alone (one at least), or None
        before any. With steps of one size only, or a fit that makes no sense, time is
        taken as proportional to rows (the cautious reading for more rows)."""
        rows = max(1, decode_rows)
        if self._n == 0 or self._r <= 0:
            return None
        var = self._rr * self._n - self._r ** 2
        if var > 1e-9 * self._n ** 2:
            per_row = (self._rt * self._n - self._r * self._t) / var
            base = (self._t - per_row * self._r) / self._n
            if per_row >= 0 and base >= 0:
                return base + per_row * rows
        return rows * self._t / self._r

    def prompt_row_seconds(self) -> float | None:
        """What a prompt row adds to a step, in seconds (None before any): the price of
        prefilling a token, against which a tier's restore is weighed (kvcache/host.py)."""
        return self._extra / self._prompt if self._prompt and self._extra > 0 else None

    def rows_in(self, seconds: float, limit: int) -> int:
        """Prompt rows a step of one user may carry to last about `seconds` (all of
        `limit` while nothing is known yet)."""
        if self._prompt == 0 or self._extra <= 0:
            return limit
        return max(1, self.known_rows_in(seconds, limit))

    def known_rows_in(self, seconds: float, limit: int) -> int:
        """Prompt rows that add about `seconds` to a step; none while nothing is known."""
        if self._prompt == 0 or self._extra <= 0 or seconds <= 0:
            return 0
        return min(limit, int(seconds * self._prompt / self._extra))

    def rows_within(self, ratio: float, base_rows: int, limit: int) -> int:
        """Rows a shared step may carry: `base_rows` (the rows it must keep fast), and the
        prompt rows whose added time keeps it within `ratio` of those alone (one at least;
        one only, while nothing is known yet)."""
        alone = self.predict(base_rows)
        if alone is None or self._prompt == 0:
            return min(limit, base_rows + 1)
        per_prompt_row = self._extra / self._prompt
        if per_prompt_row <= 0:
            return limit
        return min(limit, base_rows + max(1, int((ratio - 1) * alone / per_prompt_row + 1e-6)))


class Policy:
    """Virtual time, the floor, the step cap and growth limits of every user.
    step_tokens > 0 fixes the step cap at that many rows instead of STEP_RATIO."""

    def __init__(self, step_ratio: float = STEP_RATIO, step_tokens: int = 0, clock=time.monotonic,
                 lone_step_seconds: float | None = MAX_STEP_SECONDS):
        self.vtime: dict[int, float] = {}
        self.floor = 0.0
        self.step_ratio, self.step_tokens = step_ratio, step_tokens
        self.lone_step_seconds = lone_step_seconds     # None: a user alone gets whole n_batch steps
        self._clock = clock
        self._seen: dict[int, float] = {}           # owner -> when it last had a DECODE
        self._grows: dict[int, deque] = {}

    # ---- virtual time ---------------------------------------------------------------------
    def arrive(self, owner: int, active: set[int]) -> None:
        """owner has a DECODE and had none queued or running; `active`: the users who do."""
        others = active - {owner}
        floor = min(self.key(u) for u in others) if others else self.floor
        self.vtime[owner] = max(self.vtime.get(owner, floor - IDLE_CREDIT), floor - IDLE_CREDIT)
        self.seen(owner)

    def charge(self, costs: dict[int, float], active: set[int]) -> None:
        """Add each user's seconds; the floor follows the least-charged active user up."""
        for owner, seconds in costs.items():
            self.vtime[owner] = self.vtime.get(owner, self.floor) + seconds
        if active:
            self.floor = max(self.floor, min(self.vtime.get(u, self.floor) for u in active))

    def key(self, owner: int) -> float:
        return self.vtime.get(owner, self.floor)

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
        return {owner: seconds * n / total for owner, n in rows.items()} if total else {}

    # ---- the step cap ------------------------------------------------------------------
    def seen(self, owner: int) -> None:
        self._seen[owner] = self._clock()


    def sharing(self, users: set[int]) -> bool:
        """Two or more users have DECODEs now or had one within SHARING_WINDOW."""
        now = self._clock()
        recent = {u for u, t in self._seen.items() if now - t < SHARING_WINDOW}
        return len(users | recent) >= 2

    def step_rows(self, cost: StepCost, base_rows: int, n_batch: int, sharing: bool) -> int:
        """Rows the next step may carry: n_batch for one user alone; else the cap over
        `base_rows`, the rows whose pace the step keeps (the scheduler's: its decode rows,
        or, when none decodes, its shortest prompt, or none)."""
        if not sharing:
            return n_batch if self.lone_step_seconds is None else cost.rows_in(self.lone_step_seconds, n_batch)
        if self.step_tokens > 0:
            return min(n_batch, max(base_rows + 1, self.step_tokens))
        floor = base_rows + cost.known_rows_in(MAX_STEP_SECONDS - (cost.predict(base_rows) or 0.0), n_batch)
        return min(n_batch, max(base_rows + 1, cost.rows_within(self.step_ratio, base_rows, n_batch), floor))

    # ---- growth ---------------------------------------------------------------------------
    def reopen(self, owner: int) -> bool:
        """owner is about to cause a reopen of a pool (or a pause of another user's agent):
        True, and counted, while it has caused fewer than GROWS_PER_MINUTE in the last
        minute; False, and nothing counted, when it must wait."""
        recent = self._grows.setdefault(owner, deque())
        while recent and self._clock() - recent[0] > 60:
            recent.popleft()
        if len(recent) >= GROWS_PER_MINUTE:
            return False
        recent.append(self._clock())
        return True
