"""The fair-pools levers that need the scheduler's inside to show, in process and
deterministic: the scheduler is held (a closure run on its thread) until every DECODE
of a test has arrived, and steps are counted by the rows handed to llama_decode."""
from __future__ import annotations

import threading

import pytest

from lmxd_daemon import queued, scheduler_held
from row_clock import RowClock
from swarmkv_ffi.conductor.agents import Conductor
from swarmkv_ffi.admission import keys as ledger_keys
from swarmkv_ffi.admission.ledger import Ledger
from swarmkv_ffi.context import Context

pytestmark = pytest.mark.timeout(300)
A, B = 1000, 1001


@pytest.fixture
def conductor():
    """Steps charged by rows alone (RowClock): what the tests check of charges does not
    move with the machine's speed or load (a loaded CI machine once failed A > 2 B)."""
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1, policy=RowClock(step_tokens=8))
    yield c
    c.close()


@pytest.fixture
def steps(monkeypatch):
    """Every llama_decode's rows, with the sequences of each row."""
    seen, real = [], Context.decode

    def counting(self, batch):
        n = batch.n_tokens
        seen.append([tuple(sorted(batch.seq_id[i, :batch.n_seq_id[i]].tolist())) for i in range(n)])
        return real(self, batch)
    monkeypatch.setattr(Context, "decode", counting)
    return seen


def send(c: Conductor, replies: dict, name: str, owner: int, n: int, prompt: str) -> threading.Thread:
    t = threading.Thread(target=lambda: replies.__setitem__(name, c.decode(name, n, prompt, owner=owner)))
    t.start()
    return t


def test_common_opening_rows_are_shared_within_a_user_never_across_users(conductor, steps):
    c = conductor
    prompt = "You are a careful assistant. Answer in one word. What colour is the sky?"
    for name, owner in (("a0", A), ("a1", A), ("b0", B)):
        c.register(name, "smollm2-135m", n_ctx=256, owner=owner)
    c.scheduler.policy.step_tokens = 512          # one step takes every prompt
    c.scheduler.policy.vtime = {A: 0.0, B: 0.0}   # equal histories: neither sits a step out
    n = len(c.get("a0", A).loaded.model.tokenize(prompt, add_special=True))
    replies = {}
    with scheduler_held(c):
        threads = [send(c, replies, name, owner, 2, prompt) for name, owner in (("a0", A), ("a1", A), ("b0", B))]
        queued(c, 3)
    for t in threads:
        t.join(120)
    first = steps[0]
    assert len(first) == 2 * n                    # A's two prompts as one, B's on its own
    shared_rows = [seqs for seqs in first if len(seqs) == 2]
    assert len(shared_rows) == n                  # every row of A's prompt holds both of A's sequences
    assert len({r.text for r in replies.values()}) == 1


def test_a_long_prompt_is_chunked_beside_another_users_decode(conductor, steps):
    """B decodes 16 tokens while A's 600-token prompt goes in: no step carries more than
    the budget (8 rows, or B's prompt whole and one more) while B runs, A is charged by the rows it put in (far more than
    B, who put one a step), and A's prompt is whole in its conversation."""
    c = conductor
    c.register("a", "smollm2-135m", n_ctx=1024, owner=A)
    c.register("b", "smollm2-135m", n_ctx=256, owner=B)
    long_prompt = " ".join(f"item {i}," for i in range(120))
    c.scheduler.policy.vtime = {A: 0.0, B: 0.0}
    replies, b_done = {}, threading.Event()
    with scheduler_held(c):
        ta = send(c, replies, "a", A, 1, long_prompt)
        charged = {}
        tb = threading.Thread(target=lambda: (replies.__setitem__("b", c.decode("b", 16, "Count: 1, 2,", owner=B)),
                                              charged.update(c.scheduler.policy.vtime), b_done.set()))
        tb.start()
        queued(c, 2)
    tb.join(120)
    during_b = len(steps)
    ta.join(300)
    assert replies["b"].generated_tokens == 16
    b_prompt = len(c.get("b", B).loaded.model.tokenize("Count: 1, 2,", add_special=True))
    assert len(steps[0]) == max(8, b_prompt + 1)  # B's prompt whole (the shortest), A's rows to the budget
    assert max(len(rows) for rows in steps[1:during_b - 1]) <= 8, [len(r) for r in steps[:during_b]]
    assert replies["a"].prompt_tokens > 600 and replies["a"].generated_tokens == 1
    assert charged[A] > 2 * charged[B]          # by rows: ~7 of A's for each of B's in every step
                                                # (opening the pool and seating cost both too)
    agent = c.get("a", A)
    assert agent.history == [int(t) for t in agent.loaded.model.tokenize(long_prompt, add_special=True)]


def test_unregister_never_stalls_the_scheduler_on_a_models_gate(conductor):
    """A REGISTER measuring a context holds its model's gate; an UNREGISTER of the same
    model meanwhile must not take the scheduler with it: another user's DECODE goes on
    while the gate is held, and the UNREGISTER ends once it is released."""
    c = conductor
    c.register("leaving", "smollm2-135m", n_ctx=256, owner=A)
    c.register("victim", "smollm2-135m", n_ctx=256, owner=B)
    c.decode("victim", 2, "Hello", owner=B)
    gate = c.registry.gate(c.get("victim", B).file.key)
    left = threading.Event()
    with gate:                                  # as a REGISTER's measurement would
        t = threading.Thread(target=lambda: (c.unregister("leaving", A), left.set()))
        t.start()
        reply = c.decode("victim", 8, " and again", owner=B)   # would hang if the scheduler waited
        assert reply.generated_tokens == 8
        assert not left.is_set()                # the unregister waits for the gate, on its own thread
    t.join(60)
    assert left.is_set()
    assert [a.id for a in c.owned_by(None)] == ["victim"]
    assert c.ledger.held(ledger_keys.agent(1000, "leaving")) == 0


