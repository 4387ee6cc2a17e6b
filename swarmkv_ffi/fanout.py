"""The fan-out engine: prefill a document once, fork its KV cache to N branches.

    document ─layout─▶ budget check ─▶ prefill (n_batch chunks, seq 0, positions 0..n-1)
       ├─ shared: llama_memory_seq_cp(0 → 1..N), one llama_decode per step for all branches
       └─ copy:   snapshot ─▶ per-branch copy ─▶ fresh context ─▶ restore ─▶ branch loop

Both modes run as a DAG (swarmkv_ffi.dag). A branch with a watermark W needs only the
first W document tokens: the prefill splits its chunks at W and the branch starts there,
while the rest of the document is still being read.

Timings are taken with time.perf_counter_ns, relative to the start of run_fanout:
  ready_ms        when the branch's share of the document was available
  fork_ms         seq_cp (shared) or copy + fresh context + restore (copy)
  activation_ms   from ready to the branch's first generated token (the "TTFT proxy")
  decode_ms       from the first to the last generated token
"""
from __future__ import annotations

import codecs
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from . import library
from .batch import Batch
from .budget import DEFAULT_HEADROOM, check_budget
from .context import Context, ContextParams
from .dag import Dag
from .errors import BudgetError, SnapshotMismatchError
from .generate import generate
from .model import Model
from .prompts import PromptLayout, layout
from .sampler import Sampler
from .snapshot import Snapshot, tokens_hash

MODES = ("shared", "copy")


@dataclass
class BranchSpec:
    """One question to answer. `watermark`: how many document tokens it needs (None = all)."""
    question: str
    max_tokens: int = 64
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    watermark: int | None = None


@dataclass
class BranchResult:
    index: int
    question: str
    n_prefix_used: int
    prompt_token_ids: list[int]
    prompt_text: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped_on_eog: bool = False
    ready_ms: float = 0.0
    fork_ms: float = 0.0
    activation_ms: float = 0.0
    decode_ms: float = 0.0
    tokens_per_s: float = 0.0
    first_logits: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("first_logits")
        return d


@dataclass
class FanoutResult:
    mode: str
    model: str
    n_prefix: int
    n_ctx: int
    prefill_ms: float
    prefill_skipped: bool
    snapshot_bytes: int
    total_ms: float
    branches: list[BranchResult]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["branches"] = [b.to_dict() for b in self.branches]
        return d


@dataclass
class _Plan:
    """Everything decided before any context or buffer exists."""
    model: Model
    layout: PromptLayout
    specs: list[BranchSpec]
    watermarks: list[int]
    n_ctx: int
    n_batch: int
    n_threads: int | None
    swa_full: bool
    t0: int

    def ms(self) -> float:
        return (time.perf_counter_ns() - self.t0) / 1e6

    def context(self, n_ctx: int, n_seq_max: int = 1, n_batch: int | None = None) -> Context:
        params = ContextParams(n_ctx=n_ctx, n_batch=n_batch or self.n_batch,
                               n_ubatch=min(self.n_batch, 512), n_seq_max=n_seq_max,
                               kv_unified=True, swa_full=self.swa_full)
        if self.n_threads:
            params.n_threads = self.n_threads
        return Context(self.model, params)

    def result(self, i: int) -> BranchResult:
        w = self.watermarks[i]
        tokens = np.concatenate([self.layout.prefix[:w], self.layout.suffixes[i]])
        return BranchResult(index=i, question=self.specs[i].question, n_prefix_used=w,
                            prompt_token_ids=tokens.tolist(), prompt_text=self.layout.texts[i])

    def sampler(self, i: int) -> Sampler:
        s = self.specs[i]
        return Sampler(temp=s.temp, top_p=s.top_p, seed=s.seed)


