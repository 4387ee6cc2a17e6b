"""The conductor's door for one-shot requests (conductor/requests.py), used in process as
serve/ uses it: requests of one owner fork what the pool holds of that owner's, never of
another's; a request that cannot fit is refused before it queues; a second pool of the
same model and mode is refused and books nothing; a cancelled request ends rolled back;
closing the pool gives back every byte it booked."""
from __future__ import annotations

import threading

import pytest

from corpus import DOC
from swarmkv_ffi.conductor.agents import Conductor, ConductorError, ContextFull
from swarmkv_ffi.admission.ledger import Ledger
from swarmkv_ffi.conductor.agent import pool_key
from swarmkv_ffi.conductor.requests import RequestPool

MODEL = "smollm2-135m"
A, B = 1 << 40, (1 << 40) + 1          # two owners, as two API keys are


@pytest.fixture
def conductor():
    c = Conductor(Ledger(lambda: 1 << 40), n_threads=2)
    yield c
    c.shutdown(0)
    c.close()


def tokens_of(pool: RequestPool, text: str) -> list[int]:
    return [int(t) for t in pool.model.tokenize(text, add_special=True)]


def test_a_request_forks_its_owners_cells_and_never_another_owners(conductor):
    pool = RequestPool(conductor, MODEL, cells=4096, seqs=8)
    first = tokens_of(pool, DOC + "\nQuestion: what is this document?")
    second = tokens_of(pool, DOC + "\nQuestion: who is the Licensor?")
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert common > 200
    assert pool.submit(A, first, 4).result().cached == 0
    again = pool.submit(A, second, 4).result()
    assert again.cached == common and len(again.generated) == 4
    assert pool.submit(B, second, 4).result().cached == 0      # B's own prompt, A's cells unseen
    pool.close()


def test_a_request_over_the_context_is_refused_before_it_queues(conductor):
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=4)
    with pytest.raises(ContextFull) as info:
        pool.submit(A, [1] * 1000, 100)
    assert (info.value.limit, info.value.new, info.value.max_tokens) == (1023, 1000, 100)
    with pytest.raises(ContextFull):
        pool.submit(A, [1] * 10, 0)
    assert conductor.scheduler.waiting() == 0
    pool.close()


def test_a_second_pool_of_one_model_and_mode_is_refused_and_books_nothing(conductor):
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=4)
    booked = conductor.ledger.allocated
    with pytest.raises(ConductorError) as info:
        RequestPool(conductor, MODEL, cells=2048, seqs=4)
    assert info.value.code == "DUPLICATE_POOL"
    assert conductor.ledger.allocated == booked
    exact = RequestPool(conductor, MODEL, cells=1024, seqs=4, exact=True)    # another mode, another pool
    exact.close()
    pool.close()
    assert conductor.ledger.allocated == 0


def test_a_cancelled_request_ends_rolled_back_and_the_pool_goes_on(conductor):
    pool = RequestPool(conductor, MODEL, cells=2048, seqs=4)
    prompt = tokens_of(pool, DOC)
    cancelled = threading.Event()

    def on_token(_token, _logprobs) -> bool:
        cancelled.set()                 # the client leaves after its first token
        return True
    result = pool.submit(A, prompt, 64, on_token=on_token, cancelled=cancelled).result()
    assert result.cancelled
    after = pool.submit(A, prompt, 4).result()
    assert not after.cancelled and len(after.generated) == 4
    assert after.cached == 0             # the cancelled request's cells were not kept
    pool.close()
    assert conductor.ledger.allocated == 0


def booked(pool: RequestPool) -> int:
    """Every cell of the request pool is free or booked by exactly one sequence."""
    p = pool.conductor.scheduler.pools[pool.key]
    return sum(s.cells for s in p.seats.values()) + sum(k.cells for k in p.cache.kept.values()) + p.cells_free


def no_end(pool: RequestPool) -> dict:
    """Sampling that never picks an end-of-generation token: a request runs to max_tokens."""
    model = pool.model
    return {"logit_bias": {t: -1e9 for t in range(model.n_vocab) if model.is_eog(t)}}


def test_siblings_over_one_prompt_book_it_once_and_all_run_together(conductor):
    """16 requests over one 900-token prompt: each books its own tokens only, so all 16
    hold a seat at once in a pool where booking the prompt 16 times would seat 3 (seats
    counted between steps, from the scheduler's thread)."""
    pool = RequestPool(conductor, MODEL, cells=3072, seqs=20)
    prompt = tokens_of(pool, DOC * 5)[:900]
    seated = []

    def on_token(_token, _logprobs) -> bool:
        seated.append(pool.stats()["running"])
        return True
    requests = [pool.submit(A, prompt, 8, on_token=on_token, sampling=no_end(pool)) for _ in range(16)]
    results = [r.result() for r in requests]
    assert all(len(r.generated) == 8 for r in results)
    assert sum(r.cached > 0 for r in results) == 15
    assert max(seated) == 16
    assert booked(pool) == 3072
    pool.close()


