"""Timeline of a run: every compute and transfer as an event (lane, name, start, end, bytes).

Lanes: `compute`, `wait` (compute idle: the bubble), one per channel, and `host` (attention
or experts computed on the host, by the host clock; on CPU inside a compute span, on CUDA
outside it: the device idles meanwhile). `to_chrome()` gives
the Chrome-trace JSON that Perfetto opens.

On CPU a span is timed by the thread that runs it, and `wait` is the scheduling thread
blocked on a transfer. On CUDA the host only queues work, so host clocks time queueing:
compute and transfer spans are timed by CUDA events on the stream that runs them, turned
into times once they have completed (`resolve`), and `wait` is every gap in the compute
stream between two compute spans of one step, whatever its cause (a transfer not yet
arrived, a host sync, launch overhead): time the GPU's compute stream stood idle.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

LANES = ("compute", "wait", "weights", "experts", "kv_load", "kv_store", "activations", "disk", "host_wait", "host")


@dataclass(frozen=True)
class Event:
    lane: str
    name: str
    start: float
    end: float
    nbytes: int = 0


class Trace:
    def __init__(self, keep_events: bool = False, cuda: bool = False):
        self.keep_events, self.cuda = keep_events, cuda
        self.events: list[Event] = []
        self.busy = defaultdict(float)     # lane -> seconds
        self.phase = "prefill"             # the engine says which phase its steps are in
        self.decode_busy = defaultdict(float)  # lane -> seconds, decode steps only
        self.bytes = defaultdict(int)      # link -> bytes
        self.decode_bytes = defaultdict(int)  # link -> bytes, transfers issued during decode steps
        self._lock = threading.Lock()
        self._gpu: list = []               # (lane, name, start event, end event, bytes) not yet resolved
        if cuda:
            import torch
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            self._ref.synchronize()
        self.t0 = time.perf_counter()

    def add(self, lane: str, name: str, start: float, end: float, nbytes: int = 0, link: str | None = None):
        with self._lock:
            self.busy[lane] += end - start
            if self.phase == "decode":
                self.decode_busy[lane] += end - start
            if link:
                self._count(link, nbytes)
            if self.keep_events:
                self.events.append(Event(lane, name, start - self.t0, end - self.t0, nbytes))

    @contextmanager
    def span(self, lane: str, name: str, nbytes: int = 0, link: str | None = None):
        """Time the work queued inside: by the host clock on CPU, by CUDA events on the
        current stream on CUDA."""
        if self.cuda:
            with self.gpu_span(lane, name, nbytes, link):
                yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter(), nbytes, link)

    @contextmanager
    def gpu_span(self, lane: str, name: str, nbytes: int = 0, link: str | None = None):
        import torch
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._gpu.append((lane, name, start, end, nbytes))
                if link:
                    self._count(link, nbytes)

    def _count(self, link: str, nbytes: int) -> None:
        self.bytes[link] += nbytes
        if self.phase == "decode":
            self.decode_bytes[link] += nbytes

    def waited(self, name: str, start: float, end: float) -> None:
        """The scheduling thread blocked on a transfer: the bubble on CPU. On CUDA the bubble
        is read from the compute stream instead, and host blocking is its own lane."""
        self.add("host_wait" if self.cuda else "wait", name, start, end)

    def resolve(self, everything: bool = False) -> None:
        """Turn completed GPU spans into events (all of them, waiting, with `everything`);
        gaps between the compute spans resolved together become `wait`."""
        if not self.cuda:
            return
        with self._lock:
            done, waiting = [], []
            for g in self._gpu:
                (done if everything or g[3].query() else waiting).append(g)
            self._gpu = waiting
        compute = []
        for lane, name, start, end, nbytes in done:
            end.synchronize()
            a = self.t0 + self._ref.elapsed_time(start) / 1e3
            b = self.t0 + self._ref.elapsed_time(end) / 1e3
            self.add(lane, name, a, b, nbytes)
            if lane == "compute":
                compute.append((a, b))
        compute.sort()
        for (_, end0), (start1, _) in zip(compute, compute[1:]):
            if start1 > end0:
                self.add("wait", "idle", end0, start1)

    @property
    def bubble_s(self) -> float:
        return self.busy["wait"]

    def bubble_share(self, decode_only: bool = False) -> float:
        busy = self.decode_busy if decode_only else self.busy
        total = busy["compute"] + busy["wait"]
        return busy["wait"] / total if total else 0.0

    def to_chrome(self) -> dict:
        tid = {lane: i for i, lane in enumerate(LANES)}
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": lane}}
                  for lane, i in tid.items()]
        for e in self.events:
            events.append({"name": e.name, "ph": "X", "pid": 1, "tid": tid.get(e.lane, len(LANES)),
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                           "args": {"bytes": e.nbytes} if e.nbytes else {}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
