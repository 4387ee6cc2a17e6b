"""The embeddings context's lock (serve/embeddings.TakeTurns): keys waiting for it take
turns, so one key's many waiting decodes do not all go before another key's one."""
from __future__ import annotations

import threading
import time

import pytest

from swarmkv_ffi.serve.embeddings import TakeTurns

pytestmark = pytest.mark.unit


def queued(turns: TakeTurns, n: int) -> None:
    """Wait until n threads wait for their turn."""
    deadline = time.monotonic() + 10
    while sum(len(q) for q in turns._waiting.values()) < n:
        assert time.monotonic() < deadline, "the waiters never lined up"
        time.sleep(0.001)


def test_a_key_with_one_waiter_goes_before_another_keys_second():
    turns, order = TakeTurns(), []

    def work(owner: str, i: int) -> None:
        with turns.turn(owner):
            order.append(f"{owner}{i}")

    threads = []
    with turns.turn("A"):                      # held while the others line up, in a known order
        for i in range(4):
            threads.append(threading.Thread(target=work, args=("A", i)))
            threads[-1].start()
            queued(turns, i + 1)
        threads.append(threading.Thread(target=work, args=("B", 0)))
        threads[-1].start()
        queued(turns, 5)
    for t in threads:
        t.join(10)
    assert order == ["A0", "B0", "A1", "A2", "A3"]


def test_a_turn_is_free_at_once_and_given_back_on_error():
    turns = TakeTurns()
    with pytest.raises(ValueError):
        with turns.turn("A"):
            raise ValueError("the decode failed")
    done = threading.Event()
    threading.Thread(target=lambda: (turns.turn("B").__enter__(), done.set())).start()
    assert done.wait(5)
