"""Host memory for KV snapshots: NumPy uint8 arrays, page-locked when CUDA is present.

Pinned (page-locked) memory lets a CUDA backend copy KV state to and from the device at
full bandwidth. Without a GPU we use plain memory aligned to a page, which is what the
CPU backend's memcpy likes best. Either way callers just see a 1-D uint8 array.
"""
from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger(__name__)

ALIGN = 4096
_cuda_state: bool | None = None


def cuda_available() -> bool:
    """True when numba.cuda sees a device. Decided once; SWARMKV_PINNED=0 turns it off.

    numba is imported only when libllama reports a GPU device, so CPU-only runs never
    pay for importing it."""
    global _cuda_state
    if _cuda_state is None:
        _cuda_state = False
        if os.environ.get("SWARMKV_PINNED", "1") != "0":
            from . import library
            try:
                if any(d["type"] == "gpu" for d in library.devices()):
                    from numba import cuda
                    _cuda_state = bool(cuda.is_available())
            except Exception as exc:  # no driver, no numba: plain memory is still correct
                log.debug("pinned memory unavailable: %s", exc)
    return _cuda_state


def host_buffer(nbytes: int, pinned: bool | None = None) -> np.ndarray:
    """A 1-D uint8 array of `nbytes`; pinned=None means 'pinned if CUDA is present'."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if pinned is None:
        pinned = cuda_available()
    if pinned:
        from numba import cuda
        return cuda.pinned_array(nbytes, dtype=np.uint8)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset:offset + nbytes]

