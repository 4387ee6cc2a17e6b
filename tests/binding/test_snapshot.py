"""KV snapshots: capture/restore round trips, files, and every way a snapshot can be bad.
A bad snapshot raises an error naming the problem and leaves the target context usable."""
from __future__ import annotations

import numpy as np
import pytest

from swarmkv_ffi import Context, errors
from swarmkv_ffi.fanout.budget import check_budget
from swarmkv_ffi.fanout import BranchSpec, run_fanout
from swarmkv_ffi.snapshot import Snapshot

TEXT = "The quick brown fox jumps over the lazy dog. " * 12
CTX = dict(n_ctx=512, type_k="q8_0", type_v="q8_0", flash_attn="on")


@pytest.fixture(scope="module")
def snap(smol):
    tokens = smol.tokenize(TEXT)
    with Context(smol, **CTX) as ctx:
        ctx.decode_tokens(tokens, logits_last=False)
        return Snapshot.capture(ctx, 0, tokens)


def assert_usable(ctx, model):
    """The context still decodes after a refused restore."""
    ctx.decode_tokens(model.tokenize("Hello there"))
    assert ctx.seq_pos_max(0) >= 1


def test_capture_sizes_come_from_the_engine(snap, smol):
    assert snap.nbytes == snap.data.nbytes > 0
    assert snap.header.n_tokens == len(smol.tokenize(TEXT))
    assert snap.data.ctypes.data % 4096 == 0  # aligned host arena (no CUDA here)


def test_restore_then_snapshot_again_gives_identical_bytes(snap, smol):
    with Context(smol, **CTX) as ctx:
        snap.restore(ctx, 0)
        again = Snapshot.capture(ctx, 0, snap.tokens)
    assert np.array_equal(again.data, snap.data)
    assert again.header.checksum == snap.header.checksum


def test_restored_context_continues_like_the_original(snap, smol):
    tokens = smol.tokenize(TEXT)
    follow = smol.tokenize(" Then the fox", add_special=False)
    with Context(smol, **CTX) as a, Context(smol, **CTX) as b:
        a.decode_tokens(tokens, logits_last=False)
        la = a.logits(a.decode_tokens(follow, len(tokens))).copy()
        snap.restore(b, 0)
        lb = b.logits(b.decode_tokens(follow, len(tokens)))
        assert np.array_equal(la, lb)


def test_save_load_roundtrip(snap, tmp_path):
    path = snap.save(tmp_path / "doc.swkv")
    back = Snapshot.load(path)
    assert np.array_equal(back.data, snap.data) and back.header == snap.header
    assert not list(tmp_path.glob(".doc.swkv.*")), "temporary file left behind"
    assert Snapshot.from_bytes(snap.to_bytes()).header == snap.header


def test_copy_is_independent(snap):
    mine = snap.copy()
    assert np.array_equal(mine.data, snap.data)
    mine.data[0] ^= 0xFF
    assert mine.data[0] != snap.data[0]


def test_truncated_file(snap, tmp_path, smol):
    path = snap.save(tmp_path / "t.swkv")
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(errors.SnapshotCorruptError, match="truncated"):
        Snapshot.load(path)
    path.write_bytes(raw[:20])
    with pytest.raises(errors.SnapshotCorruptError):
        Snapshot.load(path)


def test_not_a_snapshot(tmp_path):
    path = tmp_path / "x.swkv"
    path.write_bytes(b"GGUF and other things")
    with pytest.raises(errors.SnapshotCorruptError, match="bad magic"):
        Snapshot.load(path)
    with pytest.raises(FileNotFoundError):
        Snapshot.load(tmp_path / "missing.swkv")


