"""The context budget, checked before any context or buffer exists."""
from __future__ import annotations

from ..errors import BudgetError

DEFAULT_HEADROOM = 128


def check_budget(prefix_tokens: int, max_branch_tokens: int, n_ctx: int,
                 headroom: int = DEFAULT_HEADROOM) -> int:
    """Every branch sees the shared prefix plus its own prompt and answer; that must fit
    in n_ctx with `headroom` cells to spare. Returns the cells one branch needs."""
    for name, value in (("prefix_tokens", prefix_tokens), ("max_branch_tokens", max_branch_tokens),
                        ("headroom", headroom)):
        if value < 0:
            raise BudgetError(f"{name} must be >= 0, got {value}")
    required = prefix_tokens + max_branch_tokens + headroom
    if required > n_ctx:
        raise BudgetError(
            f"context budget exceeded: prefix_tokens={prefix_tokens} "
            f"max_branch_tokens={max_branch_tokens} headroom={headroom} "
            f"required={required} n_ctx={n_ctx}; raise n_ctx, shorten the document, "
            f"or lower max_tokens")
    return required
