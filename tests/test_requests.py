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
from swarmkv_ffi.conductor.ledger import Ledger
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
    return sum(s.cells for s in p.seats.values()) + sum(k.cells for k in p.kept.values()) + p.cells_free


def no_end(pool: RequestPool) -> dict:
    """Sampling that never picks an end-of-generation token: a request runs to max_tokens."""
    model = pool.model
    return {"logit_bias": {t: -1e9 for t in range(model.n_vocab) if model.is_eog(t)}}


def test_siblings_over_one_prompt_book_it_once_and_all_run_together(conductor):
    """16 requests over one 900-token prompt: each books its own tokens only, so all 16 fit
    a pool where booking the prompt 16 times would seat 3 (every first token comes before
    any request's last)."""
    pool = RequestPool(conductor, MODEL, cells=3072, seqs=20)
    prompt = tokens_of(pool, DOC * 5)[:900]
    events, lock = [], threading.Lock()

    def watcher(i: int):
        count = [0]

        def on_token(_token, _logprobs) -> bool:
            count[0] += 1
            with lock:
                events.append(("first" if count[0] == 1 else "last" if count[0] == 8 else "", i))
            return True
        return on_token
    requests = [pool.submit(A, prompt, 8, on_token=watcher(i), sampling=no_end(pool)) for i in range(16)]
    results = [r.result() for r in requests]
    assert all(len(r.generated) == 8 for r in results)
    assert sum(r.cached > 0 for r in results) == 15
    order = [kind for kind, _ in events if kind]
    assert order.index("last") > max(i for i, k in enumerate(order) if k == "first"), order
    assert booked(pool) == 3072
    pool.close()


def test_cells_forked_from_an_evicted_prefix_stay_booked(conductor):
    """Y forks X's kept prompt and runs on; Z needs the room and evicts X's entry. The cells
    Y forked are still Y's (llama.cpp frees a cell only when no sequence holds it), so Z
    waits for Y rather than being seated into cells that are not there: both answer in
    full. Booking the evicted entry's cells as free made Y's decode run out of cells."""
    pool = RequestPool(conductor, MODEL, cells=1024, seqs=6)
    doc = tokens_of(pool, DOC * 5)
    x, y = doc[:300] + doc[400:410], doc[:300] + doc[500:510]
    assert pool.submit(A, x, 8, sampling=no_end(pool)).result().cached == 0
    started = threading.Event()
    running = pool.submit(A, y, 400, sampling=no_end(pool), on_token=lambda *_: started.set() or True)
    started.wait(60)
    z = pool.submit(A, doc[600:1000], 4, sampling=no_end(pool)).result()
    y_result = running.result()
    assert y_result.cached == 300 and len(y_result.generated) == 400
    assert len(z.generated) == 4 and z.cached == 0
    assert booked(pool) == 1024
    pool.close()
