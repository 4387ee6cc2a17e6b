"""The layer streamer: weights in a pinned host arena, two device slots used ping-pong, a
compute stream and a transfer stream, CUDA events per layer.

    serial:      copy L0 → sync → compute L0 → sync → copy L1 → …
    overlapped:  transfer stream  | copy L0 | copy L1 | copy L2 | …
                 compute stream            | comp L0 | comp L1 | …
                 compute i waits for copy i's event; copy i waits until the compute that
                 last used its slot (layer i-2) has finished.

Both schedules run on the same allocations. Wall time comes from perf_counter around a
fully synchronised run; per-layer times from CUDA events when the driver has them (the
simulator's events have no timing, and we report none rather than a made-up number).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from numba import config, cuda

from .fma import fma_sweep, launch_shape

SIMULATOR = bool(config.ENABLE_CUDASIM)


def _event():
    """An event that records timing on a real GPU; the simulator's takes no arguments."""
    return cuda.event() if SIMULATOR else cuda.event(timing=True)


def _elapsed(start, end) -> float | None:
    """ms between two recorded events, or None where the driver cannot time them."""
    if SIMULATOR:
        return None
    try:
        ms = start.elapsed_time(end)
    except Exception:  # an event that was never recorded, or a driver without timing
        return None
    return ms if ms >= 0 else None


@dataclass
class LayerTimes:
    copy_start: float | None = None
    copy_end: float | None = None
    compute_start: float | None = None
    compute_end: float | None = None


@dataclass
class RunResult:
    schedule: str
    wall_ms: float
    layers: list[LayerTimes] = field(default_factory=list)
    output: np.ndarray | None = None


class LayerStreamer:
    def __init__(self, n_layers: int = 8, bytes_per_layer: int = 64 << 20,
                 compute_iters: int = 64, seed: int = 0):
        if n_layers < 1 or compute_iters < 1 or bytes_per_layer < 4:
            raise ValueError(f"need n_layers >= 1, compute_iters >= 1, bytes_per_layer >= 4; got "
                             f"{n_layers}, {compute_iters}, {bytes_per_layer}")
        self.n_layers, self.iters = n_layers, compute_iters
        self.n = bytes_per_layer // 4
        self.host = cuda.pinned_array((n_layers, self.n), dtype=np.float32)
        self.host[:] = np.random.default_rng(seed).uniform(-1, 1, (n_layers, self.n)).astype(np.float32)
        self.slots = [cuda.device_array(self.n, dtype=np.float32) for _ in range(2)]
        self.out = cuda.device_array(self.n, dtype=np.float32)
        self.compute = cuda.stream()
        self.transfer = cuda.stream()
        self.grid = launch_shape(self.n)

    # ---- pieces -------------------------------------------------------------------------------
    def _copy(self, i: int, stream):
        self.slots[i % 2].copy_to_device(self.host[i], stream=stream)

    def _kernel(self, i: int, stream):
        blocks, threads = self.grid
        fma_sweep[blocks, threads, stream](self.slots[i % 2], self.out, self.iters)

    def _reset_output(self):
        self.out.copy_to_device(np.zeros(self.n, dtype=np.float32))
        cuda.synchronize()

    def _timed(self, name: str, body) -> RunResult:
        self._reset_output()
        t0 = time.perf_counter_ns()
        layers = body()
        cuda.synchronize()
        wall = (time.perf_counter_ns() - t0) / 1e6
        return RunResult(name, wall, layers, self.out.copy_to_host())

    # ---- schedules ------------------------------------------------------------------------------
    def run_serial(self) -> RunResult:
        def body():
            origin = _event()
            origin.record(self.transfer)
            layers = []
            for i in range(self.n_layers):
                ev = [_event() for _ in range(4)]
                ev[0].record(self.transfer)
                self._copy(i, self.transfer)
                ev[1].record(self.transfer)
                self.transfer.synchronize()
                ev[2].record(self.compute)
                self._kernel(i, self.compute)
                ev[3].record(self.compute)
                self.compute.synchronize()
                layers.append(LayerTimes(*(_elapsed(origin, e) for e in ev)))
            return layers
        return self._timed("serial", body)

    def run_overlapped(self) -> RunResult:
        def body():
            origin = _event()
            origin.record(self.transfer)
            copied = [_event() for _ in range(self.n_layers)]
            computed = [_event() for _ in range(self.n_layers)]
            starts = [(_event(), _event()) for _ in range(self.n_layers)]
            for i in range(self.n_layers):
                if i >= 2:
                    computed[i - 2].wait(self.transfer)  # slot i%2 is free again
                starts[i][0].record(self.transfer)
                self._copy(i, self.transfer)
                copied[i].record(self.transfer)
                copied[i].wait(self.compute)             # compute only what has arrived
                starts[i][1].record(self.compute)
                self._kernel(i, self.compute)
                computed[i].record(self.compute)
            self.compute.synchronize()
            self.transfer.synchronize()
            return [LayerTimes(_elapsed(origin, starts[i][0]), _elapsed(origin, copied[i]),
                               _elapsed(origin, starts[i][1]), _elapsed(origin, computed[i]))
                    for i in range(self.n_layers)]
        return self._timed("overlapped", body)

    def run_transfer_only(self) -> RunResult:
        """T: every copy, back to back, no compute."""
        def body():
            for i in range(self.n_layers):
                self._copy(i, self.transfer)
            return []
        return self._timed("transfer_only", body)

    def run_compute_only(self) -> RunResult:
        """C: every kernel, on slots already loaded (both slots hold layers 0 and 1)."""
        self._copy(0, self.transfer)
        if self.n_layers > 1:
            self._copy(1, self.transfer)
        self.transfer.synchronize()

        def body():
            for i in range(self.n_layers):
                self._kernel(i, self.compute)
            return []
        return self._timed("compute_only", body)


def bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> dict:
    """Host-to-device GB/s from pinned and from pageable memory (best of `repeats`)."""
    n = nbytes // 4
    dev = cuda.device_array(n, dtype=np.float32)
    pinned = cuda.pinned_array(n, dtype=np.float32)
    pageable = np.empty(n, dtype=np.float32)
    pinned[:] = 1.0
    pageable[:] = 1.0
    out = {"bytes": n * 4}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        best = float("inf")
        for _ in range(repeats):
            cuda.synchronize()
            t0 = time.perf_counter_ns()
            dev.copy_to_device(host)
            cuda.synchronize()
            best = min(best, (time.perf_counter_ns() - t0) / 1e9)
        out[f"{name}_gbps"] = n * 4 / best / 1e9
    out["pinned_over_pageable"] = out["pinned_gbps"] / out["pageable_gbps"]
    return out
