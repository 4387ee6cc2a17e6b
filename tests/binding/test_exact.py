"""Exact mode: every shared-mode branch equals a plain run, every logit bit for bit.

The plain run is written here against Context and Batch, not through prefill() or
generate(): one fresh exact context holding the document (prefilled once per model in
n_batch chunks, then restored byte for byte into each plain run), the branch's prompt
in one decode, then one token per llama_decode. Shared mode must reproduce its tokens
and the digest of every row of logits it sampled from (exact.digest: raw float32
bytes). One N = 16 run whose branches stop at different lengths passes through (nearly)
every live-branch count from 16 down to 1, so it covers what runs at N = 1, 2, 3, 8 would;
greedy, and at N = 8 with temperature sampling and fixed seeds. SmolLM2 reads a document
of more than 3,000 tokens; Gemma 3 a 1,200-token one, past its 512-token sliding window.
"""
from __future__ import annotations

import numpy as np
import pytest

from plain import one_token_per_decode
from swarmkv_ffi import Context, ContextParams, exact
from swarmkv_ffi.batch import Batch
from swarmkv_ffi.errors import ExactModeError, SnapshotMismatchError
from swarmkv_ffi.fanout import BranchSpec, FanoutConfig, plan_fanout, run_fanout
from swarmkv_ffi.sampler import Sampler
from swarmkv_ffi.snapshot import Snapshot

pytestmark = pytest.mark.fidelity

N_BATCH = 512
N = 16
CLAUSES = {"smollm2-135m": 76, "gemma3-270m": 28}   # > 3,000 and ~1,200 tokens
MIN_PREFIX = {"smollm2-135m": 3000, "gemma3-270m": 1100}


def long_document(n_clauses: int = 76) -> str:
    """A contract of numbered clauses, every one different (76 clauses: > 3,000 tokens)."""
    goods = ["valves", "pumps", "sensors", "cables", "filters", "gaskets", "motors", "meters"]
    cities = ["Lisbon", "Gdansk", "Porto", "Tromso", "Bilbao", "Turku", "Split", "Cork"]
    out = []
    for i in range(n_clauses):
        out.append(f"Clause {i + 1}. The supplier ships {17 * i % 400 + 20} {goods[i % 8]} to "
                   f"{cities[(3 * i) % 8]} within {i % 29 + 2} days; a late delivery costs "
                   f"{(i * 37) % 900 + 100} euros per day, capped at {(i % 7 + 1) * 5} percent.")
    return "\n".join(out)


QUESTIONS = [f"Summarise clause {c} and say what a late delivery costs." for c in
             (3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 51, 59, 63, 67, 75)]


def spec(i: int, sampled: bool) -> BranchSpec:
    # Every branch its own length (6..36 tokens, shorter than most answers), so they
    # finish at different steps.
    n = 6 + 2 * i
    if sampled:
        return BranchSpec(QUESTIONS[i], max_tokens=n, temp=0.8, seed=1000 + i)
    return BranchSpec(QUESTIONS[i], max_tokens=n)


class Plain:
    """Plain exact runs of one model: the document prefilled once, restored per branch."""

    def __init__(self, model, name: str):
        self.doc = long_document(CLAUSES[name])
        self.plan = plan_fanout(model, self.doc, [spec(i, False) for i in range(N)], n_batch=N_BATCH, exact=True)
        lay = self.plan.layout
        assert lay.n_prefix > MIN_PREFIX[name], lay.n_prefix
        with self.context() as ctx:
            batch = Batch(N_BATCH)
            for start in range(0, lay.n_prefix, N_BATCH):
                batch.clear().add_sequence(lay.prefix[start:start + N_BATCH], start, 0, logits_last=False)
                ctx.decode(batch)
            self.document = Snapshot.capture(ctx, 0, lay.prefix)
        self.cache: dict[tuple, tuple[list[int], list[str]]] = {}

    def context(self) -> Context:
        return Context(self.plan.model, ContextParams(
            n_ctx=self.plan.n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH, swa_full=self.plan.model.n_swa > 0,
            kv_unified=True, flash_attn="on", type_k=self.plan.config.kv_type,
            type_v=self.plan.config.kv_type, batch_invariant=True))

    def run(self, s: BranchSpec, i: int) -> tuple[list[int], list[str]]:
        """Branch i alone: its tokens and the digest of each row it sampled from."""
        key = (i, s.temp, s.seed, s.max_tokens)
        if key not in self.cache:
            self.cache[key] = self._run(s, self.plan.layout.suffixes[i])
        return self.cache[key]

    def _run(self, s: BranchSpec, prompt) -> tuple[list[int], list[str]]:
        n = self.plan.layout.n_prefix
        with self.context() as ctx, Sampler(temp=s.temp, seed=s.seed) as sampler:
            self.document.restore(ctx, 0)
            batch = Batch(max(len(prompt), 1))
            row = batch.add_sequence(prompt, n, 0, logits_last=True)
            ctx.decode(batch)
            return one_token_per_decode(ctx, batch, row, n + len(prompt), s.max_tokens, sampler.sample)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def plain(request, smol, gemma):
    return Plain({"smollm2-135m": smol, "gemma3-270m": gemma}[request.param], request.param)


