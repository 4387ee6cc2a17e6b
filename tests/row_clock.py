"""A scheduling policy whose steps are charged by rows alone, for fairness tests.

Policy charges a step's wall time to its users in proportion to their rows; on a loaded
machine that time moves, and so would what the tests check. RowClock charges 10 ms a
row whatever the step took, so a fairness test runs the same on a fast machine and a
loaded one (what it checks is decided by rows, not seconds).
"""
from swarmkv_ffi.conductor.policy import Policy


class RowClock(Policy):
    """Steps charged 10 ms a row, whatever they took."""

    @staticmethod
    def by_rows(rows: dict[int, float], seconds: float) -> dict[int, float]:
        return {uid: 0.01 * n for uid, n in rows.items()}
