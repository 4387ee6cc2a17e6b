"""The layers of swarmkv_ffi, written down once: a module may import only from its own layer
or below, and no modules import each other in a circle.

Every import counts, at the top of a module or inside a function (a deferred import is
still a dependency), read from the source with `ast`, nothing imported. A module that is
in no layer fails the test too: a new module is placed here when it is written.
"""
from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Lowest first. Names are relative to swarmkv_ffi; a package's name stands for its __init__.
LAYERS: list[list[str]] = [
    ["errors", "cpu", "procmem", "_cdef", "tiny_gguf"],                 # no libllama
    ["kernels", "kernels.*"],                                           # Numba CUDA, on their own
    ["calibration"],                                                    # the kernel rule, handed the library
    ["library"],                                                        # libllama by cffi
    ["_owned", "model", "batch", "exact", "context", "sampler", "arena", "fattn", "shaped_gguf"],   # the binding
    ["kvcache", "kvcache.prefix", "kvcache.thresholds", "kvcache.tier", "kvcache.costs", "kvcache.radix",
     "kvcache.device"],  # the cache's words
    ["catalog", "snapshot", "kvcache.files", "generate", "probe", "grammar"],   # models, KV state, one answer
    ["fanout", "fanout.*", "distributed"],                              # the fan-out, and on Ray
    ["admission", "admission.keys"],                                    # who fits: the ledgers' typed keys
    ["admission.*"],                                                    # ... ledger, memory, quotas
    ["kvcache.host", "kvcache.disk"],                                   # the tiers below the cells
    ["conductor.policy", "conductor.common_prompts", "conductor.modelfile", "conductor.registry", "conductor.estimate",
     "conductor.sandbox"],                                                # the conductor's parts
    ["conductor.request_cells"],                                        # a request pool's kept cells
    ["conductor.pool"],                                                 # a model's shared context
    ["conductor.agent"],                                                # an agent's record, its pool key
    ["conductor.runs"],                                                 # a DECODE's record, a pool's tally
    ["conductor.seating", "conductor.step"],                            # choose and seat; plan, run, apply a step
    ["conductor.scheduler"],                                            # the thread of the batched steps
    ["conductor.booking", "conductor.swap"],                            # the Conductor's bookings, host-RAM KV
    ["conductor.own"],                                                  # ... users' own contexts
    ["conductor.agents"],                                               # the Conductor
    ["conductor.requests"],                                             # request pools
    ["conductor"],                                                      # the engine's door
    ["lmxd.protocol", "lmxd.lines", "lmxd.client"],                     # lmxd's front: the line protocol
    ["lmxd.access", "lmxd.server"],                                     # ... the socket server
    ["serve", "serve.schemas", "serve.keys", "serve.text", "serve.routing", "serve.templates",
     "serve.guard", "serve.metrics", "serve.sizing", "serve.lineup", "serve.volatile", "serve.stored", "serve.telemetry",
     "serve.churn"],
    ["serve.errors", "serve.settings", "serve.dialects", "serve.embeddings"],
    ["serve.rerank"],                                                   # llama-server's /rerank, on embeddings
    ["serve.structured"],
    ["serve.hosted"],                                                   # one model: its pool, tier, size
    ["serve.loading"],                                                  # load on demand, unload when idle
    ["serve.engine"],                                                   # serve/ on conductor.requests
    ["serve.calls"],
    ["serve.responses"],                                                # chat and text completions' shapes
    ["serve.openai_responses"],                                         # the Responses API, as a chat request
    ["serve.anthropic", "serve.llama_native"],                          # the Messages API; llama-server's own routes
    ["serve.routes"],
    ["serve.vertex"],                                                   # Google Vertex AI's /predict
    ["serve.app"],
    ["serve.http", "serve.on_ray"],
    ["serve.cli"],
    ["lmxd", "lmxd.__main__", "cli", "bench", "bench.*"],             # the programs
]


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module: its name relative to swarmkv_ffi -> (file, is a package)."""
    found = {}
    for path in (ROOT / "swarmkv_ffi").rglob("*.py"):
        parts = list(path.relative_to(ROOT / "swarmkv_ffi").with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        if parts:                       # the package itself: the users' façade, above everything
            found[".".join(parts)] = (path, is_pkg)
    for path in (ROOT / "kernels").glob("*.py"):   # installed as swarmkv_ffi.kernels.*
        found[f"kernels.{path.stem}"] = (path, False)
    return found


def imports(name: str, path: Path, is_pkg: bool, known: dict) -> set[str]:
    """The swarmkv_ffi modules `name` imports."""
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["swarmkv_ffi"] + (package.split(".") if package else [])
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}".removeprefix("swarmkv_ffi.") in known else mod
                       for a in node.names]
        else:
            continue
        out |= {t.removeprefix("swarmkv_ffi.") for t in targets if t.startswith("swarmkv_ffi.")}
    return {t for t in out if t in known and t != name}


def layer_of(name: str) -> int:
    for i, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    raise LookupError(name)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, is_pkg, known) for name, (path, is_pkg) in known.items()}


def test_every_module_has_a_layer(graph):
    unplaced = []
    for name in graph:
        try:
            layer_of(name)
        except LookupError:
            unplaced.append(name)
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"


def test_no_module_imports_from_a_higher_layer(graph):
    upward = [f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"
              for name, deps in sorted(graph.items()) for dep in sorted(deps) if layer_of(dep) > layer_of(name)]
    assert not upward, "\n".join(upward)


#: The engine's fronts: they reach it through its door (swarmkv_ffi.conductor) alone.
FRONTS = ("lmxd", "serve", "bench")


def test_the_fronts_import_only_the_engines_door(graph):
    """lmxd, serve/ and the benchmarks use the conductor through the names its __init__
    exports, never one of its modules: the engine's insides can move without them."""
    inside = [f"{name} imports {dep}" for name, deps in sorted(graph.items())
              if name.split(".")[0] in FRONTS for dep in sorted(deps) if dep.startswith("conductor.")]
    assert not inside, "import these from swarmkv_ffi.conductor (add them to its __all__):\n" + "\n".join(inside)