def test_corrupted_byte_is_caught_before_libllama_and_context_stays_usable(snap, smol):
    bad = snap.copy()
    bad.data[len(bad.data) // 2] ^= 0x01
    with Context(smol, **CTX) as ctx:
        with pytest.raises(errors.SnapshotCorruptError, match="checksum"):
            bad.restore(ctx, 0)
        assert ctx.seq_pos_max(0) == -1
        assert_usable(ctx, smol)


def test_other_model_is_named(snap, gemma):
    with Context(gemma, **CTX) as ctx:
        with pytest.raises(errors.SnapshotMismatchError, match="SmolLM2"):
            snap.restore(ctx, 0)
        assert_usable(ctx, gemma)


@pytest.mark.parametrize("change,field", [(dict(type_k="f16", type_v="f16"), "type_k"),
                                          (dict(flash_attn="off", type_k="f16", type_v="f16"), "type_k"),
                                          (dict(n_seq_max=2, kv_unified=False), "n_stream")])
def test_other_context_settings_are_named(snap, smol, change, field):
    with Context(smol, **{**CTX, **change}) as ctx:
        with pytest.raises(errors.SnapshotMismatchError, match=field):
            snap.restore(ctx, 0)
        assert_usable(ctx, smol)


def test_too_small_context_is_named(smol):
    tokens = smol.tokenize(TEXT * 3)  # ~400 tokens; the smallest context libllama makes is 256
    with Context(smol, **CTX) as ctx:
        ctx.decode_tokens(tokens, logits_last=False)
        big = Snapshot.capture(ctx, 0, tokens)
    with Context(smol, **{**CTX, "n_ctx": 256}) as ctx:
        assert ctx.n_ctx_seq < len(tokens)
        with pytest.raises(errors.SnapshotMismatchError, match="n_ctx_seq=256"):
            big.restore(ctx, 0)
        assert_usable(ctx, smol)


def test_payload_that_libllama_rejects_leaves_context_usable(snap, smol):
    """Header and checksum fine, but the bytes are not a state libllama can read."""
    bad = snap.copy()
    bad.data[:] = 0xAB
    from swarmkv_ffi.snapshot import checksum
    bad.header = type(snap.header)(**{**snap.header.__dict__, "checksum": checksum(bad.data)})
    with Context(smol, **CTX) as ctx:
        with pytest.raises(errors.StateError):
            bad.restore(ctx, 0)
        assert ctx.seq_pos_max(0) == -1
        assert_usable(ctx, smol)


def test_snapshot_in_skips_prefill_and_answers_the_same(smol, tmp_path):
    doc = TEXT * 2
    specs = [BranchSpec("What does the fox do?", max_tokens=8)]
    saved = []
    first = run_fanout(smol, doc, specs, snapshot_out=saved.append)
    path = saved[0].save(tmp_path / "doc.swkv")
    for mode in ("shared", "copy"):
        again = run_fanout(smol, doc, specs, mode=mode, snapshot_in=Snapshot.load(path))
        assert again.prefill_skipped and again.prefill_ms == 0
        assert again.branches[0].token_ids == first.branches[0].token_ids


def test_snapshot_of_another_document_is_refused(smol):
    saved = []
    run_fanout(smol, TEXT, [BranchSpec("q?", max_tokens=1)], snapshot_out=saved.append)
    with pytest.raises(errors.SnapshotMismatchError, match="another document"):
        run_fanout(smol, TEXT + " More.", [BranchSpec("q?", max_tokens=1)], snapshot_in=saved[0])


def test_budget_error_names_every_number():
    with pytest.raises(errors.BudgetError) as info:
        check_budget(prefix_tokens=3000, max_branch_tokens=1000, n_ctx=4096, headroom=128)
    msg = str(info.value)
    for part in ("prefix_tokens=3000", "max_branch_tokens=1000", "headroom=128",
                 "required=4128", "n_ctx=4096"):
        assert part in msg
    assert check_budget(3000, 900, 4096) == 4028


def test_budget_is_checked_before_any_context_exists(smol, monkeypatch):
    import swarmkv_ffi.context as context_module

    def no_contexts(*a, **k):
        raise AssertionError("a context was created before the budget check")

    monkeypatch.setattr(context_module.Context, "__init__", no_contexts)
    with pytest.raises(errors.BudgetError, match="n_ctx=256"):
        run_fanout(smol, TEXT * 4, [BranchSpec("q?", max_tokens=64)], n_ctx=256)


def test_failing_node_fails_the_run_with_the_original_error(smol, monkeypatch):
    boom = RuntimeError("snapshot capture exploded")

    def explode(*a, **k):
        raise boom

    monkeypatch.setattr(Snapshot, "capture", explode)
    with pytest.raises(RuntimeError) as info:
        run_fanout(smol, TEXT, [BranchSpec("a?", max_tokens=2), BranchSpec("b?", max_tokens=2)],
                   mode="copy", timeout=120, cache=False)
    assert info.value is boom


def test_a_payload_size_the_file_does_not_hold_is_refused_before_allocating(snap, tmp_path, monkeypatch):
    """A crafted header may claim any payload size; with CUDA that would be page-locked
    memory of the file's choosing. The size is checked against the file first."""
    import json
    import struct

    from swarmkv_ffi import snapshot as snapshot_mod
    raw = snap.save(tmp_path / "s.swkv").read_bytes()
    magic_len = len(snapshot_mod.MAGIC)
    (n,) = struct.unpack("<I", raw[magic_len:magic_len + 4])
    header = json.loads(raw[magic_len + 4:magic_len + 4 + n])
    header["payload_nbytes"] = 1 << 40
    new = json.dumps(header).encode()
    crafted = tmp_path / "crafted.swkv"
    crafted.write_bytes(raw[:magic_len] + struct.pack("<I", len(new)) + new + b"\0" * 64)
    asked = []
    monkeypatch.setattr(snapshot_mod, "host_buffer", lambda n, pinned=None: asked.append(n) or bytearray(0))
    with pytest.raises(errors.SnapshotCorruptError, match="header says the payload is 1099511627776 bytes"):
        Snapshot.load(crafted)
    assert asked == []
    import os
    fifo = tmp_path / "fifo.swkv"
    os.mkfifo(fifo)
    with pytest.raises(errors.SnapshotCorruptError, match="not a regular file"):
        Snapshot.load(fifo)                       # refused at once, not a read that never ends
