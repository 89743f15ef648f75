"""Asynchronous transfer channels: `weights`, `experts`, `kv_load`, `kv_store` (+ `disk`).

Each channel is one FIFO worker thread: work submitted to it runs in order, overlapping the
scheduling thread's compute, and returns a `Ticket`. This is the ONLY place where CPU and
CUDA differ:

  * CPU: `to_device` is a memory copy into a fresh tensor (the device tier is a budgeted
    working set in RAM); a ticket is ready when the worker's future is.
  * CUDA: the worker issues non-blocking copies from pinned memory on the channel's own
    `torch.cuda.Stream` and records an event; `Ticket.wait` makes the compute stream wait
    on that event, so the copy overlaps kernels exactly as in the paper's four streams.

`link_gbps` (from `--emulate-link`) stretches every host->device transfer to take
bytes / bandwidth, so a CPU run reproduces a PCIe card's compute/transfer ratio.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

HOST_TO_DEVICE, DISK_TO_HOST, DEVICE_TO_HOST = "host_to_device", "disk_to_host", "device_to_host"


class Ticket:
    def __init__(self, future: Future, event=None):
        self.future, self.event = future, event

    def done(self) -> bool:
        return self.future.done()

    def wait(self):
        result = self.future.result()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return result


class Channel:
    def __init__(self, name: str, device: torch.device, trace, link_gbps: float | None = None):
        self.name, self.device, self.trace, self.link_gbps = name, device, trace, link_gbps
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"klotski-{name}")

    def submit(self, fn, *, name: str, nbytes: int = 0, link: str | None = HOST_TO_DEVICE) -> Ticket:
        """Run `fn()` on this channel after everything submitted before it."""
        event = torch.cuda.Event() if self.cuda else None

        def work():
            start = time.perf_counter()
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    result = fn()
                    event.record(self.stream)
            else:
                result = fn()
            if link == HOST_TO_DEVICE and self.link_gbps:
                # Emulated link: the transfer may not finish before bytes / bandwidth.
                remaining = nbytes / (self.link_gbps * 1e9) - (time.perf_counter() - start)
                if remaining > 0:
                    time.sleep(remaining)
            self.trace.add(self.name, name, start, time.perf_counter(), nbytes, link)
            return result

        return Ticket(self._pool.submit(work), event)

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a host tensor into device memory (called inside submitted work)."""
        if self.cuda:
            return t.to(self.device, non_blocking=True).to(dtype or t.dtype)
        out = t.to(dtype) if dtype is not None and dtype != t.dtype else t.clone()
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True) if self.cuda else t.clone()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_channels(device: torch.device, trace, link_gbps: float | None) -> dict[str, Channel]:
    names = ("weights", "experts", "kv_load", "kv_store", "disk")
    return {n: Channel(n, device, trace, None if n == "disk" else link_gbps) for n in names}


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host copies feeding a CUDA device are pinned, so copies can run asynchronously."""
    return t.pin_memory() if device.type == "cuda" else t
