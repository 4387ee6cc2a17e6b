"""lmxd decodes agents of one model together: one pool (context) per model, a sequence per
agent, one llama_decode per step for every running DECODE. KV moves only between models;
a disconnect rolls back its own agent only; a full batch seats the least-served user
first; agents registered after their pool opened still join its batch."""
from __future__ import annotations

import threading

import pytest

from lmxd_daemon import Daemon, eventually, queued, scheduler_held, wait_decoding
from row_clock import RowClock
from swarmkv_ffi.bench.measure import at_once
from swarmkv_ffi.conductor import pool as pool_module
from swarmkv_ffi.conductor.agents import Conductor
from swarmkv_ffi.admission.ledger import Ledger

pytestmark = pytest.mark.timeout(600)


def decode_at_once(d: Daemon, calls: list[tuple[str, int, str]]) -> list[dict]:
    """DECODE (agent, max_tokens, prompt) for each call at the same time, one connection each."""
    clients = [d.client() for _ in calls]
    try:
        return at_once([lambda c=c, call=call: c.decode(*call) for c, call in zip(clients, calls)])[1]
    finally:
        for c in clients:
            c.close()


def tokens(c, agent_id: str) -> int:
    return int(next(a for a in c.list() if a["agent_id"] == agent_id)["tokens"])


def test_same_model_agents_share_one_batch_and_move_no_kv(tmp_path):
    with Daemon(tmp_path) as d, d.client() as c:
        for i in range(4):
            c.register(f"a{i}", "smollm2-135m", n_ctx=256)
        replies = decode_at_once(d, [(f"a{i}", 12, f"Story {i}: once upon a time") for i in range(4)])
        assert all(r["fields"]["kv_swap_evicted"] == "-" for r in replies)
        assert max(int(r["fields"]["batch"]) for r in replies) >= 2, [r["fields"] for r in replies]
        again = [c.decode(f"a{i}", 4, " Then") for i in range(4)]        # one after another
        assert all(r["fields"]["kv_swap_evicted"] == "-" and r["fields"]["kv_swap_restored"] == "false"
                   for r in again)
        assert all(a["state"] == "active" and a["kv_host_bytes"] == "0" for a in c.list())
        status = c.status()
        assert status["fields"]["swap_allocated_bytes"] == "0"
        (pool,) = [line for line in status["lines"] if line.startswith("OK pool ")]
        assert "seated=4 seqs=4 cells=1024" in pool and "exact=false" in pool, pool


def test_two_models_interleaved_swap_only_between_models(tmp_path):
    models = {"s0": "smollm2-135m", "s1": "smollm2-135m", "g0": "gemma3-270m", "g1": "gemma3-270m"}
    with Daemon(tmp_path) as d, d.client() as c:
        for name, model in models.items():
            c.register(name, model, n_ctx=256)
        evicted = []
        for _ in range(2):
            for name in models:
                evicted.append((name, c.decode(name, 3, "Hello")["fields"]["kv_swap_evicted"]))
        swaps = [(who, gone) for who, gone in evicted if gone != "-"]
        assert all(models[who] != models[gone] for who, gone in swaps), evicted
        assert [who for who, _ in swaps] == ["g0", "s0", "g0"], evicted   # each first of its model


def test_a_disconnect_mid_batch_rolls_back_only_its_agent(tmp_path):
    with Daemon(tmp_path) as d, d.client() as c:
        c.register("stays", "smollm2-135m", n_ctx=1024)
        c.register("leaves", "smollm2-135m", n_ctx=1024)
        c.decode("leaves", 3, "Start")
        before = tokens(c, "leaves")
        s = d.raw_socket()
        s.sendall(b"DECODE leaves 600 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,\n")
        wait_decoding(d, "leaves")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=d.client().decode("stays", 40, "Count: 1, 2,")))
        t.start()
        eventually(lambda: set(c.status()["fields"]["decoding"].split(",")) == {"leaves", "stays"},
                   what="both DECODEs in one batch")
        s.close()                                      # mid-DECODE, while "stays" runs beside it
        t.join(timeout=300)
        assert int(result["r"]["fields"]["generated_tokens"]) == 40
        assert tokens(c, "leaves") == before
        reply = c.decode("leaves", 2, "again")
        assert tokens(c, "leaves") == before + int(reply["fields"]["prompt_tokens"]) + 2
        assert d.logs().count("DECODE leaves CANCELLED") == 1