def test_cells_forked_from_an_evicted_prefix_stay_booked(conductor):
    """Y forks X's kept 300-token prompt and W starts beside it; as both grow the pool runs
    out and X's entry is evicted. The 300 cells Y forked are still held (llama.cpp frees a
    cell only when no sequence holds it), so they stay booked, to Y: one of Y and W gives
    way, and both answer in full. Booking the evicted entry's cells as free let the two
    grow into cells that were not there (NoKVSlotError)."""
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=6)
    doc = tokens_of(pool, DOC * 5)
    x, y = doc[:300] + doc[400:410], doc[:300] + doc[500:510]
    assert pool.submit(A, x, 8, sampling=no_end(pool)).result().cached == 0
    running = [pool.submit(A, y, 400, sampling=no_end(pool)), pool.submit(A, doc[600:700], 400, sampling=no_end(pool))]
    y_result, w_result = [r.result() for r in running]
    assert y_result.cached == 300 and [len(y_result.generated), len(w_result.generated)] == [400, 400]
    assert booked(pool) == 1024
    pool.close()


def test_requests_book_as_they_grow_and_one_gives_way_when_the_pool_is_full(conductor):
    """Two requests of 600 tokens each in 1,024 cells: each books its prompt and a little
    more, so both start at once (booked whole, the second would wait for the first); when
    the pool runs out, the one that comes last gives its cells up, its KV copied to host
    RAM (it forked nothing, and a copy is tried while unmeasured), and comes back once it
    can book all it may need. Both answer in full; none fails; nothing leaks, in the pool
    or in the swap ledger."""
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=6)
    doc = tokens_of(pool, DOC * 5)
    prompts = [doc[:100], doc[200:300]]
    events, lock = [], threading.Lock()

    def watcher(i: int):
        count = [0]

        def on_token(_token, _logprobs) -> bool:
            count[0] += 1
            if count[0] in (1, 600):
                with lock:
                    events.append(("first" if count[0] == 1 else "last", i))
            return True
        return on_token
    requests = [pool.submit(A, p, 600, sampling=no_end(pool), on_token=watcher(i)) for i, p in enumerate(prompts)]
    results = [r.result() for r in requests]
    assert [len(r.generated) for r in results] == [600, 600]
    assert [kind for kind, _ in events][:2] == ["first", "first"], events
    steps = pool.stats()["steps"]
    assert steps.preemptions >= 1 and steps.swapped >= 1
    assert booked(pool) == 1024 and conductor.swap.allocated == 0
    pool.close()


def test_a_request_that_forked_a_document_re_reads_rather_than_swaps(conductor):
    """Two requests forking a kept 300-token prefix grow past 1,024 cells: the one that
    gives way is not copied to host RAM (it forks the prefix again on its return; a copy
    would hold those cells twice); it re-reads its own tokens, and both answer in full."""
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=6)
    doc = tokens_of(pool, DOC * 5)
    pool.submit(A, doc[:310], 8, sampling=no_end(pool)).result()
    running = [pool.submit(A, doc[:300] + doc[k:k + 10], 400, sampling=no_end(pool)) for k in (400, 500)]
    results = [r.result() for r in running]
    assert [len(r.generated) for r in results] == [400, 400] and all(r.cached == 300 for r in results)
    steps = pool.stats()["steps"]
    assert steps.preemptions >= 1 and steps.swapped == 0
    assert booked(pool) == 1024
    pool.close()


def test_requests_and_a_conversation_of_one_model_take_turns_without_rebuilding(conductor):
    """A conversation agent (lmxd's pool of the model) DECODEs between requests over one
    document: each pool stays open while the other is live (the request pool was closed,
    its kept cells lost, at every switch; then the conversations' pool was, its agent
    paused to host RAM), so the second request forks the document, the agent's second
    DECODE is not restored, and each context was made once."""
    pool = RequestPool(conductor, MODEL, cells=2048, seqs=4)
    doc = tokens_of(pool, DOC * 3)[:600]
    talker = conductor.register("talker", MODEL, n_ctx=512)
    assert pool.submit(A, doc + [11], 4).result().cached == 0
    assert conductor.decode("talker", 4, "Hello there").text is not None
    assert pool.submit(A, doc + [12], 4).result().cached == 600
    again = conductor.decode("talker", 4, " and again")
    assert not again.restored and again.evicted is None
    assert pool.stats()["opens"] == 1
    assert conductor.scheduler.pools[pool_key(talker)].opens == 1
    pool.close()


def test_each_pool_of_a_model_books_its_own_compute_buffer_once(conductor):
    """The request pool and the conversations' pool of one model are two contexts, open
    at once: each books a compute buffer (once, however many agents), the weights are
    booked once, and each booking goes with the last agent of its pool."""
    ledger = conductor.ledger
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=4)
    conductor.register("one", MODEL, n_ctx=512)
    conductor.register("two", MODEL, n_ctx=512)
    held = dict(ledger._held)
    computes = {k: v for k, v in held.items() if k.kind == "compute"}
    assert sorted(k.name.rsplit(":", 1)[1] for k in computes) == ["agents", "requests"]
    assert all(k.owner is None for k in computes)                 # shared: nobody's share counts them
    weights = [v for k, v in held.items() if k.kind == "model"]
    assert len(weights) == 1 and weights[0] == pool.reservation.loaded.measured_bytes
    assert len(set(computes.values())) == 1 and ledger.allocated == sum(held.values())
    conductor.unregister("one")
    assert sum(k.kind == "compute" for k in ledger._held) == 2
    conductor.unregister("two")
    assert [k.name.rsplit(":", 1)[1] for k in ledger._held if k.kind == "compute"] == ["requests"]
    pool.close()
    assert ledger.allocated == 0
