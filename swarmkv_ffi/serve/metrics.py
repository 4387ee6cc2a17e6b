"""GET /metrics: the server's figures in Prometheus' text format, written by prometheus-client.

Two views, so that no key learns another's figures:

- **the operator's**: everything: requests running and waiting; per hosted model (label
  `model`) its pool's cells (free, booked by running requests, booked by kept prefixes),
  sequences, opens, host-RAM tier, steps and the decode rows each carried, preemptions;
  prompt tokens and how many came from cache (per tier: the pool's cells, host RAM, or
  the disk store), prefills avoided, generated tokens. Given to a scrape
  with `--metrics-key`, or to anyone on a server without keys (loopback, as /v1 is).
- **a key's own**: the same request and token counters, of that key's requests only, and
  nothing of the pool (its cells and steps are everyone's traffic). Given to a scrape
  with an API key.

Both views also carry llama-server's own `llamacpp:` figures (tools/server/server-task.cpp),
under its names, types and help, so that dashboards and alerts written for llama-server read
ours: prompt and generated tokens with their seconds, cached prompt tokens, the longest
sequence, requests processing; the operator's also the decode calls, the rows each carried
and the requests waiting. `--no-metrics` turns the route off (501), as llama-server's is
without `--metrics`.

A fresh registry is filled per scrape from the engine's state and the per-key Tally (a
custom collector, as prometheus-client documents for figures kept elsewhere), so the
library writes the format and nothing is a process-wide global.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Upper bounds of the decode-rows-per-step histogram's buckets.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class KeyCounts:
    requests: int = 0            # choices ended (answered, stopped or failed)
    prompt_tokens: int = 0       # once per prompt, as `usage` counts them
    cached_pool: int = 0         # prompt tokens forked from the pool's cells
    cached_host: int = 0         # prompt tokens restored from host RAM (evicted prefixes)
    cached_disk: int = 0         # prompt tokens restored from the --cache-dir store
    prefills_avoided: int = 0    # prompts that forked or restored a cached prefix
    generated: int = 0
    prompt_seconds: float = 0.0  # from a request's start to its first token, once per prompt
    generated_seconds: float = 0.0   # from a choice's first token to its end
    longest: int = 0             # the most tokens one choice held (prompt and generated)


#: The APIs requests come in by (swarmkv_requests_by_api_total's label).
APIS = ("chat", "completions", "responses", "messages", "embeddings", "rerank")


class Tally:
    """Each owner's counters, bumped as choices end (Call._run, on their own threads), and
    the requests each owner made by API."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[int, KeyCounts] = {}
        self._by_api: dict[tuple[int, str], int] = {}

    def asked(self, owner: int, api: str) -> None:
        """A request of owner's through `api` (one of APIS) was admitted to run."""
        with self._lock:
            self._by_api[owner, api] = self._by_api.get((owner, api), 0) + 1

    def by_api(self, owner: int | None) -> dict[str, int]:
        with self._lock:
            return {api: sum(n for (o, a), n in self._by_api.items() if a == api and owner in (None, o))
                    for api in APIS}

    def ended(self, owner: int, result, prompt_tokens: int, first_of_prompt: bool,
              seconds: tuple[float, float] = (0.0, 0.0)) -> None:
        """A choice ended with `result` (a RequestResult, or None when it failed) after
        `seconds` (reading its prompt, generating); the first choice of each prompt counts
        the prompt, its seconds and what of it was cached."""
        with self._lock:
            c = self._counts.setdefault(owner, KeyCounts())
            c.requests += 1
            if result is None:
                return
            c.generated += len(result.generated)
            c.generated_seconds += seconds[1]
            c.longest = max(c.longest, prompt_tokens + len(result.generated))
            if first_of_prompt:
                c.prompt_tokens += prompt_tokens
                c.prompt_seconds += seconds[0]
                if result.cached:
                    c.prefills_avoided += 1
                    tier = f"cached_{result.tier or 'pool'}"
                    setattr(c, tier, getattr(c, tier) + result.cached)

    def counts(self, owner: int | None) -> KeyCounts:
        """One owner's counters, or (None) every owner's summed (the longest: the most)."""
        with self._lock:
            chosen = [c for o, c in self._counts.items() if owner is None or o == owner]
            return KeyCounts(*((max if f == "longest" else sum)([getattr(c, f) for c in chosen] or [0])
                               for f in KeyCounts.__dataclass_fields__))


