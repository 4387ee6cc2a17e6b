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

Every operation issued is logged (each run's `RunResult.schedule_log`; schedule.py proves
the log race-free), and after each layer's kernel a few hundred fixed elements of the output
are gathered on the device, so every run of every trial can be checked against NumPy
at any size (`check()`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from numba import config, cuda

from .fma import fma_sweep, gather, launch_shape, reference_samples
from .schedule import Schedule

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
    samples: np.ndarray | None = None   # (n_layers, n_samples): output after each layer
    schedule_log: Schedule | None = None


N_SAMPLES = 256


class LayerStreamer:
    def __init__(self, n_layers: int = 8, bytes_per_layer: int = 64 << 20,
                 compute_iters: int = 64, seed: int = 0, n_samples: int = N_SAMPLES):
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
        k = min(n_samples, self.n)
        self.sample_index = np.unique(np.linspace(0, self.n - 1, k).astype(np.int64))
        self._d_index = cuda.to_device(self.sample_index)
        self._d_samples = cuda.device_array((n_layers, len(self.sample_index)), dtype=np.float32)
        self._expected: dict[int, np.ndarray] = {}
        self._names = {id(self.compute): "compute", id(self.transfer): "transfer"}
        self._event_ids: dict[int, int] = {}
        self.log = Schedule()

    def expected_samples(self) -> np.ndarray:
        """What the sampled elements must hold after each layer (NumPy, once per iters)."""
        if self.iters not in self._expected:
            cols = np.asarray(self.host)[:, self.sample_index]
            self._expected[self.iters] = reference_samples(cols, self.iters)
        return self._expected[self.iters]

    def check(self, result: "RunResult", rtol: float = 1e-5, atol: float = 1e-5) -> list[int]:
        """The layers whose sampled output differs from NumPy ([] when all match)."""
        want = self.expected_samples()
        return [i for i in range(self.n_layers)
                if not np.allclose(result.samples[i], want[i], rtol=rtol, atol=atol)]

    # ---- pieces (each one logged) ---------------------------------------------------------------
    def _stream(self, stream) -> str:
        return self._names[id(stream)]

    def _copy(self, i: int, stream):
        self.log.add("copy", self._stream(stream), layer=i, slot=i % 2)
        self.slots[i % 2].copy_to_device(self.host[i], stream=stream)

    def _kernel(self, i: int, stream, sample: bool = True):
        blocks, threads = self.grid
        self.log.add("kernel", self._stream(stream), layer=i, slot=i % 2)
        fma_sweep[blocks, threads, stream](self.slots[i % 2], self.out, self.iters)
        if sample:
            b, t = launch_shape(len(self.sample_index))
            gather[b, t, stream](self.out, self._d_index, self._d_samples[i])

    def _event(self):
        ev = _event()
        self._event_ids[id(ev)] = len(self._event_ids)
        return ev

    def _record(self, ev, stream):
        self.log.add("record", self._stream(stream), event=self._event_ids[id(ev)])
        ev.record(stream)

    def _wait(self, ev, stream):
        """`stream` runs nothing issued after this until `ev`'s recorded point has run."""
        self.log.add("wait", self._stream(stream), event=self._event_ids[id(ev)])
        ev.wait(stream)

    def _sync(self, stream):
        self.log.add("sync", self._stream(stream))
        stream.synchronize()

    def _reset_output(self):
        self.out.copy_to_device(np.zeros(self.n, dtype=np.float32))
        cuda.synchronize()

    def _timed(self, name: str, body) -> RunResult:
        self._reset_output()
        self.log, self._event_ids = Schedule(), {}
        t0 = time.perf_counter_ns()
        layers = body()
        cuda.synchronize()
        wall = (time.perf_counter_ns() - t0) / 1e6
        self.log.add("sync", "host")
        return RunResult(name, wall, layers, self.out.copy_to_host(),
                         self._d_samples.copy_to_host(), self.log)

    # ---- schedules ------------------------------------------------------------------------------
    def run_serial(self) -> RunResult:
        def body():
            origin = self._event()
            self._record(origin, self.transfer)
            layers = []
            for i in range(self.n_layers):
                ev = [self._event() for _ in range(4)]
                self._record(ev[0], self.transfer)
                self._copy(i, self.transfer)
                self._record(ev[1], self.transfer)
                self._sync(self.transfer)
                self._record(ev[2], self.compute)
                self._kernel(i, self.compute)
                self._record(ev[3], self.compute)
                self._sync(self.compute)
                layers.append(LayerTimes(*(_elapsed(origin, e) for e in ev)))
            return layers
        return self._timed("serial", body)

    def run_overlapped(self) -> RunResult:
        def body():
            origin = self._event()
            self._record(origin, self.transfer)
            copied = [self._event() for _ in range(self.n_layers)]
            computed = [self._event() for _ in range(self.n_layers)]
            starts = [(self._event(), self._event()) for _ in range(self.n_layers)]
            for i in range(self.n_layers):
                if i >= 2:
                    self._wait(computed[i - 2], self.transfer)  # slot i%2 is free again
                self._record(starts[i][0], self.transfer)
                self._copy(i, self.transfer)
                self._record(copied[i], self.transfer)
                self._wait(copied[i], self.compute)             # compute only what has arrived
                self._record(starts[i][1], self.compute)
                self._kernel(i, self.compute)
                self._record(computed[i], self.compute)
            self._sync(self.compute)
            self._sync(self.transfer)
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
                self._kernel(i, self.compute, sample=False)
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
