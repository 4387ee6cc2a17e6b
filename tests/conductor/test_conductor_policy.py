"""lmxd's scheduling policy alone, with made-up costs and a made-up clock (policy.py has no
llama calls): cost by rows, a floor of virtual time that never goes back, the step budget
fitted on a pool's own steps, and the limit on pool growth per user."""
from __future__ import annotations

import pytest

from swarmkv_ffi.conductor.policy import (GROWS_PER_MINUTE, IDLE_CREDIT, MAX_STEP_SECONDS, SHARING_WINDOW,
                                          SLICE_SECONDS, Policy, StepCost)

V, M, N = 1, 2, 3     # a victim, a hostile user, a newcomer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_steps_time_is_charged_by_the_rows_each_user_put_in():
    costs = Policy.by_rows({M: 511, V: 1}, 1.024)
    assert costs[M] == pytest.approx(1.022) and costs[V] == pytest.approx(0.002)
    assert Policy.by_rows({}, 1.0) == {}


def test_a_newcomer_starts_at_the_floor_not_at_zero_even_on_an_idle_daemon():
    p = Policy()
    p.arrive(V, set())
    p.charge({V: 3.4}, {V})             # the victim alone used 3.4 s ...
    p.charge({}, set())                 # ... and went idle: the daemon has no DECODE
    p.arrive(N, set())                  # a fresh uid arrives while the daemon is idle
    assert p.vtime[N] == pytest.approx(p.vtime[V] - IDLE_CREDIT)
    p.charge({N: 0.3}, {N})             # it streams a while; then the victim comes back
    p.arrive(V, {N})
    assert p.vtime[V] - p.vtime[N] == pytest.approx(IDLE_CREDIT - 0.3)   # ahead by what is left of N's credit
    assert p.stepping({V, N}) == {V, N}                                    # within a slice: it steps


def test_a_user_ahead_keeps_its_debt_however_often_it_stops_and_starts():
    p = Policy()
    for uid in (V, M):
        p.arrive(uid, {V, M} - {uid})
    p.charge({M: 2.0}, {V, M})          # M's stream ran ahead of V's
    for _ in range(5):                  # M ends its DECODE and sends the next one
        p.arrive(M, {V})
    assert p.vtime[M] - p.vtime[V] > SLICE_SECONDS and p.stepping({V, M}) == {V}


def test_idleness_banks_no_credit():
    p = Policy()
    for uid in (V, M):
        p.arrive(uid, {V, M} - {uid})
    p.charge({M: 10.0, V: 10.0}, {V, M})
    p.charge({M: 50.0}, {M})            # V idle while M runs 50 s
    p.arrive(V, {M})
    assert p.vtime[V] == pytest.approx(p.vtime[M] - IDLE_CREDIT)   # not 50 s of credit
    assert p.floor == pytest.approx(p.vtime[M])          # the floor followed the one active user


def test_the_floor_never_goes_back():
    p = Policy()
    p.arrive(V, set())
    p.charge({V: 2.0}, {V})
    floor = p.floor
    p.arrive(N, {V})                    # a newcomer below the floor does not lower it
    p.charge({N: 0.01}, {V, N})
    assert p.floor >= floor


def test_a_user_ahead_by_more_than_a_slice_sits_out():
    p = Policy()
    p.vtime = {V: 1.0, M: 1.0 + SLICE_SECONDS + 0.01}
    assert p.stepping({V, M}) == {V}
    p.vtime[M] = 1.0 + SLICE_SECONDS
    assert p.stepping({V, M}) == {V, M}


def decode_steps(base: float, per_row: float, sizes=(1, 3, 1, 9, 2, 1, 5)) -> StepCost:
    cost = StepCost()
    for rows in sizes:
        cost.observe(rows, 0, base + per_row * rows)
    return cost


def steer(cost: StepCost, step_seconds, decode_rows: int = 1, steps: int = 60) -> list[int]:
    """Shared steps as the scheduler runs them: the budget's rows in, the machine's time out."""
    allowed = []
    for _ in range(steps):
        rows = Policy().step_rows(cost, decode_rows, 512, sharing=True)
        allowed.append(rows - decode_rows)
        cost.observe(decode_rows, rows - decode_rows, step_seconds(decode_rows, rows - decode_rows))
    return allowed