class _Collector:
    """The figures of one scrape: `owner` None for the operator's view, else that key's."""

    def __init__(self, engine, owner: int | None):
        self.engine, self.owner = engine, owner

    def collect(self):
        engine, owner = self.engine, self.owner
        c = engine.tally.counts(owner)
        yield _counter("requests", "Choices of requests that ended (answered, stopped or failed)", c.requests)
        by_api = CounterMetricFamily("swarmkv_requests_by_api", "Requests run, by the API they came in by: "
                                     "chat completions, completions, Responses, Anthropic Messages, embeddings, "
                                     "rerank", labels=["api"])
        for api, n in engine.tally.by_api(owner).items():
            by_api.add_metric([api], n)
        yield by_api
        yield _counter("prompt_tokens", "Prompt tokens of requests, once per prompt", c.prompt_tokens)
        cached = CounterMetricFamily("swarmkv_prompt_tokens_cached", "Prompt tokens taken from cache instead "
                                     "of prefilled, by tier: the pool's cells, host RAM (evicted prefixes), "
                                     "or the --cache-dir store",
                                     labels=["tier"])
        cached.add_metric(["pool"], c.cached_pool)
        cached.add_metric(["host"], c.cached_host)
        cached.add_metric(["disk"], c.cached_disk)
        yield cached
        yield _counter("prefills_avoided", "Prompts that started from a cached prefix", c.prefills_avoided)
        yield _counter("generation_tokens", "Tokens generated", c.generated)
        yield _gauge("requests_running", "Choices admitted and not yet ended (running or waiting for a seat)",
                     engine.in_flight(owner))
        if owner is not None:
            return                          # the pool's figures are every key's traffic
        yield _gauge("requests_waiting", "Choices waiting for a seat in a pool", engine.conductor.scheduler.waiting())
        ledger = engine.conductor.ledger
        memory = GaugeMetricFamily("swarmkv_memory_bytes", "The memory ledger: bytes booked (weights, cells, "
                                   "compute buffers of every loaded model) and its limit", labels=["state"])
        memory.add_metric(["booked"], ledger.allocated)
        memory.add_metric(["limit"], ledger.limit())
        yield memory
        yield from _models(engine.models.entries)
        yield from _pools(engine.models.loaded())


def llama_server(engine, owner: int | None) -> str:
    """llama-server's `llamacpp:` figures in its own text: of the owner's requests, and for
    the operator (owner None) also the decode calls of every pool and the requests waiting.
    Written here, not by prometheus-client: llama-server's counter n_tokens_max has no
    `_total`, which the library adds to a counter's TYPE line, and dashboards read the names
    as llama-server writes them. A choice's prompt seconds run from its request's start to
    its first token, so they include the wait for a seat (as the answers' `timings` do)."""
    c = engine.tally.counts(owner)
    cached = c.cached_pool + c.cached_host + c.cached_disk
    waiting = engine.conductor.scheduler.waiting() if owner is None else 0
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", c.prompt_tokens - cached),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
        ("prompt_seconds_total", "Total time spent processing prompts", c.prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", c.generated),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", c.generated_seconds),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", c.longest),
    ] + [(f"spec_decode_{name}_total", f"Speculative: {doc} (this server does not speculate: 0)", 0)
         for name, doc in (("num_draft_tokens", "Total draft tokens generated"),
                           ("num_accepted_tokens", "Total draft tokens accepted by the target model"),
                           ("num_drafts", "Total speculative decoding verification steps"))]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         _per_second(c.prompt_tokens - cached, c.prompt_seconds)),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         _per_second(c.generated, c.generated_seconds)),
        ("requests_processing", "Number of requests processing", engine.in_flight(owner) - waiting),
    ]
    if owner is None:
        tallies = [t for t in (model.pool.stats()["steps"] for _, model in engine.models.loaded()) if t is not None]
        decodes = sum(t.steps for t in tallies)
        counters.append(("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding "
                         "and multimodal decoding", decodes))
        gauges += [("requests_deferred", "Number of requests deferred", waiting),
                   ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                    sum(t.decode_rows for t in tallies) / max(decodes, 1))]
    return "".join(f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {float(value)}\n"
                   for kind, items in (("counter", counters), ("gauge", gauges)) for name, doc, value in items)