def plan_fanout(model: Model, document: str, specs: list[BranchSpec], *, n_ctx: int | None = None,
                n_batch: int = 512, headroom: int = DEFAULT_HEADROOM, chat: bool = True,
                n_threads: int | None = None) -> _Plan:
    """Tokenize, place watermarks and check the budget: no context exists yet."""
    t0 = time.perf_counter_ns()
    if not specs:
        raise ValueError("at least one branch is needed")
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    lay = layout(model, document, [s.question for s in specs], chat=chat)
    watermarks = []
    for i, s in enumerate(specs):
        if s.max_tokens < 1:
            raise ValueError(f"branch {i}: max_tokens must be >= 1, got {s.max_tokens}")
        w = lay.n_prefix if s.watermark is None else s.watermark
        if not 1 <= w <= lay.n_prefix:
            raise ValueError(f"branch {i}: watermark {w} outside 1..{lay.n_prefix} (document tokens)")
        watermarks.append(w)
    max_branch = max(len(lay.suffixes[i]) + s.max_tokens for i, s in enumerate(specs))
    n_ctx = n_ctx or _round_up(lay.n_prefix + max_branch + headroom, 256)
    check_budget(lay.n_prefix, max_branch, n_ctx, headroom)
    return _Plan(model, lay, list(specs), watermarks, n_ctx, n_batch, n_threads,
                 swa_full=model.n_swa > 0, t0=t0)