def test_agents_registered_after_their_pool_opened_join_its_batch(tmp_path):
    with Daemon(tmp_path) as d, d.client() as c:
        c.register("first", "smollm2-135m", n_ctx=256)
        c.decode("first", 2, "Hi")                     # the pool opens for one agent
        for i in range(3):
            c.register(f"late{i}", "smollm2-135m", n_ctx=256)
        replies = decode_at_once(d, [(f"late{i}", 16, "Once upon a time") for i in range(3)] + [("first", 16, " and")])
        assert all(int(r["fields"]["generated_tokens"]) >= 1 for r in replies)
        assert max(int(r["fields"]["batch"]) for r in replies) >= 3, [r["fields"] for r in replies]


@pytest.mark.slow
def test_a_full_batch_seats_the_least_served_user_first(monkeypatch):
    """Two seats (MAX_SEQS lowered), user A's two long DECODEs hold them; user B's DECODE
    takes the seat of one of A's after its slice and finishes first; A's DECODE that gave
    its seat up continues (two slices) and completes."""
    monkeypatch.setattr(pool_module, "MAX_SEQS", 2)
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1)
    A, B = 1000, 1001
    try:
        for name in ("a0", "a1"):
            c.register(name, "smollm2-135m", n_ctx=512, owner=A)
        c.register("b0", "smollm2-135m", n_ctx=512, owner=B)
        done, replies = [], {}

        def run(name, owner, n):
            replies[name] = c.decode(name, n, "Count: 1, 2, 3,", owner=owner)
            done.append(name)
        threads = [threading.Thread(target=run, args=(n, A, 160)) for n in ("a0", "a1")]
        for t in threads:
            t.start()
        eventually(lambda: len(c.scheduler.decoding()) == 2, what="A's two DECODEs in the batch")
        b = threading.Thread(target=run, args=("b0", B, 8))
        b.start()
        for t in threads + [b]:
            t.join(timeout=300)
        assert done[0] == "b0", done
        assert replies["b0"].generated_tokens == 8 and replies["b0"].slices == 1
        assert all(replies[n].generated_tokens == 160 for n in ("a0", "a1"))
        assert max(replies[n].slices for n in ("a0", "a1")) >= 2
    finally:
        c.close()


def test_a_prompt_trie_adds_common_tokens_once_in_every_sequence_through_them():
    from swarmkv_ffi.batch import Batch
    from swarmkv_ffi.conductor.common_prompts import PromptTrie
    trie = PromptTrie([("a", 0, [1, 2, 3, 4]), ("b", 1, [1, 2, 5]), ("c", 2, [1, 2]), ("d", 3, [9])])
    assert trie.size == 6                    # 1 2 (shared by a b c), 3 4 (a), 5 (b), 9 (d)
    batch = Batch(16, 4)
    rows = trie.add_to(batch, 10)
    n = batch.n_tokens
    got = [(int(batch.token[i]), int(batch.pos[i]), sorted(batch.seq_id[i, :batch.n_seq_id[i]].tolist()),
            bool(batch.logits[i])) for i in range(n)]
    assert got == [(1, 10, [0, 1, 2], False), (2, 11, [0, 1, 2], True), (3, 12, [0], False),
                   (4, 13, [0], True), (5, 12, [1], True), (9, 10, [3], True)]
    assert rows == {"c": 1, "a": 3, "b": 4, "d": 5}   # c ends on the shared row: it samples there