def _per_second(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def _models(entries):
    """Each served model's state and how many times it was loaded and unloaded."""
    label = ["model"]
    loaded = GaugeMetricFamily("swarmkv_model_loaded", "1 while the model is loaded, else 0", labels=label)
    loads = CounterMetricFamily("swarmkv_model_loads", "Times the model was loaded (at start or on demand)",
                                labels=label)
    unloads = CounterMetricFamily("swarmkv_model_unloads", "Times the model was unloaded (idle past its "
                                  "keep_alive, or its memory needed by another model)", labels=label)
    for entry in entries:
        loaded.add_metric([entry.names[0]], entry.state == "loaded")
        loads.add_metric([entry.names[0]], entry.loads)
        unloads.add_metric([entry.names[0]], entry.unloads)
    yield from (loaded, loads, unloads)


def _pools(hosted: list):
    """Each hosted model's pool (label `model`): its cells, sequences, opens, host tier and steps."""
    label = ["model"]
    cells = GaugeMetricFamily("swarmkv_kv_cells", "A request pool's KV cells, by state: all of them, free, "
                              "booked by running requests, booked by kept prefixes (each cell booked once, "
                              "however many sequences share it)", labels=label + ["state"])
    seqs = GaugeMetricFamily("swarmkv_sequences", "A pool's sequences in use, by kind", labels=label + ["kind"])
    opens = CounterMetricFamily("swarmkv_pool_opens", "Times a request pool's context was made (once, unless "
                                "something rebuilt it: its cached cells are lost each time)", labels=label)
    held = GaugeMetricFamily("swarmkv_host_cache_bytes", "Host RAM holding a pool's evicted prefixes' KV, and "
                             "its limit (--host-cache-mib)", labels=label + ["state"])
    entries = GaugeMetricFamily("swarmkv_host_cache_entries", "Evicted prefixes held in host RAM", labels=label)
    demoted = CounterMetricFamily("swarmkv_host_cache_demoted", "Prefixes that left host RAM for room (to "
                                  "--cache-dir, or dropped without one)", labels=label)
    counters = {field: CounterMetricFamily(f"swarmkv_{name}", doc, labels=label) for name, field, doc in STEP_COUNTERS}
    rows = CounterMetricFamily("swarmkv_step_rows", "Batch rows the steps carried, by kind", labels=label + ["kind"])
    per_step = HistogramMetricFamily("swarmkv_step_decode_rows", "Decode rows per step (requests generating "
                                     "together)", labels=label)
    for name, model in hosted:
        stats = model.pool.stats()
        for state, key in (("total", "cells"), ("free", "cells_free"), ("running", "cells_running"),
                           ("kept", "cells_kept")):
            cells.add_metric([name, state], stats[key])
        seqs.add_metric([name, "running"], stats["running"])
        seqs.add_metric([name, "kept"], stats["kept"])
        opens.add_metric([name], stats["opens"])
        tier = model.host_tier
        if tier is not None:
            held.add_metric([name, "used"], tier.nbytes)
            held.add_metric([name, "limit"], tier.limit)
            entries.add_metric([name], len(tier.entries))
            demoted.add_metric([name], tier.demoted)
        tally = stats["steps"]
        if tally is not None:
            for field, family in counters.items():
                family.add_metric([name], getattr(tally, field))
            rows.add_metric([name, "decode"], tally.decode_rows)
            rows.add_metric([name, "prompt"], tally.prompt_rows)
            per_step.add_metric([name], *_buckets(tally.by_decode_rows))
    yield from (cells, seqs, opens, held, entries, demoted, *counters.values(), rows, per_step)


#: The steps' counters: (metric, the StepTally field it reads, what it counts).
STEP_COUNTERS = (
    ("steps", "steps", "Batched decode steps of a pool"),
    ("step_seconds", "seconds", "Seconds spent in those steps"),
    ("preemptions", "preemptions", "Running requests that gave their cells up for others to grow (their KV "
                                   "went to host RAM, or they re-read their tokens later)"),
    ("preemptions_swapped", "swapped", "Of those, the ones whose KV went to host RAM (cheaper, as measured, "
                                       "than re-reading it)"),
)


def _buckets(by_decode_rows: dict[int, int]) -> tuple[list, float]:
    """The histogram's cumulative buckets and sum, from how many steps carried each number of rows."""
    seen = dict(by_decode_rows)
    buckets = [(str(float(bound)), sum(n for rows, n in seen.items() if rows <= bound)) for bound in ROW_BUCKETS]
    buckets.append(("+Inf", sum(seen.values())))
    return buckets, sum(r * n for r, n in seen.items())


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"swarmkv_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"swarmkv_{name}", doc, value=value)


def render(engine, owner: int | None) -> bytes:
    """The exposition of one scrape (owner None: the operator's view)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, owner))
    return generate_latest(registry) + llama_server(engine, owner).encode()
