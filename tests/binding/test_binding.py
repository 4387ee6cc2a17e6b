"""The owning objects against real models: tokenizer, chat template, decode, logits,
memory ops, state, sampler, lifetimes and decode error codes."""
from __future__ import annotations

import numpy as np
import pytest

from plain import greedy, one_token_per_decode
from swarmkv_ffi import Batch, Context, Model, Sampler, errors
from swarmkv_ffi.generate import generate

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


def greedy_by_hand(ctx, prompt, n, one_by_one: bool):
    """Greedy continuation, feeding the prompt in one batch or one token per decode."""
    if one_by_one:
        b = Batch(1)
        for i, t in enumerate(prompt):
            b.clear()
            row = b.add(int(t), i, (0,), logits=True)
            ctx.decode(b)
    else:
        row = ctx.decode_tokens(prompt)
    logits0 = ctx.logits(row).copy()
    out, _ = one_token_per_decode(ctx, Batch(1), row, len(prompt), n, greedy)
    return out, logits0


def test_tokenize_roundtrip(any_model):
    toks = any_model.tokenize("Hello world, hello fox.", add_special=False)
    assert toks.dtype == np.int32 and len(toks) > 3
    assert any_model.detokenize(toks) == "Hello world, hello fox."


def test_add_special_adds_bos_only_when_model_wants(any_model):
    plain = any_model.tokenize("fox", add_special=False)
    special = any_model.tokenize("fox", add_special=True)
    if any_model.add_bos:
        assert special[0] == any_model.bos and list(special[1:]) == list(plain)
    else:
        assert list(special) == list(plain)


def test_tokenize_resizes_for_long_text(smol):
    text = "fox " * 5000
    assert len(smol.tokenize(text, add_special=False)) >= 5000


def test_parse_special_controls_control_tokens(smol):
    parsed = smol.tokenize("<|im_start|>", add_special=False, parse_special=True)
    literal = smol.tokenize("<|im_start|>", add_special=False, parse_special=False)
    assert len(parsed) == 1 and len(literal) > 1


def test_chat_template_formats_messages(any_model):
    text = any_model.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "Hi there" in text and len(text) > len("Hi there")


def test_model_facts(smol, gemma):
    assert (smol.n_layer, smol.n_embd, smol.n_swa) == (30, 576, 0)
    assert gemma.n_swa > 0 and gemma.n_layer == 18
    assert smol.size_bytes > 50e6 and smol.n_ctx_train >= 2048
    assert smol.fingerprint != gemma.fingerprint
    with Model(smol.path) as again:  # the same file loaded again: the same fingerprint
        assert again.fingerprint == smol.fingerprint


def test_batch_matches_token_by_token(any_model):
    """Two independent paths through decode must agree on the greedy continuation."""
    prompt = any_model.tokenize(PROMPT)
    with Context(any_model, n_ctx=256) as a, Context(any_model, n_ctx=256) as b:
        batched, la = greedy_by_hand(a, prompt, 16, one_by_one=False)
        single, lb = greedy_by_hand(b, prompt, 16, one_by_one=True)
    assert batched == single
    assert np.argmax(la) == np.argmax(lb)
    # Batched and single-token matmuls take different kernels (quantised activations),
    # so logits differ slightly; a broken path differs by far more than this.
    assert np.max(np.abs(la - lb)) < 1.0


def test_generate_is_deterministic_and_matches_by_hand(any_model):
    prompt = any_model.tokenize(PROMPT)
    runs = []
    for _ in range(2):
        with Context(any_model, n_ctx=256) as ctx:
            runs.append(generate(ctx, prompt, max_tokens=16).tokens)
    with Context(any_model, n_ctx=256) as ctx:
        by_hand, _ = greedy_by_hand(ctx, prompt, 16, one_by_one=False)
    assert runs[0] == runs[1]
    n = len(runs[0])  # generate stops early at end-of-generation
    assert runs[0] == by_hand[:n]


def test_seeded_sampling_is_reproducible(smol):
    prompt = smol.tokenize(PROMPT)
    outs = []
    for _ in range(2):
        with Context(smol, n_ctx=256) as ctx, Sampler(temp=0.9, top_p=0.95, seed=42) as s:
            outs.append(generate(ctx, prompt, max_tokens=12, sampler=s).tokens)
    assert outs[0] == outs[1]


def test_sample_candidates_draws_what_sample_draws(smol):
    """The same chain and seed pick the same token either way; the candidates it reports
    are the chain's (top_k 5: five at most, their probabilities summing to 1)."""
    with Context(smol, n_ctx=64) as ctx:
        row = ctx.decode_tokens(smol.tokenize(PROMPT))
        picks = []
        for reported in (False, True):
            with Sampler(temp=0.9, top_k=5, seed=3) as s:
                picks.append([s.sample_candidates(ctx, row, 10) if reported else (s.sample(ctx, row), None)
                              for _ in range(6)])
    assert [t for t, _ in picks[0]] == [t for t, _ in picks[1]]
    for token, (logp, best) in picks[1]:
        assert len(best) <= 5 and sum(np.exp(lp) for _, lp in best) == pytest.approx(1.0, abs=1e-5)
        assert (token, logp) in best


