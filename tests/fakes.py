"""Stand-ins the tests share: a KV snapshot with made-up tokens and bytes, for the stores
that keep snapshots (kvcache/files.py) without a model."""
from __future__ import annotations

import numpy as np

from swarmkv_ffi.snapshot import Snapshot, SnapshotHeader, checksum, tokens_hash


def fake_snapshot(n: int, nbytes: int, seed: int) -> Snapshot:
    tokens = list(range(seed, seed + n))
    data = np.full(nbytes, seed % 251, dtype=np.uint8)
    header = SnapshotHeader(model_fingerprint="f" * 32, model_name="fake.gguf", llama_cpp_commit="x",
                            context={}, n_tokens=n, tokens_hash=tokens_hash(tokens), tokens=tokens,
                            payload_nbytes=nbytes, checksum=checksum(data))
    return Snapshot(header, data)
