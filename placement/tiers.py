"""The three tiers and their byte budgets.

`device` is where compute reads from (VRAM on a GPU; on a CPU-only machine a budgeted
working set in RAM), `host` is RAM (pinned on CUDA), `disk` is the checkpoint files and
the offload directory. Budgets are enforced by `DeviceMemory`'s own accounting, not by
hoping the allocator agrees.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (falls back to total physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect_budgets(device: str, device_memory: int | None, host_memory: int | None) -> Budgets:
    """Budgets from flags, else from the machine: free VRAM on CUDA; on CPU the device
    working set and host share available RAM (device first, since compute reads from it)."""
    ram = available_ram()
    if device == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info()
        dev = device_memory if device_memory is not None else int(free * 0.9)
        host = host_memory if host_memory is not None else int(ram * 0.8)
    else:
        usable = int(ram * 0.8)
        dev = device_memory if device_memory is not None else usable // 2
        host = host_memory if host_memory is not None else max(usable - dev, 0)
    return Budgets(dev, host)


class OverBudget(RuntimeError):
    """A reservation the budget cannot take: a bug in planning or accounting, never a user
    mistake that a plan accepted; the CLI states it in one line and a rerun resumes."""


class Memory:
    """Byte-exact accounting of one tier (the device, or host RAM). Every allocation is
    reserved here first, from the scheduling thread (host staging also from the disk
    channel's submitter); `peak` is the most ever reserved at once."""

    def __init__(self, budget: float, tier: str = "device"):
        self.budget, self.tier = budget, tier
        self.used = 0
        self.peak = 0
        self.allocator_baseline = 0  # CUDA: allocated bytes before the engine's first allocation
        self.runtime_bytes = 0       # CUDA: the cuBLAS workspace, made before that baseline
        self._lock = threading.Lock()

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def reserve(self, nbytes: int, what: str = "") -> None:
        with self._lock:
            if self.used + nbytes > self.budget:
                raise OverBudget(f"{self.tier} budget exceeded by {self.used + nbytes - self.budget:.0f} bytes "
                                 f"reserving {nbytes} for {what}")
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, f"{self.tier} memory freed twice"