def test_decodes_starting_together_prefill_their_common_prompt_tokens_once(monkeypatch):
    from swarmkv_ffi.context import Context
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1)
    try:
        prompts = [f"You are a careful assistant. Question {i}: what is {i} plus {i}?" for i in range(4)]
        for i in range(4):
            c.register(f"a{i}", "smollm2-135m", n_ctx=256)
        tokenized = [[int(t) for t in c.get("a0").loaded.model.tokenize(p, add_special=True)] for p in prompts]
        lengths = [len(t) for t in tokenized]
        common = next(k for k in range(min(lengths)) if len({tuple(t[:k + 1]) for t in tokenized}) > 1)
        sizes, real = [], Context.decode

        def counting(self, batch):
            sizes.append(batch.n_tokens)
            return real(self, batch)
        monkeypatch.setattr(Context, "decode", counting)
        replies = {}

        def go(i):
            replies[i] = c.decode(f"a{i}", 4, prompts[i])
        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        with scheduler_held(c):             # all four queued before the first step, however slow the machine
            for t in threads:
                t.start()
            queued(c, 4)
        for t in threads:
            t.join(timeout=120)
        assert all(replies[i].batch == 4 and replies[i].generated_tokens >= 1 for i in range(4))
        assert common >= 5 and sizes[0] == sum(lengths) - 3 * common   # the common opening went in once
        for i in range(4):                   # each conversation holds its whole prompt
            assert c.get(f"a{i}").history[:lengths[i]] == tokenized[i]
    finally:
        c.close()


@pytest.mark.slow
def test_one_users_many_decodes_do_not_slow_another_users_one():
    """User A keeps four long DECODEs in one batch; user B's short DECODE, sent once A has
    been charged 1.5 s (about 38 of A's 120 steps, at 10 ms a row), runs alone in its steps
    (A's sit out until B has caught up, which B's 8 tokens are far from), and A's DECODEs
    then complete."""
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1, policy=RowClock())
    A, B = 1000, 1001
    try:
        for i in range(4):
            c.register(f"a{i}", "smollm2-135m", n_ctx=512, owner=A)
        c.register("b", "smollm2-135m", n_ctx=512, owner=B)
        replies = {}

        def run(name, owner, n):
            replies[name] = c.decode(name, n, "Count: 1, 2, 3,", owner=owner)
        threads = [threading.Thread(target=run, args=(f"a{i}", A, 120)) for i in range(4)]
        for t in threads:
            t.start()
        eventually(lambda: c.scheduler.policy.vtime.get(A, 0.0) > 1.5, what="A to use the device")
        run("b", B, 8)
        assert replies["b"].generated_tokens == 8 and replies["b"].batch == 1, replies["b"]
        assert not any(name in replies for name in ("a0", "a1", "a2", "a3"))   # B waited for none of them
        for t in threads:
            t.join(timeout=300)
        assert all(replies[f"a{i}"].generated_tokens == 120 and replies[f"a{i}"].batch == 4 for i in range(4))
    finally:
        c.close()


def test_a_pool_whose_context_cannot_be_made_fails_its_decodes_and_nothing_else(monkeypatch):
    from swarmkv_ffi.errors import ContextError
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=1)
    try:
        c.register("s", "smollm2-135m", n_ctx=256)
        c.register("g", "gemma3-270m", n_ctx=256)
        real, refusing = c.new_context, [True]

        def refuse_smollm(loaded, n_ctx, n_seqs=1, exact=False):
            if refusing[0] and "SmolLM2" in loaded.name:
                raise ContextError("injected: no memory for the pool")
            return real(loaded, n_ctx, n_seqs, exact)
        monkeypatch.setattr(c, "new_context", refuse_smollm)
        with pytest.raises(ContextError, match="injected"):
            c.decode("s", 4, "Hello")
        assert c.decode("g", 3, "Hello").generated_tokens >= 1      # another model's pool works
        refusing[0] = False
        assert c.decode("s", 3, "Hello").generated_tokens >= 1      # and this one, once it can open
        assert c.get("s").history and c.get("s").state == "active"
    finally:
        c.close()
