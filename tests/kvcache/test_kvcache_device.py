"""The device tier's books (kvcache/device.py KeptCells), without a model: who may fork
what, how much, from which sequence; who books shared cells when their booker goes; in
which order kept sequences give up their room. Sequences are plain numbers and tokens
plain lists, as the pool hands them over."""
from __future__ import annotations

import pytest

from swarmkv_ffi.kvcache.device import KeptCells

pytestmark = pytest.mark.unit

ALICE, BOB = 1, 2
DOC = list(range(100, 140))              # a 40-token document


def cache_with(*kept, share=False) -> KeptCells:
    """kept: (seq, owner, tokens, cells, last_used)."""
    cache = KeptCells(share)
    for seq, owner, tokens, cells, used in kept:
        cache.keep(seq, owner, tokens, cells)
        cache.kept[seq].last_used = used
    return cache


# ---- matching ----------------------------------------------------------------------------

def test_the_longest_prefix_of_the_askers_own_kept_sequences_is_matched():
    cache = cache_with((3, ALICE, DOC[:10], 10, 0), (4, ALICE, DOC[:30] + [1, 2], 32, 0))
    assert cache.match(DOC + [7], ALICE) == (30, 4)


def test_another_owners_cells_are_not_matched_unless_shared():
    kept = (3, BOB, DOC, 40, 0)
    assert cache_with(kept).match(DOC + [7], ALICE) == (0, None)
    assert cache_with(kept, share=True).match(DOC + [7], ALICE) == (40, 3)


def test_the_last_token_is_never_matched_its_logits_are_needed():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    assert cache.match(DOC, ALICE) == (39, 3)
    assert cache.match(DOC[:1], ALICE) == (0, None)


def test_running_sequences_are_matched_too_and_a_kept_one_wins_a_tie_first():
    cache = cache_with((3, ALICE, DOC[:20], 20, 0))
    running = [(ALICE, DOC[:35], 9), (BOB, DOC, 10)]
    assert cache.match(DOC + [7], ALICE, running) == (35, 9)
    assert cache.match(DOC[:20] + [7], ALICE, running) == (20, 3)


def test_nothing_in_common_matches_nothing():
    cache = cache_with((3, ALICE, [1, 2, 3], 3, 0))
    assert cache.match([9, 9, 9], ALICE) == (0, None)


# ---- forks and who books shared cells ----------------------------------------------------

def test_a_fork_records_its_source_and_touches_a_kept_source():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(5, 3, 40)
    assert cache.forked(5) == 40 and cache.forked(3) == 0
    assert cache.kept[3].last_used > 0


def test_the_heir_is_the_sequence_that_forked_the_most_and_takes_what_its_source_booked():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(5, 3, 20)
    cache.fork(6, 3, 35)
    assert cache.heir(3) == (6, 35)
    assert cache.heir(5) == (None, 0)


def test_an_heir_takes_over_only_what_its_source_booked_not_what_the_source_forked():
    cache = cache_with((3, ALICE, DOC, 40, 0), (4, ALICE, DOC + [1, 2, 3], 3, 0))
    cache.fork(4, 3, 40)          # 4 holds DOC (booked by 3) and 3 tokens of its own
    cache.fork(6, 4, 42)          # 6 forked 42 tokens of 4: 40 of them 3's
    assert cache.heir(4) == (6, 2)


def test_hand_down_repoints_the_other_forks_to_the_heir_and_books_its_cells():
    cache = cache_with((3, ALICE, DOC, 40, 0), (5, ALICE, DOC[:20] + [1], 1, 0), (6, ALICE, DOC + [2], 1, 0))
    cache.fork(5, 3, 20)
    cache.fork(6, 3, 40)
    assert cache.hand_down(3) == (6, 40)
    assert cache.forks == {5: (6, 20)}
    assert cache.kept[6].cells == 41


def test_hand_down_keeps_the_heirs_fork_below_the_going_sequence():
    cache = cache_with((2, ALICE, DOC, 40, 0), (3, ALICE, DOC + [1, 2], 2, 0), (6, ALICE, DOC + [1, 2, 3], 1, 0))
    cache.fork(3, 2, 40)
    cache.fork(6, 3, 42)
    assert cache.hand_down(3) == (6, 2)
    assert cache.forks == {6: (2, 40)}        # 6 still forks DOC from 2, which still books it
    assert cache.kept[6].cells == 3