def test_an_exact_pool_keeps_left_cells_in_its_tomb_and_is_not_rebuilt(conductor):
    """A prefix agent that is reset again and again leaves its cells to the tomb: the pool
    is not rebuilt, and another prefix agent's answers equal its answers alone."""
    from corpus import DOC
    c = conductor
    c.register("v", "smollm2-135m", n_ctx=1024, owner=B, prefix=DOC)
    c.register("m", "smollm2-135m", n_ctx=1024, owner=A, prefix=DOC)
    c.decode("m", 1, "hi", owner=A)        # both have DECODEd (m first, then reset): the pool is
    c.reset("m", owner=A)                  # sized for both, and m never needs a context of its own
    alone = []
    for q in ("Question: who may use it?", "Question: what is a Contribution?"):
        c.reset("v", owner=B)
        alone.append(c.decode("v", 10, q, owner=B).text)
    together = []
    for i, q in enumerate(("Question: who may use it?", "Question: what is a Contribution?")):
        for k in range(5):
            c.decode("m", 1, f"guess {i} {k}", owner=A)
            c.reset("m", owner=A)
        c.reset("v", owner=B)
        together.append(c.decode("v", 10, q, owner=B).text)
    pool = c.scheduler.live
    assert pool.exact and pool.rebuilds == 0 and pool.tomb_cells > 0
    assert pool.tomb_by.get(A, 0) > 0
    assert together == alone


def test_a_document_whose_host_copy_does_not_fit_the_swap_budget_still_answers():
    """A full swap share slows its owner, never refuses it: the prefix agent's document is
    computed in the pool and used there; only its host copy is not kept."""
    from corpus import DOC
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1, swap=Ledger(lambda: 1000, name="SWAP"))
    try:
        c.register("p", "smollm2-135m", n_ctx=1024, owner=A, prefix=DOC)
        first = c.decode("p", 6, "Question: who may use it?", owner=A)
        assert first.generated_tokens == 6 and first.forked
        assert c.get("p", A).prefix.snapshot is None and c.swap.allocated == 0
        c.reset("p", owner=A)
        assert c.decode("p", 6, "Question: who may use it?", owner=A).text == first.text
    finally:
        c.close()


def test_a_leaver_pauses_nobody_the_pool_books_its_spare_cells_instead(conductor):
    """A grew the pool while alone in it (an agent of 4,096 cells, reset, its cells free);
    B's agent sits in it; A's agent leaves: the pool is not shrunk under B (which would
    pause B to host RAM for A's departure), its spare cells are booked in the ledger as
    the pool's own, and that booking goes with its context once B has left too."""
    from swarmkv_ffi.conductor.booking import excess_key_of
    c = conductor
    c.register("m", "smollm2-135m", n_ctx=4096, owner=A)
    c.decode("m", 1, "hi", owner=A)
    c.reset("m", owner=A)
    c.register("v", "smollm2-135m", n_ctx=512, owner=B)
    c.decode("v", 4, "Hello", owner=B)
    pool = c.scheduler.live
    assert pool.ctx.n_ctx >= 4096 and pool.seat_of(c.get("v", B)) is not None
    c.unregister("m", owner=A)
    key = excess_key_of(pool.key)
    cells, kv, _ = pool.loaded.context_bytes
    assert c.ledger.held(key) == -(-kv * (pool.ctx.n_ctx - 512) // cells)
    assert not c.decode("v", 4, " and on", owner=B).restored
    assert c.scheduler.live is pool and pool.ctx.n_ctx >= 4096
    c.unregister("v", owner=B)
    assert c.ledger.held(key) == 0 and not pool.is_open


def test_a_run_waiting_for_its_reopen_does_not_hold_another_users_pool(conductor):
    """A's DECODE waits in the shared pool for a reopen its user may not make now (its
    reopens this minute are spent); B's agent decodes in B's own context (it outgrew the
    shared pool A sat in). B's DECODE is served while A's still waits. (It once was not:
    A's run, first in line, made every step choose the shared pool, and B waited as long
    as A did: 58 s in `swarmkv bench multiuser --attacks grow`.)"""
    c = conductor
    c.register("a", "smollm2-135m", n_ctx=512, owner=A)
    c.decode("a", 1, "hi", owner=A)
    c.register("v", "smollm2-135m", n_ctx=512, owner=B)
    c.decode("v", 16, "Count with me: 1, 2, 3,", owner=B)     # B has used more: A's run comes first
    assert c.get("v", B).alone
    c.scheduler.policy.reopen = lambda owner: owner != A
    c.register("a2", "smollm2-135m", n_ctx=1024, owner=A)
    stop, done = threading.Event(), {}
    waiting = threading.Thread(target=lambda: done.setdefault("a2", c.decode("a2", 1, "hi", owner=A,
                                                                            should_stop=stop.is_set)))
    waiting.start()
    queued(c, 1)
    served = threading.Thread(target=lambda: done.setdefault("v", c.decode("v", 4, " and on", owner=B)))
    served.start()
    served.join(timeout=60)
    try:
        assert "v" in done and done["v"].generated_tokens >= 1, "B waited for A's reopen"
        assert waiting.is_alive()                  # A's run still waits for its reopen
    finally:
        stop.set()
        waiting.join(timeout=60)
    assert done["a2"].cancelled
