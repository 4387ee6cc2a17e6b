"""A small DAG orchestrator: named nodes, dependency edges, a bounded worker pool.

A node runs when every dependency has finished and every gate (an external Future, such
as "prefill reached token W") has resolved. Scheduling is driven by completion callbacks,
so no worker ever blocks waiting for another node: a pool of any size cannot deadlock.

A node whose dependency or gate failed does not run; it fails with the *same* exception
object, and `run()` raises the first failure. `run(timeout=…)` never waits forever: on a
timeout it sets `dag.stop` (nodes that hold resources check it between steps and return
early), cancels what has not started, waits for the running nodes to end, and only then
raises DagTimeoutError naming the nodes that were pending: when run() returns or raises,
no node is still using what its caller may free next (a model, a context).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SwarmKVError


class DagError(SwarmKVError, ValueError):
    """The graph itself is wrong: duplicate name, unknown dependency, cycle."""


class DagTimeoutError(SwarmKVError, TimeoutError):
    """run() gave up waiting; the message names what was still pending."""


@dataclass
class Node:
    name: str
    fn: Callable[[dict[str, Any]], Any]
    deps: tuple[str, ...]
    gates: tuple[Future, ...]
    future: Future = field(default_factory=Future)


class DagStopped(SwarmKVError):
    """Raised by a node that noticed `dag.stop` (run() timed out) and gave up."""


class Dag:
    def __init__(self):
        self.nodes: dict[str, Node] = {}
        self.stop = threading.Event()

    def add(self, name: str, fn: Callable[[dict[str, Any]], Any], deps=(), gates=()) -> None:
        """Add node `name`; `fn` gets a dict {dependency name: its result}."""
        if name in self.nodes:
            raise DagError(f"duplicate node name {name!r}")
        self.nodes[name] = Node(name, fn, tuple(deps), tuple(gates))

    def check(self) -> list[str]:
        """Unknown dependencies and cycles are errors; returns a topological order."""
        for node in self.nodes.values():
            for dep in node.deps:
                if dep not in self.nodes:
                    raise DagError(f"node {node.name!r} depends on unknown node {dep!r}")
        white, grey, black = 0, 1, 2
        colour = {name: white for name in self.nodes}
        order: list[str] = []
        path: list[str] = []

        def visit(name: str) -> None:
            colour[name] = grey
            path.append(name)
            for dep in self.nodes[name].deps:
                if colour[dep] == grey:
                    cycle = path[path.index(dep):] + [dep]
                    raise DagError(f"cycle: {' -> '.join(cycle)} (edge {name!r} -> {dep!r})")
                if colour[dep] == white:
                    visit(dep)
            path.pop()
            colour[name] = black
            order.append(name)

        for name in self.nodes:
            if colour[name] == white:
                visit(name)
        return order

    def run(self, max_workers: int = 4, timeout: float | None = None) -> dict[str, Any]:
        """Run every node; return {name: result}. Raises the first node failure."""
        order = self.check()
        pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="dag")
        execution = _Execution(self, pool)
        timed_out = False
        try:
            execution.start(order)
            _, pending = wait([n.future for n in self.nodes.values()], timeout=timeout)
            if pending:
                timed_out = True
                names = sorted(n.name for n in self.nodes.values() if not n.future.done())
                self.stop.set()
                for f in pending:
                    f.cancel()
                raise DagTimeoutError(
                    f"DAG did not finish within {timeout} s; still pending: {', '.join(names)}")
        finally:
            # Running nodes are joined even after a timeout (they have been told to stop):
            # a node abandoned here could still be inside llama_decode on a context that
            # the caller frees as soon as we return.
            pool.shutdown(wait=True, cancel_futures=timed_out)
        if execution.failures:
            raise execution.failures[0]
        return {name: node.future.result() for name, node in self.nodes.items()}


class _Execution:
    """One run() of a Dag: starts each node from the completion callbacks of what it waits
    for, so no worker ever blocks on another node."""

    def __init__(self, dag: Dag, pool: ThreadPoolExecutor):
        self.nodes, self.pool = dag.nodes, pool
        self.dependents: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for dep in node.deps:
                self.dependents[dep].append(node.name)
        self.lock = threading.Lock()
        self.started: set[str] = set()
        self.failures: list[BaseException] = []

    def start(self, order: list[str]) -> None:
        for name in order:
            node = self.nodes[name]
            node.future.add_done_callback(lambda _f, n=name: self.on_done(n))
            for gate in node.gates:
                gate.add_done_callback(lambda _f, n=node: self.try_start(n))
        for name in order:
            self.try_start(self.nodes[name])

    def ready(self, node: Node) -> bool:
        return all(self.nodes[d].future.done() for d in node.deps) and all(g.done() for g in node.gates)

    def try_start(self, node: Node) -> None:
        """Submit node once everything it waits for is done, or fail it with the first
        upstream failure (the same exception object)."""
        with self.lock:
            if node.name in self.started or not self.ready(node):
                return
            self.started.add(node.name)
        upstream = [self.nodes[d].future for d in node.deps] + list(node.gates)
        for f in upstream:
            if f.cancelled():
                return
            if f.exception() is not None:
                _settle(node.future, exc=f.exception())
                return
        inputs = {d: self.nodes[d].future.result() for d in node.deps}
        self.pool.submit(self.execute, node, inputs)

    def execute(self, node: Node, inputs: dict) -> None:
        if node.future.cancelled():  # run() timed out meanwhile
            return
        try:
            result = node.fn(inputs)
        except BaseException as exc:  # noqa: BLE001 - handed to dependents verbatim
            with self.lock:
                self.failures.append(exc)
            _settle(node.future, exc=exc)
        else:
            _settle(node.future, result=result)

    def on_done(self, name: str) -> None:
        for child in self.dependents[name]:
            self.try_start(self.nodes[child])


def _settle(future: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve a node's future unless run() already cancelled it (timeout)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
