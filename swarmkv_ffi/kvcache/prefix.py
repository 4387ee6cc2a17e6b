"""How many leading tokens two prompts share: the one question every tier asks."""
from __future__ import annotations

import numpy as np


def longest_common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (slices compare in C: a binary search over
    them beats a Python loop on documents of thousands of tokens)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:                      # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """longest_common_prefix for token arrays (the fan-out's prompts), compared in numpy."""
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n
