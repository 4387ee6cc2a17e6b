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