def shared(plain: Plain, sampled: bool, n: int = N):
    """Shared mode over the plain run's document snapshot (the prefill is tested apart)."""
    return run_fanout(plain.plan.model, plain.doc, [spec(i, sampled) for i in range(n)], mode="shared",
                      n_batch=N_BATCH, exact=True, trace_logits=True, cache=False,
                      snapshot_in=plain.document)


def assert_equal_to_plain(plain: Plain, res, sampled: bool, n: int) -> None:
    assert sorted(b.index for b in res.branches) == list(range(n)), "branches went missing"
    assert all(b.token_ids for b in res.branches), "a branch answered nothing"
    for b in res.branches:
        tokens, digests = plain.run(spec(b.index, sampled), b.index)
        assert b.token_ids == tokens, f"branch {b.index}: tokens differ from the plain run"
        assert b.logit_digests == digests, (
            f"branch {b.index}: logits differ from the plain run at token "
            f"{next(k for k, (x, y) in enumerate(zip(b.logit_digests, digests)) if x != y)}")


def steps_live(plain: Plain, sampled: bool, n: int = N) -> list[int]:
    """How many decode steps each branch takes (one per sampled row) in its plain run."""
    return [len(plain.run(spec(i, sampled), i)[1]) for i in range(n)]


@pytest.mark.slow
def test_shared_branches_equal_plain_runs_bit_for_bit(plain):
    # Branches that stop at different steps make the live count fall from 16 towards 1;
    # an end of generation may make two stop together, so most counts, not all, are asked.
    check_against_plain(plain, sampled=False, n=N, distinct_stops=12)


@pytest.mark.slow
@pytest.mark.parametrize("plain", ["smollm2-135m"], indirect=True)   # sampling is the model's own business
def test_sampled_branches_equal_plain_runs(plain):
    check_against_plain(plain, sampled=True, n=8, distinct_stops=6)


def check_against_plain(plain: Plain, sampled: bool, n: int, distinct_stops: int) -> None:
    stops = steps_live(plain, sampled, n)
    assert len(set(stops)) >= distinct_stops, stops
    res = shared(plain, sampled, n)
    assert res.n_prefix == plain.plan.layout.n_prefix
    assert_equal_to_plain(plain, res, sampled, n)


@pytest.mark.slow
def test_exact_prefill_equals_plain_prefill(plain):
    """Shared mode's own prefill (in a context sized for 3 branches, with their prompts
    batched after it) leaves the plain prefill's bytes. A 600-token start of the
    document keeps it short: a chunk of 512 and a partial last chunk are both there."""
    doc = long_document(14)
    model = plain.plan.model
    saved = []
    run_fanout(model, doc, [spec(i, False) for i in range(3)], n_batch=N_BATCH, exact=True,
               cache=False, snapshot_out=saved.append)
    lay = plan_fanout(model, doc, [spec(0, False)], n_batch=N_BATCH, exact=True).layout
    assert lay.n_prefix > N_BATCH
    with plain.context() as ctx:
        batch = Batch(N_BATCH)
        for start in range(0, lay.n_prefix, N_BATCH):
            batch.clear().add_sequence(lay.prefix[start:start + N_BATCH], start, 0, logits_last=False)
            ctx.decode(batch)
        alone = Snapshot.capture(ctx, 0, lay.prefix)
    assert np.array_equal(saved[0].data, alone.data)


def test_exact_snapshot_is_not_restored_into_a_fast_context(smol):
    exact_params = ContextParams(n_ctx=256, n_batch=64, flash_attn="on", batch_invariant=True)
    tokens = smol.tokenize(long_document(2))
    with Context(smol, exact_params) as ctx:
        ctx.decode_tokens(tokens, logits_last=False)
        snap = Snapshot.capture(ctx, 0, tokens)
    fast = ContextParams(**{**exact_params.as_dict(), "batch_invariant": False})
    with Context(smol, fast) as ctx, pytest.raises(SnapshotMismatchError, match="exact"):
        snap.restore(ctx, 0)


def test_exact_needs_flash_attention():
    with pytest.raises(ValueError, match="flash attention"):
        FanoutConfig.of(exact=True, flash_attn="off")


def test_exact_refuses_an_amx_build(monkeypatch, smol):
    """Through the public entry points: an exact context, an exact plan and run_fanout."""
    monkeypatch.setattr(exact.library, "manifest", lambda: {"amx": True})
    with pytest.raises(ExactModeError, match="amx"):
        Context(smol, ContextParams(n_ctx=256, flash_attn="on", batch_invariant=True))
    with pytest.raises(ExactModeError, match="amx"):
        plan_fanout(smol, "A short document.", [BranchSpec("Why?", max_tokens=2)], exact=True)
    with pytest.raises(ExactModeError, match="amx"):
        run_fanout(smol, "A short document.", [BranchSpec("Why?", max_tokens=2)], exact=True, cache=False)