def test_hand_down_of_a_sequence_nobody_forked_changes_nothing():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(3, 1, 10)
    assert cache.hand_down(3) == (None, 0)
    assert cache.forks == {}


def test_a_running_heir_is_named_and_its_booking_left_to_the_pool():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(9, 3, 40)            # 9 is seated, not kept
    assert cache.hand_down(3) == (9, 40)
    assert 9 not in cache.kept


def test_shared_is_the_longest_opening_held_by_another_sequence_either_way():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(5, 3, 25)
    cache.fork(6, 5, 30)
    assert cache.shared(5) == 30 and cache.shared(3) == 25 and cache.shared(6) == 30
    assert cache.shared(7) == 0


def test_evicting_frees_its_cells_less_what_its_heir_takes():
    cache = cache_with((3, ALICE, DOC, 40, 0), (5, ALICE, DOC[:30] + [1], 1, 0))
    cache.fork(5, 3, 30)
    assert cache.frees(3) == 10 and cache.frees(5) == 1


def test_a_kept_sequence_frees_a_prefix_only_with_enough_tokens_of_its_own():
    cache = cache_with((3, ALICE, DOC, 40, 0), (5, ALICE, DOC + [1, 2], 2, 0))
    cache.fork(5, 3, 40)
    assert cache.frees_prefix(3, 32) is False        # its heir 5 keeps all 40
    assert cache.frees_prefix(5, 2) is True and cache.frees_prefix(5, 3) is False
    cache.forks.clear()
    assert cache.frees_prefix(3, 32) is True


# ---- eviction order ----------------------------------------------------------------------

def test_the_askers_own_kept_sequences_go_first_least_recently_used_first():
    cache = cache_with((3, ALICE, [1], 10, 5.0), (4, ALICE, [2], 10, 1.0), (5, BOB, [3], 10, 0.0))
    assert list(cache.evictable(ALICE, None, set(), n_ctx=40))[:2] == [4, 3]


def test_anothers_kept_sequences_go_only_while_it_keeps_more_than_its_fair_share():
    cache = cache_with((3, BOB, [1], 30, 1.0), (4, BOB, [2], 30, 2.0), (5, ALICE, [3], 10, 0.0))
    # two owners of a 100-cell pool: 50 each. Bob keeps 60, so one of his (the older) may go.
    assert list(cache.evictable(ALICE, None, set(), n_ctx=100)) == [5, 3]


def test_the_fair_share_counts_owners_running_and_keeping():
    cache = cache_with((3, BOB, [1], 30, 1.0))
    assert cache.fair_share(ALICE, set(), 120) == 60
    assert cache.fair_share(ALICE, {3}, 120) == 40
    assert list(cache.evictable(ALICE, None, set(), n_ctx=120)) == []          # 30 <= 60
    assert list(cache.evictable(ALICE, None, {3, 4, 5}, n_ctx=120)) == [3]      # 30 > 24


def test_the_sequence_about_to_be_forked_goes_last():
    cache = cache_with((3, ALICE, [1], 10, 0.0), (4, ALICE, [2], 10, 1.0))
    assert list(cache.evictable(ALICE, 3, set(), n_ctx=40)) == [4, 3]


def test_anothers_source_goes_last_and_only_beyond_its_share():
    cache = cache_with((3, BOB, [1], 10, 0.0))
    assert list(cache.evictable(ALICE, 3, set(), n_ctx=100)) == []
    cache = cache_with((3, BOB, [1], 90, 0.0))
    assert list(cache.evictable(ALICE, 3, set(), n_ctx=100)) == [3]


def test_kept_by_others_sums_the_other_owners_cells():
    cache = cache_with((3, BOB, [1], 30, 0), (4, ALICE, [2], 10, 0), (5, 7, [3], 5, 0))
    assert cache.kept_by_others(ALICE) == 35


def test_clear_forgets_everything():
    cache = cache_with((3, ALICE, DOC, 40, 0))
    cache.fork(5, 3, 10)
    cache.clear()
    assert cache.kept == {} and cache.forks == {}
