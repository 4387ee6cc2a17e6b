"""A request pool's books (conductor/pool.py with kvcache/device.py), without a model: a
fake context that records which positions each sequence holds stands in for libllama's,
so seating, forking, keeping, evicting and handing down can be checked step by step.
After every step each cell is free or booked by exactly one sequence."""
from __future__ import annotations

from pathlib import Path

import pytest

from swarmkv_ffi.conductor.agent import Agent
from swarmkv_ffi.conductor.agent import Kind
from swarmkv_ffi.conductor.pool import Fixed, Pool, PoolKey

pytestmark = pytest.mark.unit

ALICE, BOB = 1, 2
DOC = list(range(1000, 1200))             # a 200-token document


class FakeContext:
    """What the pool calls on a llama context: each sequence's positions, 0..n-1."""

    def __init__(self, n_ctx: int, n_seq_max: int):
        self.n_ctx, self.n_seq_max = n_ctx, n_seq_max
        self.held: dict[int, int] = {}
        self.copies: list[tuple[int, int, int]] = []

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        n = self.held.get(src, 0) if p1 < 0 else min(p1, self.held.get(src, 0))
        self.held[dst] = max(self.held.get(dst, 0), n)
        self.copies.append((src, dst, n))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if p0 <= 0:
            self.held.pop(seq, None)
        elif seq in self.held:
            self.held[seq] = min(self.held[seq], p0)

    def seq_pos_max(self, seq: int) -> int:
        return self.held.get(seq, 0) - 1

    def close(self) -> None:
        self.held.clear()


class FakeHost:
    """A PoolHost that books nothing: its contexts are FakeContexts."""

    def new_context(self, loaded, n_ctx: int, n_seqs: int = 1, exact: bool = False) -> FakeContext:
        return FakeContext(n_ctx, n_seqs)

    def pause_seat(self, agent, ctx, seat) -> None:
        pass

    def keep_prefix(self, agent, snap) -> None:
        pass

    def drop_saved(self, agent) -> None:
        pass

    def pool_freed(self, key) -> None:
        pass


def pool(cells: int = 1024, seqs: int = 8) -> Pool:
    p = Pool(PoolKey("model", False, True), None, FakeHost(), fixed=Fixed(cells, seqs))
    p.open([])
    return p


def request(owner: int, asked: list[int], name: str, max_tokens: int = 16) -> Agent:
    return Agent(name, "model", Path("model.gguf"), len(asked) + max_tokens, None, None, None, owner=owner,
                 kind=Kind.REQUEST, asked=list(asked))


def run(p: Pool, agent: Agent, generated: int = 4):
    """Seat the request, 'decode' the rest of its prompt and `generated` tokens, keep it."""
    entry = p.seat(agent)
    seat = p.seat_of(agent)
    agent.history = list(agent.asked) + list(range(generated))
    seat.kv_len = len(agent.history)
    p.ctx.held[seat.seq] = seat.kv_len
    assert p.grow(seat, seat.kv_len)
    return entry, seat


def booked(p: Pool) -> int:
    return sum(s.cells for s in p.seats.values()) + sum(k.cells for k in p.cache.kept.values()) + p.cells_free


def test_a_request_books_its_prompt_and_a_reserve_and_gives_back_the_unused_when_kept():
    p = pool()
    agent = request(ALICE, DOC, "a", max_tokens=200)
    _, seat = run(p, agent)
    assert booked(p) == p.ctx.n_ctx
    assert seat.cells >= len(DOC) + 4
    p.keep(agent)
    assert p.cache.kept[seat.seq].cells == len(DOC) + 4 and booked(p) == p.ctx.n_ctx


def test_a_second_request_forks_the_kept_prefix_and_books_only_its_own_tokens():
    p = pool()
    first = request(ALICE, DOC + [1, 2], "a")
    run(p, first)
    p.keep(first)
    second = request(ALICE, DOC + [3, 4], "b")
    entry, seat = run(p, second)
    assert entry.forked and entry.tier == "pool"
    assert p.cache.forked(seat.seq) == len(DOC)
    assert (p.seat_of(second).seq, len(DOC)) in [(d, n) for _, d, n in p.ctx.copies]
    assert booked(p) == p.ctx.n_ctx


def test_another_owners_request_does_not_fork_and_pays_its_own_cells():
    p = pool()
    first = request(ALICE, DOC + [1], "a")
    run(p, first)
    p.keep(first)
    entry, seat = run(p, request(BOB, DOC + [2], "b"))
    assert not entry.forked and p.cache.forked(seat.seq) == 0
    assert booked(p) == p.ctx.n_ctx


def test_evicting_a_source_hands_its_cells_to_the_seated_request_that_forked_it():
    p = pool()
    first = request(ALICE, DOC + [1], "a")
    _, kept_seat = run(p, first)
    p.keep(first)
    second = request(ALICE, DOC + [2], "b")
    _, seat = run(p, second)
    before = seat.cells
    p.evict(kept_seat.seq)
    assert seat.cells == before + len(DOC)            # the heir books the document now
    assert p.cache.forked(seat.seq) == 0
    assert booked(p) == p.ctx.n_ctx


def test_making_room_evicts_only_the_shortfall_and_the_owners_own_first():
    p = pool(cells=700, seqs=8)
    mine = [request(ALICE, [i] * 150, f"a{i}") for i in range(2)]
    theirs = request(BOB, [9] * 150, "b")
    for agent in (*mine, theirs):
        run(p, agent)
        p.keep(agent)
    kept_before = dict(p.cache.kept)
    big = request(ALICE, [7] * 300, "big", max_tokens=32)
    assert not p.fits(big)
    assert p.evict_for(big)
    gone = set(kept_before) - set(p.cache.kept)
    assert len(gone) == 1 and kept_before[gone.pop()].owner == ALICE
    assert booked(p) == p.ctx.n_ctx


def test_a_request_that_cannot_fit_evicts_nothing():
    p = pool(cells=500, seqs=8)
    agent = request(ALICE, [5] * 150, "a")
    run(p, agent)
    p.keep(agent)
    assert not p.evict_for(request(ALICE, [6] * 600, "huge"))
    assert len(p.cache.kept) == 1
    assert "needs" in p.no_room(request(ALICE, [6] * 600, "huge"))


def test_a_request_too_short_to_keep_leaves_nothing_behind():
    p = pool()
    agent = request(ALICE, [1, 2, 3], "tiny")
    _, seat = run(p, agent, generated=1)
    p.keep(agent)
    assert p.cache.kept == {} and seat.seq in p.free_seqs and p.cells_free == p.ctx.n_ctx
