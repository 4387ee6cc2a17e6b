"""The request pool's default --ctx-size (serve/sizing.py): four of the model's contexts
when a quarter of the budget after the weights holds them, what it holds when less,
and a clear error when it cannot hold one."""
from __future__ import annotations

import pytest

from swarmkv_ffi import catalog
from swarmkv_ffi.serve import sizing

GiB = 1 << 30


def test_four_contexts_when_the_budget_holds_them():
    size = sizing.default_cells(8192, per_cell=40_000, fixed=200 << 20, budget=16 * GiB)
    assert size.cells == 4 * 8192 and "4 x the model's 8192-token context" in size.why


def test_what_a_quarter_of_the_budget_holds_when_less():
    budget = (200 << 20) + 4 * 20_000 * 40_000          # a quarter holds 20,000 cells
    size = sizing.default_cells(8192, per_cell=40_000, fixed=200 << 20, budget=budget)
    assert size.cells == 19_968 and size.cells % 256 == 0 and "quarter of the memory budget" in size.why


def test_a_budget_without_room_for_one_context_is_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"too small for one full context .* pass --ctx-size"):
        sizing.default_cells(8192, per_cell=40_000, fixed=200 << 20, budget=1 * GiB)


def test_the_default_model_gets_four_contexts_on_a_large_budget():
    size = sizing.for_model(catalog.resolve("smollm2-135m"), 64 * GiB)
    assert size.cells == 4 * 8192
