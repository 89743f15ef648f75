"""Timeline of a run: every compute and transfer as an event (lane, name, start, end, bytes).

Lanes: `compute` (the scheduling thread), `wait` (compute blocked on a transfer: the bubble),
and one per channel. `to_chrome()` gives the Chrome-trace JSON that Perfetto opens.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

LANES = ("compute", "wait", "weights", "experts", "kv_load", "kv_store", "disk")


@dataclass(frozen=True)
class Event:
    lane: str
    name: str
    start: float
    end: float
    nbytes: int = 0


class Trace:
    def __init__(self, keep_events: bool = False):
        self.t0 = time.perf_counter()
        self.keep_events = keep_events
        self.events: list[Event] = []
        self.busy = defaultdict(float)     # lane -> seconds
        self.bytes = defaultdict(int)      # link -> bytes
        self._lock = threading.Lock()

    def add(self, lane: str, name: str, start: float, end: float, nbytes: int = 0, link: str | None = None):
        with self._lock:
            self.busy[lane] += end - start
            if link:
                self.bytes[link] += nbytes
            if self.keep_events:
                self.events.append(Event(lane, name, start - self.t0, end - self.t0, nbytes))

    @contextmanager
    def span(self, lane: str, name: str, nbytes: int = 0, link: str | None = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter(), nbytes, link)

    @property
    def bubble_s(self) -> float:
        return self.busy["wait"]

    def bubble_share(self) -> float:
        total = self.busy["compute"] + self.busy["wait"]
        return self.busy["wait"] / total if total else 0.0

    def to_chrome(self) -> dict:
        tid = {lane: i for i, lane in enumerate(LANES)}
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": lane}}
                  for lane, i in tid.items()]
        for e in self.events:
            events.append({"name": e.name, "ph": "X", "pid": 1, "tid": tid.get(e.lane, len(LANES)),
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                           "args": {"bytes": e.nbytes} if e.nbytes else {}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
