"""The scheduler's step plan (conductor/step.py), without a model: which tokens of which
runs go into one llama_decode, in what order, under the step cap, and what each user is
charged by. A stand-in pool seats each agent at a sequence; the batch is the real one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarmkv_ffi.batch import Batch
from swarmkv_ffi.conductor import step
from swarmkv_ffi.conductor.pool import Seat
from swarmkv_ffi.conductor.runs import Asked, Run

pytestmark = pytest.mark.unit

ALICE, BOB = 1, 2


class Seats:
    """What plan() asks of a pool: each agent's seat."""

    def __init__(self):
        self.seats: dict[int, Seat] = {}

    def seat_of(self, agent):
        return self.seats.get(id(agent))


def runs_in(pool: Seats, *specs) -> list[Run]:
    """A run per (owner, history already in its cells, its feed: tokens still to put in)."""
    out = []
    for i, (owner, history, feed) in enumerate(specs):
        agent = SimpleNamespace(history=list(history), prefix=None, owner=owner)
        pool.seats[id(agent)] = Seat(seq=i, agent=agent, kv_len=len(history), cells=0)
        out.append(Run(agent, owner, Asked("", 16), arrival=i, feed=list(feed), stepped=True))
    return out


def planned(pool, runs, room=512, seen=None):
    def cap(base):
        if seen is not None:
            seen.append(base)
        return room
    return step.plan(pool, Batch(512, 8), runs, order=lambda r: (0, r.arrival), cap=cap)


def test_decoding_runs_come_first_and_are_counted_as_decode_rows():
    pool = Seats()
    prompt, dec1, dec2 = runs_in(pool, (ALICE, [], [5, 6, 7]), (ALICE, [1, 2], [9]), (BOB, [3], [8]))
    plan = planned(pool, [prompt, dec1, dec2])
    assert [r.run for r in plan.rows] == [dec1, dec2, prompt]
    assert plan.decode_rows == 2 and plan.batch.n_tokens == 5
    assert plan.by_owner == {ALICE: 4, BOB: 1}
    assert list(plan.batch.pos[:5]) == [2, 1, 0, 1, 2]        # each run goes on from its own cells


def test_prompts_go_in_shortest_first_and_the_cap_cuts_the_last_into_a_chunk():
    pool = Seats()
    long, short = runs_in(pool, (ALICE, [], list(range(10, 16))), (BOB, [], [20, 21, 22]))
    plan = planned(pool, [long, short], room=5)
    assert [(r.run, r.n) for r in plan.rows] == [(short, 3), (long, 2)]
    assert plan.rows[0].logits == 2        # the short prompt ends here: its next token is sampled
    assert plan.rows[1].logits == -1       # the long one goes on next step: nothing to sample yet
    assert plan.batch.n_tokens == 5


def test_a_run_the_cap_leaves_no_room_for_is_not_in_the_step():
    pool = Seats()
    a, b = runs_in(pool, (ALICE, [1], [2]), (BOB, [1], [3]))
    plan = planned(pool, [a, b], room=1)
    assert [r.run for r in plan.rows] == [a] and plan.by_owner == {ALICE: 1}


def test_the_cap_keeps_the_pace_of_the_decode_rows_or_of_the_shortest_of_two_users_prompts():
    pool, seen = Seats(), []
    runs = runs_in(pool, (ALICE, [1], [2]), (ALICE, [], [4, 5, 6]))
    planned(pool, runs, seen=seen)
    runs = runs_in(pool, (ALICE, [], [1, 2, 3, 4]), (BOB, [], [5, 6, 7]))
    planned(pool, runs, seen=seen)
    runs = runs_in(pool, (ALICE, [], [1, 2, 3, 4]), (ALICE, [], [5, 6, 7]))
    planned(pool, runs, seen=seen)
    assert seen == [1, 3, 0]


def test_one_users_runs_starting_together_share_their_common_tokens():
    pool = Seats()
    runs = runs_in(pool, (ALICE, [], [1, 2, 3, 4]), (ALICE, [], [1, 2, 3, 9]))
    for run in runs:
        run.stepped = False
    plan = planned(pool, runs)
    assert plan.batch.n_tokens == 5                      # 1 2 3 once, then 4 and 9
    assert plan.by_owner == {ALICE: 5}
    assert [r.n for r in plan.rows] == [4, 4]
    assert plan.rows[0].logits != plan.rows[1].logits


def test_two_users_runs_never_share_rows_though_their_prompts_match():
    pool = Seats()
    runs = runs_in(pool, (ALICE, [], [1, 2, 3, 4]), (BOB, [], [1, 2, 3, 4]))
    for run in runs:
        run.stepped = False
    plan = planned(pool, runs)
    assert plan.batch.n_tokens == 8 and plan.by_owner == {ALICE: 4, BOB: 4}


def test_advance_moves_the_fed_tokens_into_the_history_and_the_cells():
    pool = Seats()
    (run,) = runs_in(pool, (ALICE, [1, 2], [3, 4, 5]))
    seat = pool.seat_of(run.agent)
    step.advance(run, seat, 2)
    assert run.agent.history == [1, 2, 3, 4] and run.feed == [5] and seat.kv_len == 4
