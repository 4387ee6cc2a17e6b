"""The DAG orchestrator: order, failures, cycles, gates, timeouts. Every test has a
timeout so a hang fails instead of stalling the suite."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from swarmkv_ffi.fanout.dag import Dag, DagError, DagTimeoutError

pytestmark = pytest.mark.timeout(20)


def test_results_flow_along_edges():
    dag = Dag()
    dag.add("a", lambda _: 2)
    dag.add("b", lambda i: i["a"] * 10, deps=["a"])
    dag.add("c", lambda i: i["a"] + 1, deps=["a"])
    dag.add("d", lambda i: i["b"] + i["c"], deps=["b", "c"])
    assert dag.run(max_workers=2) == {"a": 2, "b": 20, "c": 3, "d": 23}


def test_independent_nodes_run_concurrently():
    barrier = threading.Barrier(3, timeout=5)
    dag = Dag()
    for name in "xyz":
        dag.add(name, lambda _: barrier.wait())
    dag.run(max_workers=3)  # would raise BrokenBarrierError if they ran one at a time


def test_duplicate_name_rejected():
    dag = Dag()
    dag.add("a", lambda _: 1)
    with pytest.raises(DagError, match="duplicate node name 'a'"):
        dag.add("a", lambda _: 2)


def test_unknown_dependency_rejected():
    dag = Dag()
    dag.add("a", lambda _: 1, deps=["ghost"])
    with pytest.raises(DagError, match="unknown node 'ghost'"):
        dag.run()


def test_cycle_is_named():
    dag = Dag()
    dag.add("a", lambda _: 1, deps=["c"])
    dag.add("b", lambda _: 1, deps=["a"])
    dag.add("c", lambda _: 1, deps=["b"])
    dag.add("free", lambda _: 1)
    with pytest.raises(DagError) as info:
        dag.run()
    msg = str(info.value)
    assert "cycle" in msg and "a" in msg and "b" in msg and "c" in msg and "free" not in msg


def test_self_loop_is_a_cycle():
    dag = Dag()
    dag.add("a", lambda _: 1, deps=["a"])
    with pytest.raises(DagError, match="edge 'a' -> 'a'"):
        dag.run()


class Boom(RuntimeError):
    pass


def test_failure_propagates_the_original_exception():
    original = Boom("prefill broke")
    ran = []

    def fail(_):
        raise original

    dag = Dag()
    dag.add("prefill", fail)
    dag.add("branch1", lambda _: ran.append(1), deps=["prefill"])
    dag.add("branch2", lambda _: ran.append(2), deps=["branch1"])
    dag.add("other", lambda _: "fine")
    with pytest.raises(Boom) as info:
        dag.run(timeout=10)
    assert info.value is original
    assert ran == []
    assert dag.nodes["branch2"].future.exception() is original
    assert dag.nodes["other"].future.result() == "fine"


def test_gate_holds_a_node_until_resolved():
    gate = Future()
    order = []

    def opener(_):
        order.append("opener")
        time.sleep(0.05)
        gate.set_result(None)

    dag = Dag()
    dag.add("waiter", lambda _: order.append("waiter"), gates=[gate])
    dag.add("opener", opener)
    dag.run(max_workers=1, timeout=10)  # one worker: a blocking wait would deadlock here
    assert order == ["opener", "waiter"]


def test_failed_gate_fails_the_node():
    gate = Future()
    gate.set_exception(Boom("watermark never reached"))
    dag = Dag()
    dag.add("branch", lambda _: 1, gates=[gate])
    with pytest.raises(Boom):
        dag.run(timeout=5)


def test_timeout_names_pending_nodes():
    never = Future()
    dag = Dag()
    dag.add("stuck", lambda _: 1, gates=[never])
    dag.add("slow", lambda _: time.sleep(0.2))
    t0 = time.monotonic()
    with pytest.raises(DagTimeoutError, match="stuck"):
        dag.run(timeout=0.1)
    assert time.monotonic() - t0 < 2


def test_timeout_stops_and_joins_running_nodes_before_raising():
    """A node still running when run() gives up is told to stop and waited for: after
    run() raises, nothing the caller frees next can still be in use."""
    dag = Dag()
    finished = []

    def worker(_):
        while not dag.stop.wait(0.01):
            pass
        time.sleep(0.2)          # cleaning up after noticing the stop
        finished.append(True)
    dag.add("worker", worker)
    with pytest.raises(DagTimeoutError, match="worker"):
        dag.run(timeout=0.1)
    assert finished == [True]
    assert not [t for t in threading.enumerate() if t.name.startswith("dag")]