def test_logits_view_shape(smol):
    with Context(smol, n_ctx=64) as ctx:
        row = ctx.decode_tokens(smol.tokenize("Hello"))
        view = ctx.logits(row)
        assert view.shape == (smol.n_vocab,) and view.dtype == np.float32
        with pytest.raises(errors.DecodeError):
            ctx.logits(0) if row != 0 else ctx.logits(5)


def test_memory_ops(smol):
    with Context(smol, n_ctx=256, n_seq_max=3, kv_unified=True) as ctx:
        prompt = smol.tokenize(PROMPT)
        ctx.decode_tokens(prompt, seq_id=0)
        assert ctx.seq_pos_max(0) == len(prompt) - 1 and ctx.seq_pos_min(0) == 0
        assert ctx.seq_pos_max(1) == -1
        ctx.seq_cp(0, 1)
        assert ctx.seq_pos_max(1) == len(prompt) - 1
        ctx.seq_rm(1)
        assert ctx.seq_pos_max(1) == -1 and ctx.seq_pos_max(0) == len(prompt) - 1
        ctx.clear()
        assert ctx.seq_pos_max(0) == -1


def test_seq_state_roundtrip(smol):
    prompt = smol.tokenize(PROMPT)
    with Context(smol, n_ctx=256) as a, Context(smol, n_ctx=256) as b:
        a.decode_tokens(prompt)
        state = a.seq_state_get(0)
        assert state.nbytes == a.seq_state_size(0) > 0
        assert b.seq_state_set(state, 0) == state.nbytes
        assert b.seq_pos_max(0) == len(prompt) - 1
        assert np.array_equal(b.seq_state_get(0), state)
        with pytest.raises(errors.StateError):
            b.seq_state_set(state[: len(state) // 2], 0)


def test_whole_state_roundtrip(smol):
    with Context(smol, n_ctx=128) as a, Context(smol, n_ctx=128) as b:
        a.decode_tokens(smol.tokenize(PROMPT))
        b.state_set(a.state_get())
        assert b.seq_pos_max(0) == a.seq_pos_max(0)


def test_decode_errors_are_named(smol):
    with Context(smol, n_ctx=64, n_batch=64, n_seq_max=1) as ctx:
        n_ctx = ctx.n_ctx  # libllama pads n_ctx up (to 256 here)
        bad = Batch(1, n_seq_max=1)
        bad.add(1, 0, (5,), logits=True)  # seq id beyond n_seq_max
        with pytest.raises(errors.InvalidBatchError) as info:
            ctx.decode(bad)
        assert "seq_ids=[5]" in str(info.value) and info.value.code == -1
        full = smol.tokenize("fox " * n_ctx, add_special=False)[: n_ctx - 4]
        ctx.decode_tokens(full)  # all but 4 cells used
        more = Batch(16)
        more.add_sequence(full[:16], n_ctx - 4)
        with pytest.raises(errors.NoKVSlotError) as info:
            ctx.decode(more)
        assert f"n_ctx={n_ctx}" in str(info.value) and info.value.code == 1
        ctx.seq_rm(0, n_ctx - 20, -1)  # the context stays usable once there is room
        ctx.decode(more.clear().add_sequence(full[:16], n_ctx - 20) and more)
        with pytest.raises(errors.InvalidBatchError):
            ctx.decode(Batch(1))  # empty


def test_closed_objects_raise_and_double_close_is_safe(smol):
    ctx = Context(smol, n_ctx=64)
    ctx.close()
    ctx.close()
    with pytest.raises(errors.ClosedError):
        ctx.n_ctx
    s = Sampler()
    s.close()
    s.close()
    with pytest.raises(errors.ClosedError):
        s.reset()


def test_model_close_closes_its_contexts():
    from conftest import load
    m = load("smollm2-135m")
    ctx = Context(m, n_ctx=64)
    m.close()
    assert ctx.closed
    with pytest.raises(errors.ClosedError):
        m.tokenize("x")
    m.close()


def test_context_params_validation(smol):
    with pytest.raises(ValueError, match="flash_attn"):
        Context(smol, n_ctx=64, flash_attn="maybe")
    with pytest.raises(ValueError, match="type_k"):
        Context(smol, n_ctx=64, type_k="q3")


def test_batch_capacity_checks():
    b = Batch(2)
    b.add_sequence([1, 2], 0)
    with pytest.raises(ValueError, match="batch full"):
        b.add(3, 2)
    with pytest.raises(ValueError, match="n_seq_max"):
        Batch(2, n_seq_max=1).add(1, 0, (0, 1))


def test_libllama_error_lines_are_kept_per_thread():
    """An error logged while one thread calls libllama is that thread's: another thread's
    exception never shows it, and reading it does not clear the other's."""
    import threading

    from swarmkv_ffi import library
    from swarmkv_ffi.library import _on_llama_log, ffi

    library.recent_errors()
    logged, seen = threading.Event(), {}

    def failing_call():
        _on_llama_log(4, ffi.new("char[]", b"llama_thing: failed to do it"), ffi.NULL)
        _on_llama_log(5, ffi.new("char[]", b" (in two pieces)\n"), ffi.NULL)
        logged.set()
        seen["worker"] = library.take_error_text()

    t = threading.Thread(target=failing_call)
    t.start()
    logged.wait(10)
    seen["main"] = library.take_error_text("none here")
    t.join(10)
    assert seen == {"worker": "llama_thing: failed to do it (in two pieces)", "main": "none here"}