def run_fanout(model: Model, document: str, specs: list[BranchSpec], *, mode: str = "shared",
               n_ctx: int | None = None, n_batch: int = 512, headroom: int = DEFAULT_HEADROOM,
               chat: bool = True, n_threads: int | None = None,
               snapshot_in: Snapshot | None = None, snapshot_out: Callable[[Snapshot], None] | None = None,
               progress: Callable[[int, int], None] | None = None, keep_logits: bool = False,
               branch_workers: int = 1, timeout: float | None = 3600.0) -> FanoutResult:
    """Answer every branch over one prefill of `document`.

    snapshot_in: reuse a snapshot of this document (its tokens must match) and skip the
    prefill. snapshot_out: called with the document's snapshot once the prefill is done.
    progress(done, total): prefill progress in tokens. branch_workers: copy-mode branches
    that may run at once (each in its own context).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan = plan_fanout(model, document, specs, n_ctx=n_ctx, n_batch=n_batch, headroom=headroom,
                       chat=chat, n_threads=n_threads)
    if snapshot_in is not None:
        _check_snapshot_document(snapshot_in, plan.layout)
    dag = Dag()
    if mode == "shared":
        dag.add("shared", lambda _: _run_shared(plan, snapshot_in, snapshot_out, progress, keep_logits))
        results = dag.run(max_workers=1, timeout=timeout)["shared"]
        branches, prefill_ms, snapshot_bytes = results
    else:
        _add_copy_nodes(dag, plan, snapshot_in, snapshot_out, progress, keep_logits)
        out = dag.run(max_workers=branch_workers + 1, timeout=timeout)
        branches = [out[f"branch-{i}"] for i in range(len(specs))]
        prefill_ms, snapshot_bytes = out["prefill"]
    return FanoutResult(mode=mode, model=model.path.name, n_prefix=plan.layout.n_prefix,
                        n_ctx=plan.n_ctx, prefill_ms=prefill_ms, prefill_skipped=snapshot_in is not None,
                        snapshot_bytes=snapshot_bytes, total_ms=plan.ms(), branches=branches)


def _check_snapshot_document(snap: Snapshot, lay: PromptLayout) -> None:
    if snap.header.n_tokens != lay.n_prefix or snap.header.tokens_hash != tokens_hash(lay.prefix):
        raise SnapshotMismatchError(
            f"snapshot holds {snap.header.n_tokens} tokens (hash {snap.header.tokens_hash}) but "
            f"this document's prefix is {lay.n_prefix} tokens (hash {tokens_hash(lay.prefix)}): "
            "it was made from another document, model template or --chat setting")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _prefill_stops(plan: _Plan) -> list[int]:
    """Chunk boundaries: every n_batch tokens and at every watermark."""
    n = plan.layout.n_prefix
    stops = set(range(plan.n_batch, n, plan.n_batch)) | set(plan.watermarks) | {n}
    return sorted(stops)


# ---- copy mode --------------------------------------------------------------------------------
def _add_copy_nodes(dag: Dag, plan: _Plan, snapshot_in, snapshot_out, progress, keep_logits):
    """prefill → one snapshot per distinct watermark (a gate) → branch-i nodes."""
    # One gate per distinct watermark, plus the whole document (for snapshot_out).
    gates = {w: Future() for w in sorted(set(plan.watermarks) | {plan.layout.n_prefix})}

    def prefill(_):
        try:
            return _copy_prefill(plan, gates, snapshot_in, snapshot_out, progress)
        except BaseException as exc:
            for g in gates.values():
                if not g.done():
                    g.set_exception(exc)
            raise

    dag.add("prefill", prefill)
    for i, w in enumerate(plan.watermarks):
        dag.add(f"branch-{i}", lambda _, i=i, w=w: _copy_branch(plan, i, gates[w].result(), keep_logits),
                gates=[gates[w]])


def _copy_prefill(plan: _Plan, gates: dict[int, Future], snapshot_in, snapshot_out, progress):
    prefix, n = plan.layout.prefix, plan.layout.n_prefix
    t_start = plan.ms()
    if snapshot_in is not None:
        for gate in gates.values():
            gate.set_result((snapshot_in, plan.ms()))
        return 0.0, snapshot_in.nbytes
    full = None
    with plan.context(plan.n_ctx) as ctx:
        done = 0
        batch = Batch(plan.n_batch)
        for stop in _prefill_stops(plan):
            batch.clear().add_sequence(prefix[done:stop], done, 0, logits_last=False)
            ctx.decode(batch)
            done = stop
            if progress:
                progress(done, n)
            if done in gates:
                snap = Snapshot.capture(ctx, 0, prefix[:done])
                gates[done].set_result((snap, plan.ms()))
                full = snap
        prefill_ms = plan.ms() - t_start
    if snapshot_out is not None:
        snapshot_out(full)
    return prefill_ms, full.nbytes


def _copy_branch(plan: _Plan, i: int, gate_value, keep_logits: bool) -> BranchResult:
    snapshot, ready_ms = gate_value
    res = plan.result(i)
    res.ready_ms = ready_ms
    w = plan.watermarks[i]
    t = time.perf_counter_ns()
    mine = snapshot.fork()  # copy-on-fork: this branch owns its bytes
    with plan.context(plan.n_ctx) as ctx, plan.sampler(i) as sampler:
        mine.restore(ctx, 0)
        if w < mine.header.n_tokens:  # a full snapshot reused for a watermark branch
            ctx.seq_rm(0, w, -1)
        res.fork_ms = (time.perf_counter_ns() - t) / 1e6
        gen = generate(ctx, plan.layout.suffixes[i], max_tokens=plan.specs[i].max_tokens,
                       sampler=sampler, pos0=w, keep_first_logits=keep_logits)
    res.token_ids, res.text, res.stopped_on_eog = gen.tokens, gen.text, gen.stopped_on_eog
    res.activation_ms = res.fork_ms + gen.first_token_ms
    res.decode_ms = gen.decode_ms - (gen.first_token_ms - gen.prompt_ms)
    res.tokens_per_s = _rate(len(gen.tokens), res.decode_ms)
    res.first_logits = gen.first_logits
    return res


def _rate(n_tokens: int, ms: float) -> float:
    """Generated tokens per second after the first one."""
    return (n_tokens - 1) / (ms / 1e3) if n_tokens > 1 and ms > 0 else 0.0


# ---- shared mode ------------------------------------------------------------------------------
class _Live:
    """A branch inside the shared context: its sequence, sampler and text so far."""

    def __init__(self, plan: _Plan, i: int, result: BranchResult):
        self.i, self.seq, self.res = i, i + 1, result
        self.spec = plan.specs[i]
        self.sampler = plan.sampler(i)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.pieces: list[str] = []
        self.pending = plan.layout.suffixes[i]   # prompt tokens still to decode
        self.pos = plan.watermarks[i]
        self.row = -1
        self.first_at = 0.0

    def push(self, model: Model, token: int) -> bool:
        """Record a sampled token; True when the branch is finished."""
        if model.is_eog(token):
            self.res.stopped_on_eog = True
            return True
        self.res.token_ids.append(token)
        self.pieces.append(self.decoder.decode(model.token_bytes(token)))
        return len(self.res.token_ids) >= self.spec.max_tokens

    def finish(self, ms: float) -> None:
        self.pieces.append(self.decoder.decode(b"", final=True))
        self.res.text = "".join(self.pieces)
        self.res.decode_ms = ms - self.first_at
        self.res.tokens_per_s = _rate(len(self.res.token_ids), self.res.decode_ms)
        self.sampler.close()


def _run_shared(plan: _Plan, snapshot_in, snapshot_out, progress, keep_logits):
    model, lay = plan.model, plan.layout
    n, n_branches = lay.n_prefix, len(plan.specs)
    if n_branches + 1 > library.lib().llama_max_parallel_sequences():
        raise BudgetError(f"shared mode holds one sequence per branch plus the document: "
                          f"{n_branches + 1} > llama_max_parallel_sequences()")
    cells = n + sum(len(lay.suffixes[i]) + s.max_tokens for i, s in enumerate(plan.specs)) + DEFAULT_HEADROOM
    step_capacity = plan.n_batch + sum(len(s) for s in lay.suffixes) + n_branches
    results = [plan.result(i) for i in range(n_branches)]
    waiting = sorted(range(n_branches), key=lambda i: plan.watermarks[i])
    live: list[_Live] = []
    prefill_ms, snapshot_bytes = 0.0, 0
    with plan.context(_round_up(cells, 256), n_seq_max=n_branches + 1, n_batch=step_capacity) as ctx:
        done = 0
        if snapshot_in is not None:
            snapshot_in.restore(ctx, 0)
            done, snapshot_bytes = n, snapshot_in.nbytes
        stops = iter(s for s in _prefill_stops(plan) if s > done)
        batch = Batch(step_capacity, n_seq_max=1)
        t_prefill = plan.ms()
        ready_at = {w: plan.ms() for w in set(plan.watermarks) if w <= done}
        while waiting or live or done < n:
            batch.clear()
            while waiting and plan.watermarks[waiting[0]] <= done:  # fork: shares cells, copies nothing
                i = waiting.pop(0)
                b = _Live(plan, i, results[i])
                t = time.perf_counter_ns()
                ctx.seq_cp(0, b.seq, 0, plan.watermarks[i])
                b.res.fork_ms = (time.perf_counter_ns() - t) / 1e6
                b.res.ready_ms = ready_at[plan.watermarks[i]]
                live.append(b)
            stop = done
            if done < n:
                stop = next(stops)
                batch.add_sequence(lay.prefix[done:stop], done, 0, logits_last=False)
            for b in live:
                if len(b.pending):
                    b.row = batch.add_sequence(b.pending, b.pos, b.seq, logits_last=True)
                    b.pos += len(b.pending)
                    b.pending = b.pending[:0]
                else:
                    b.row = batch.add(b.res.token_ids[-1], b.pos, (b.seq,), logits=True)
                    b.pos += 1
            ctx.decode(batch)
            if stop != done:
                done = stop
                now = plan.ms()
                ready_at[done] = now
                if progress:
                    progress(done, n)
                if done == n:
                    prefill_ms = now - t_prefill
                    snapshot_bytes = ctx.seq_state_size(0)
                    if snapshot_out is not None:
                        snapshot_out(Snapshot.capture(ctx, 0, lay.prefix))
            finished = []
            for b in live:
                token = b.sampler.sample(ctx, b.row)
                if not b.res.token_ids and not b.res.stopped_on_eog:
                    b.first_at = plan.ms()
                    b.res.activation_ms = b.first_at - b.res.ready_ms
                    if keep_logits:
                        b.res.first_logits = ctx.logits(b.row).copy()
                if b.push(model, token):
                    finished.append(b)
            for b in finished:
                b.finish(plan.ms())
                ctx.seq_rm(b.seq)  # frees the branch's own cells; shared ones stay with seq 0
                live.remove(b)
    return results, prefill_ms, snapshot_bytes
