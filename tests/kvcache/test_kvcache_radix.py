"""The radix tree that finds a prompt's longest held opening (kvcache/radix.py), without
a model: against comparing the prompt with every sequence held, on random sequences
inserted and removed in random order, over a small alphabet so that they share openings
and split each other's edges."""
from __future__ import annotations

import random

import pytest

from swarmkv_ffi.kvcache.prefix import longest_common_prefix
from swarmkv_ffi.kvcache.radix import RadixTree

pytestmark = pytest.mark.unit


def brute(held: dict[int, list[int]], wanted: list[int]) -> int:
    return max((longest_common_prefix(t, wanted) for t in held.values()), default=0)


def random_tokens(rng: random.Random, stem: list[int]) -> list[int]:
    cut = rng.randrange(len(stem) + 1)
    return stem[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 12))]


def test_the_tree_finds_what_comparing_with_every_sequence_finds():
    rng = random.Random(7)
    for case in range(300):
        tree, held = RadixTree(), {}
        stem = [rng.randrange(4) for _ in range(20)]
        for step in range(30):
            if held and rng.random() < 0.3:
                seq = rng.choice(list(held))
                tree.remove(seq)
                del held[seq]
            else:
                seq = rng.randrange(12)
                held[seq] = random_tokens(rng, stem)
                tree.insert(seq, held[seq])
            wanted = random_tokens(rng, stem)
            n, seq = tree.longest(wanted)
            assert n == brute(held, wanted), (case, step)
            if n:
                assert longest_common_prefix(held[seq], wanted) >= n      # a sequence that holds it
            else:
                assert seq is None
            assert len(tree) == len(held)


def test_the_oldest_holder_is_named_and_a_removed_one_never_is():
    tree = RadixTree()
    tree.insert(1, [1, 2, 3, 4])
    tree.insert(2, [1, 2, 3, 9])
    tree.insert(3, [1, 2])                      # splits the edge both run through
    assert tree.longest([1, 2, 3, 7]) == (3, 1)
    tree.remove(1)
    assert tree.longest([1, 2, 3, 4]) == (3, 2)
    tree.remove(2)
    assert tree.longest([1, 2, 3, 4]) == (2, 3)
    tree.remove(3)
    assert tree.longest([1, 2]) == (0, None) and tree.root.children == {}


def test_inserting_a_held_sequence_again_replaces_its_tokens():
    tree = RadixTree()
    tree.insert(1, [5, 6, 7])
    tree.insert(1, [8, 9])
    assert tree.longest([5, 6, 7]) == (0, None) and tree.longest([8, 9]) == (2, 1)


def test_empty_sequences_and_prompts_hold_and_match_nothing():
    tree = RadixTree()
    tree.insert(1, [])
    assert tree.longest([]) == (0, None) and tree.longest([1]) == (0, None)
    tree.remove(1)
    tree.remove(42)                               # not held: nothing to do
