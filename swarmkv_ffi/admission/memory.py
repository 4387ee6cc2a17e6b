"""Device memory, read live: NVML when a GPU is visible, else the host's memory.

Read again on a timer and at every admission, so memory other processes take shrinks the
budget: budget = admission_percent of the total, minus what others use, or a fixed
--budget-bytes when given.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from ..procmem import rss_bytes

log = logging.getLogger("swarmkv_ffi.lmxd")


@dataclass
class MemoryReading:
    source: str       # "nvml", "host" or "budget"
    device: str
    total: int
    used: int
    free: int
    own: int          # bytes this process uses on that device
    at: float

    @property
    def others(self) -> int:
        return max(0, self.used - self.own)


def _host_reading() -> MemoryReading:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    own = rss_bytes()
    total, free = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    return MemoryReading("host", "host RAM", total, total - free, free, own, time.time())


class DeviceMemory:
    """Live memory figures for one device; refresh() re-reads them."""

    def __init__(self, device: int = 0, budget_bytes: int | None = None,
                 admission_percent: float = 90.0, refresh_s: float = 2.0, own_hint=None):
        if not 0 < admission_percent <= 100:
            raise ValueError(f"admission percent must be in (0, 100], got {admission_percent}")
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"--budget-bytes must be positive, got {budget_bytes}")
        self.device, self.budget_bytes, self.percent = device, budget_bytes, admission_percent
        # What this daemon has booked, for when NVML cannot name our process (below).
        self.own_hint = own_hint or (lambda: 0)
        self._nvml = self._open_nvml(device)
        self._lock = threading.Lock()
        self.reading = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(refresh_s,), daemon=True, name="nvml")
        self._thread.start()

    @staticmethod
    def _open_nvml(device: int):
        """(pynvml, handle) for the device, or None when there is no GPU to read: then the
        host's memory is the budget, and the log says why."""
        try:
            import pynvml
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:
            log.warning("NVML unavailable (%s: %s): budgeting host memory",
                        type(exc).__name__, exc)
            return None
        if count == 0:
            log.warning("NVML sees no device: budgeting host memory")
            return None
        if not 0 <= device < count:
            raise ValueError(f"--device {device}: NVML sees {count} device(s)")
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device)

    def _read(self) -> MemoryReading:
        if self._nvml is None:
            return _host_reading()
        pynvml, handle = self._nvml
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        own, found, foreign = 0, False, False
        try:
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid():
                    found = True
                    own += proc.usedGpuMemory or 0
                elif not os.path.exists(f"/proc/{proc.pid}"):
                    foreign = True
        except Exception as exc:
            # Without the process list our own use counts as others': a smaller budget.
            log.warning("NVML process list unreadable (%s): counting all used memory as "
                        "other processes'", exc)
        if not found and foreign:
            # In a PID namespace (a container) NVML reports host PIDs, so our own process
            # is not recognisable and its memory would count as "others" on top of what
            # the ledger already holds for it. Count what we booked as ours instead.
            own = min(mem.used, self.own_hint())
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        return MemoryReading("nvml", name, mem.total, mem.used, mem.free, own, time.time())

    def refresh(self) -> MemoryReading:
        reading = self._read()
        with self._lock:
            self.reading = reading
        return reading

    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.refresh()
            except Exception as exc:
                # Admissions re-read live (budget()), so a failure here only ages the
                # figures STATUS shows; say so rather than keep them silently.
                log.warning("memory refresh failed, last reading from %.0f s ago kept: %s",
                            time.time() - self.reading.at, exc)

    def budget(self) -> int:
        """Bytes the ledger may hand out now (read live)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        r = self.refresh()
        return max(0, int(r.total * self.percent / 100) - r.others)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
