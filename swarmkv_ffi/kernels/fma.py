"""The per-layer kernel: an FMA sweep that costs about what a layer's matmul costs.

Each element of the layer's weights goes through `iters` multiply-adds, and the result
is folded into the output buffer, which carries over from layer to layer. Because every
layer reads the output the previous one wrote, any race between copy and compute shows
up as a different final output.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

DECAY = np.float32(0.5)
SCALE = np.float32(0.999)


@cuda.jit
def fma_sweep(weights, out, iters):
    """out[i] = out[i] * DECAY + f(weights[i]), f = `iters` rounds of acc = acc*SCALE + w."""
    i = cuda.grid(1)
    if i < weights.size:
        w = weights[i]
        acc = np.float32(0.0)
        for _ in range(iters):
            acc = acc * SCALE + w
        out[i] = out[i] * DECAY + acc


def reference(host_layers: np.ndarray, iters: int) -> np.ndarray:
    """The same computation in NumPy float32, layer by layer (vectorised over elements)."""
    out = np.zeros(host_layers.shape[1], dtype=np.float32)
    for w in host_layers:
        acc = np.zeros_like(out)
        for _ in range(iters):
            acc = acc * SCALE + w
        out = out * DECAY + acc
    return out


def launch_shape(n: int, threads: int = 256) -> tuple[int, int]:
    return math.ceil(n / threads), threads
