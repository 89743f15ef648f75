"""Asynchronous transfer channels: `weights`, `experts`, `kv_load`, `kv_store` (+ `disk`).

Each channel is one FIFO worker thread: work submitted to it runs in order, overlapping the
scheduling thread's compute, and returns a `Ticket`. This is the ONLY place where CPU and
CUDA differ:

  * CPU: `to_device` is a memory copy into a fresh tensor (the device tier is a budgeted
    working set in RAM), or no copy for a fresh disk read only that transfer holds; a
    ticket is ready when the worker's future is.
  * CUDA: the worker issues non-blocking copies from pinned memory on the channel's own
    `torch.cuda.Stream` and records an event; `Ticket.wait` makes the compute stream wait
    on that event, so the copy overlaps kernels exactly as in the paper's four streams.

`link_gbps` (from `--emulate-link`) makes every host->device transfer take bytes /
bandwidth on ONE link shared by all channels (as streams share a PCIe link), so a CPU run
reproduces a PCIe card's compute/transfer ratio.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

HOST_TO_DEVICE = "host_to_device"  # the link --emulate-link throttles


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


class EmulatedLink:
    """A host->device link of fixed bandwidth, served first come first served: a transfer
    starts when the link is free and occupies it for bytes / bandwidth."""

    def __init__(self, gbps: float):
        self.bytes_per_s = gbps * 1e9
        self.free_at = 0.0
        self._lock = threading.Lock()

    def occupy(self, nbytes: int, now: float) -> float:
        """Book the link for `nbytes`; return when the transfer is done."""
        with self._lock:
            self.free_at = max(now, self.free_at) + nbytes / self.bytes_per_s
            return self.free_at


class Channel:
    def __init__(self, name: str, device: torch.device, trace, link: EmulatedLink | None = None):
        self.name, self.device, self.trace, self.link = name, device, trace, link
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"klotski-{name}")

    def submit(self, fn, *, name: str, nbytes: int = 0, link: str | None = HOST_TO_DEVICE) -> Ticket:
        """Run `fn()` on this channel after everything submitted before it."""
        event = torch.cuda.Event() if self.cuda else None

        def work():
            start = time.perf_counter()
            done_at = self.link.occupy(nbytes, start) if self.link and link == HOST_TO_DEVICE else None
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    result = fn()
                    event.record(self.stream)
            else:
                result = fn()
            if done_at is not None:
                time.sleep(max(0.0, done_at - time.perf_counter()))
            self.trace.add(self.name, name, start, time.perf_counter(), nbytes, link)
            return result

        return Ticket(self._pool.submit(work), event)

    def to_device(self, t: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Copy a host tensor into device memory (called inside submitted work). On CPU the
        "device" is the same RAM: a host-tier tensor is cloned (the copy is what the tier
        budgets count), while a fresh read only this transfer holds (`owned`) is handed over."""
        if self.cuda:
            return t.to(self.device, non_blocking=True)
        return t if owned else t.clone()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_channels(device: torch.device, trace, link_gbps: float | None) -> dict[str, Channel]:
    link = EmulatedLink(link_gbps) if link_gbps else None  # one link, shared like PCIe
    names = ("weights", "experts", "kv_load", "kv_store", "disk")
    return {n: Channel(n, device, trace, None if n == "disk" else link) for n in names}


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host copies feeding a CUDA device are pinned, so copies can run asynchronously."""
    return t.pin_memory() if device.type == "cuda" else t
