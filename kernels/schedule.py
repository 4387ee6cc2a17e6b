"""The streamer's schedule as data, and a checker that proves it is race-free.

On a GPU a missing `Event.wait` shows up only sometimes (as a wrong output when a copy
overwrites a slot a kernel still reads); in Numba's simulator everything is synchronous
and it never shows. So the streamer logs every operation it issues (copy, kernel, event
record, event wait, host synchronise) with its stream and slot, and `violations()`
rebuilds CUDA's ordering rules from that log alone:

- operations on one stream run in issue order;
- `wait(e)` on stream S orders everything issued to S after it behind the point where `e`
  was last recorded;
- a host `synchronize()` orders everything issued after it behind everything issued
  before it on that stream.

With that happens-before relation it checks, for every slot, that each kernel runs after
the copy of its own layer, that no other copy into the slot can land between the two, and
that every pair of operations on a slot where one writes is ordered (no two in-flight
users). A schedule with any wait removed fails (tests/kernels/test_kernels.py shows it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str          # "copy", "kernel", "record", "wait", "sync"
    stream: str        # "transfer", "compute" (or "host" for a device-wide sync)
    layer: int | None = None
    slot: int | None = None
    event: int | None = None

    def __str__(self):
        where = f" layer {self.layer} slot {self.slot}" if self.layer is not None else ""
        ev = f" event #{self.event}" if self.event is not None else ""
        return f"{self.kind} on {self.stream}{where}{ev}"


class Schedule:
    """An append-only log of what the streamer issued, in issue order."""

    def __init__(self):
        self.ops: list[Op] = []

    def add(self, kind: str, stream: str, **where) -> None:
        self.ops.append(Op(kind, stream, **where))

    def without(self, index: int) -> "Schedule":
        """The same schedule with one operation deleted (to show the checker notices)."""
        copy = Schedule()
        copy.ops = self.ops[:index] + self.ops[index + 1:]
        return copy


def happens_before(ops: list[Op]) -> list[set[int]]:
    """For each op, the indices of the ops guaranteed to finish before it starts."""
    before: list[set[int]] = []
    last_on: dict[str, int] = {}          # stream -> index of its latest op
    recorded_at: dict[int, int] = {}      # event -> index of its latest record
    host_fence: set[int] = set()          # everything a host sync has waited for
    for i, op in enumerate(ops):
        deps = set(host_fence)
        if op.stream in last_on:
            j = last_on[op.stream]
            deps |= before[j] | {j}
        if op.kind == "wait" and op.event in recorded_at:
            r = recorded_at[op.event]
            deps |= before[r] | {r}
        if op.kind == "record":
            recorded_at[op.event] = i
        before.append(deps)
        if op.kind == "sync":
            streams = list(last_on) if op.stream == "host" else [op.stream]
            for s in streams:
                j = last_on.get(s)
                if j is not None:
                    host_fence |= before[j] | {j}
            host_fence.add(i)
        if op.stream != "host":
            last_on[op.stream] = i
    return before


def violations(schedule: Schedule) -> list[str]:
    """Every ordering rule the schedule breaks, in words ([] means race-free)."""
    ops = schedule.ops
    before = happens_before(ops)

    def ordered(a: int, b: int) -> bool:
        return a in before[b] or b in before[a]

    problems = []
    copies = {op.layer: i for i, op in enumerate(ops) if op.kind == "copy"}
    kernels = [i for i, op in enumerate(ops) if op.kind == "kernel"]
    for k in kernels:
        layer, slot = ops[k].layer, ops[k].slot
        c = copies.get(layer)
        if c is None or c not in before[k]:
            problems.append(f"{ops[k]} may start before the copy of layer {layer} has finished")
            continue
        for other_layer, c2 in copies.items():
            if other_layer == layer or ops[c2].slot != slot:
                continue
            if not (c2 in before[c] or k in before[c2]):
                problems.append(f"copy of layer {other_layer} into slot {slot} may overwrite "
                                f"layer {layer} before {ops[k]} has read it")
    users = [i for i, op in enumerate(ops) if op.kind in ("copy", "kernel")]
    for a_pos, a in enumerate(users):
        for b in users[a_pos + 1:]:
            if ops[a].slot == ops[b].slot and "copy" in (ops[a].kind, ops[b].kind) and not ordered(a, b):
                problems.append(f"{ops[a]} and {ops[b]} use slot {ops[a].slot} with nothing ordering them")
    return sorted(set(problems))