def test_step_cost_fits_decode_steps():
    cost = decode_steps(0.004, 0.002)
    assert cost.predict(1) == pytest.approx(0.006) and cost.predict(10) == pytest.approx(0.024)
    assert StepCost().predict(1) is None
    one_size = StepCost()
    for _ in range(5):
        one_size.observe(7, 0, 0.014)        # one size of step only: taken as proportional
    assert one_size.predict(1) == pytest.approx(0.002)


def test_the_step_budget_keeps_shared_steps_within_the_ratio_of_their_decodes_alone():
    """200 ms a step + 2 ms a row (decode steps long beside MAX_STEP_SECONDS): a step of
    one decode row takes 202 ms, and the prompt rows beside it add as much, 101 rows.
    Nothing known yet: one prompt row."""
    slow = lambda d, p: 0.200 + 0.002 * (d + p)
    allowed = steer(decode_steps(0.200, 0.002), slow)
    assert allowed[0] == 1 and allowed[-20:] == [101] * 20
    assert slow(1, 101) == pytest.approx(2 * slow(1, 0))


def test_a_shared_step_may_fill_a_slice_where_decode_steps_are_short():
    """4 ms a step + 2 ms a row, as a CPU: the ratio would allow 3 prompt rows a step, and
    a long prompt would go in over hundreds of steps each paying the step's fixed cost;
    a shared step may instead last MAX_STEP_SECONDS (a decode beside it still gets 4
    tokens a second)."""
    linear = lambda d, p: 0.004 + 0.002 * (d + p)
    allowed = steer(decode_steps(0.004, 0.002), linear)
    assert allowed[0] == 1
    assert all(linear(1, rows) == pytest.approx(MAX_STEP_SECONDS, abs=0.004) for rows in allowed[-20:])


def test_the_budget_follows_what_prompt_rows_really_cost():
    """Prompt rows deep in a long context cost 10x a decode row: the budget learns that
    from the steps themselves, not from the decode steps' per-row figure."""
    deep = lambda d, p: 0.004 + 0.002 * d + 0.020 * p
    allowed = steer(decode_steps(0.004, 0.002), deep)
    assert deep(1, allowed[-1]) == pytest.approx(MAX_STEP_SECONDS, abs=0.020)
    assert allowed[-1] < steer(decode_steps(0.004, 0.002), lambda d, p: 0.004 + 0.002 * (d + p))[-1] / 5
    slow = lambda d, p: 0.200 + 0.0005 * (d + p)     # rows cost little beside a long step
    allowed = steer(decode_steps(0.200, 0.0005), slow)
    assert allowed[-10:] == [401] * 10                 # 200.5 ms more: 401 rows of 0.5 ms


def test_one_user_alone_gets_steps_of_a_slice_and_nothing_known_is_cautious():
    p = Policy()
    cost = decode_steps(0.004, 0.002)
    assert p.step_rows(cost, 1, 512, sharing=False) == 512          # prompt rows not seen yet
    cost.observe(0, 100, 0.300)                                      # 3 ms a prompt row
    assert p.step_rows(cost, 0, 512, sharing=False) == int(MAX_STEP_SECONDS / 0.003)
    assert p.step_rows(StepCost(), 3, 512, sharing=True) == 4


def test_a_fixed_step_budget_overrides_the_ratio():
    p = Policy(step_tokens=16)
    assert p.step_rows(StepCost(), 1, 512, True) == 16
    assert p.step_rows(StepCost(), 20, 512, True) == 21   # decodes always go in, and one more row
    assert p.step_rows(StepCost(), 1, 512, False) == 512


def test_users_share_the_device_while_any_other_was_active_recently():
    clock = Clock()
    p = Policy(clock=clock)
    assert not p.sharing({M})
    p.seen(V)
    assert p.sharing({M})                  # the victim is between two DECODEs
    clock.now += SHARING_WINDOW + 0.1
    assert not p.sharing({M})
    assert p.sharing({M, V})


def test_a_user_may_reopen_pools_larger_only_so_often():
    clock = Clock()
    p = Policy(clock=clock)
    for _ in range(GROWS_PER_MINUTE):
        assert p.reopen(M)
    assert not p.reopen(M)
    assert p.reopen(V)                     # others are not held to M's count
    clock.now += 61
    assert p.reopen(M)