def test_no_circle(graph):
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_scan_sees_what_it_must(tmp_path):
    """The checks above can fail: an import back up from the conductor to serve/, inside a
    function as start_http had it, and a circle, are both found."""
    fake = tmp_path / "probe.py"
    fake.write_text("def start_http():\n    from ..serve.http import Front\n")
    deps = imports("conductor.probe", fake, False, modules())
    assert deps == {"serve.http"} and layer_of("serve.http") > layer_of("conductor.agents")
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


#: What the prefix cache is made of: defined in kvcache/ and nowhere else (issue 62).
PREFIX_CACHE_NAMES = {"PrefixTier", "PrefixStore", "PrefixCache", "HostTier", "DiskTier", "Costs", "Kept", "KeptCells",
                      "RadixTree",
                      "heir", "fair_share", "frees_prefix",
                      "longest_common_prefix", "common_prefix_len", "KEEP_MIN", "WAIT_FOR_PREFIX", "HOST_MIN",
                      "MIN_TOKENS", "DISK_MIN", "RECALL_MIN", "REPLAY_MAX", "TAIL"}


def definitions(path: Path) -> set[str]:
    """The classes, functions and module-level constants a file defines."""
    tree = ast.parse(path.read_text(), str(path))
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return names


def test_prefix_caching_has_one_home():
    """How a prefix is matched, kept, demoted and restored is read in swarmkv_ffi/kvcache/
    alone: none of its names is defined elsewhere (the pool's and scheduler's kept-cell
    bookkeeping uses them, from there)."""
    stray = [f"{name} defines {sorted(definitions(path) & PREFIX_CACHE_NAMES)}"
             for name, (path, _) in sorted(modules().items())
             if not name.startswith("kvcache") and definitions(path) & PREFIX_CACHE_NAMES]
    assert not stray, "move these to swarmkv_ffi/kvcache/:\n" + "\n".join(stray)


#: The engine's rooms stay small enough to read in one sitting (issue 62).
MAX_ENGINE_LINES = 450
#: The modules that seat and step sequences: what a sequence is for (a conversation, a
#: request, a reservation) is the pool's and the agent's business, never a branch here.
KIND_BLIND = ["conductor.pool", "conductor.request_cells", "conductor.seating", "conductor.step",
              "conductor.scheduler", "conductor.runs"]


def kind_branches(path: Path) -> list[int]:
    """The lines where `path` reads a member of Kind (Kind.REQUEST, ...)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Kind"]


def test_no_module_of_the_engine_is_over_its_size():
    found = modules()
    long = {name: n for name, (path, _) in found.items() if name.startswith("conductor")
            and (n := len(path.read_text().splitlines())) > MAX_ENGINE_LINES}
    assert not long, f"split these (over {MAX_ENGINE_LINES} lines): {long}"


def test_the_pool_and_the_scheduler_never_branch_on_an_agents_kind():
    found = modules()
    branches = {name: kind_branches(found[name][0]) for name in KIND_BLIND}
    assert not any(branches.values()), f"Kind read at these lines: {branches}"


def test_the_kind_scan_sees_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(agent):\n    if agent.kind is Kind.REQUEST:\n        return 1\n")
    assert kind_branches(probe) == [2]


@pytest.mark.parametrize("protocol, modules", [
    ("scheduler.Host", ("scheduler", "seating", "step")),
    ("pool.PoolHost", ("pool", "request_cells")),
])
def test_the_conductor_is_everything_its_engine_asks_of_its_host(protocol, modules):
    """scheduler.Host and pool.PoolHost declare what the scheduler and a pool call on the
    conductor; the Conductor has each of those methods, with the same parameters, and
    those modules call no other."""
    import importlib
    import inspect
    import re

    from swarmkv_ffi.conductor.agents import Conductor

    module, name = protocol.split(".")
    host = getattr(importlib.import_module(f"swarmkv_ffi.conductor.{module}"), name)
    declared = {n for n, f in vars(host).items() if inspect.isfunction(f) and not n.startswith("_")}
    def params(fn) -> list[str]:
        return [p for p in inspect.signature(fn).parameters if p != "self"]   # (a staticmethod has none)
    for method in declared:
        assert params(getattr(Conductor, method)) == params(getattr(host, method)), method
    called = set()
    for module in modules:
        called |= set(re.findall(r"self\.host\.(\w+)", (ROOT / f"swarmkv_ffi/conductor/{module}.py").read_text()))
    assert called == declared


def test_test_modules_never_import_each_other():
    """A test module's helpers live in tests/*.py (shared) or in the module itself: with the
    modules in folders, `from test_serve import ...` would find test_serve only when
    pytest happened to collect it first."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not found, found
