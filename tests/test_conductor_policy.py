"""lmxd's scheduling policy alone, with made-up costs and a made-up clock (policy.py has no
llama calls): cost by rows, a floor of virtual time that never goes back, the step budget
fitted on a pool's own steps, and the limit on pool growth per user."""
from __future__ import annotations

import pytest

from swarmkv_ffi.conductor.policy import (GROWS_PER_MINUTE, IDLE_CREDIT, SHARING_WINDOW, SLICE_SECONDS,
                                          Policy, StepCost)

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
    assert p.vtime[V] <= p.vtime[N] + SLICE_SECONDS + 1e-9      # its history is not held against it
    assert p.stepping({V, N}) == {V, N}                          # so it does not sit out


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


def fitted(base: float, per_row: float, sizes=(1, 3, 1, 9, 2, 1, 5)) -> StepCost:
    cost = StepCost()
    for rows in sizes:
        cost.observe(rows, base + per_row * rows)
    return cost


def test_step_cost_fits_base_and_per_row_time():
    base, per_row = fitted(0.004, 0.002).model()
    assert base == pytest.approx(0.004) and per_row == pytest.approx(0.002)


def test_the_step_budget_keeps_a_step_within_the_ratio_of_its_decodes_alone():
    p = Policy(step_ratio=2.0)
    cost = fitted(0.004, 0.002)
    rows = p.step_rows(cost, decode_rows=1, n_batch=512, sharing=True)
    assert rows == 4                       # 4 ms + 4 x 2 ms = 12 ms = 2 x (4 + 2) ms
    assert 0.004 + 0.002 * rows <= 2 * (0.004 + 0.002 * 1) + 1e-12
    assert p.step_rows(cost, decode_rows=8, n_batch=512, sharing=True) == 18
    assert p.step_rows(cost, decode_rows=1, n_batch=512, sharing=False) == 512   # one user alone
    assert p.step_rows(StepCost(), decode_rows=3, n_batch=512, sharing=True) == 4  # nothing known yet: cautious


def test_the_budget_follows_the_machine_not_a_row_count():
    p = Policy(step_ratio=2.0)
    cheap_rows = fitted(0.020, 0.0005)     # a machine where rows cost little beside the step
    assert p.step_rows(cheap_rows, 1, 512, True) == 42
    free_rows = fitted(0.010, 0.0)         # rows cost nothing more: no cap
    assert p.step_rows(free_rows, 1, 512, True) == 512
    one_size = StepCost()
    for _ in range(5):
        one_size.observe(7, 0.014)         # one size of step only: taken as proportional
    assert p.step_rows(one_size, 1, 512, True) == 2


def test_a_fixed_step_budget_overrides_the_ratio():
    p = Policy(step_tokens=16)
    assert p.step_rows(fitted(0.004, 0.002), 1, 512, True) == 16
    assert p.step_rows(fitted(0.004, 0.002), 20, 512, True) == 21   # decodes always go in, and one more row
    assert p.step_rows(fitted(0.004, 0.002), 1, 512, False) == 512


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
        assert p.may_grow(M)
        p.grew(M)
    assert not p.may_grow(M)
    assert p.may_grow(V)                   # others are not held to M's count
    clock.now += 61
    assert p.may_grow(M)
