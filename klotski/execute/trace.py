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

Timing is sampled: one step in `every` of each phase (the first of a phase always) is timed,
the others pay nothing but a flag test per span (no clock read, no CUDA event, no resolve);
bytes are counted on every step. `busy` and `decode_busy` are estimates for every step: each
phase's timed seconds times its steps over its timed steps (a ratio estimator, so the bubble
share, a ratio of two lanes, is the timed steps' own). A trace kept for Perfetto
(`keep_events`) times every step. GPU spans are resolved at the start of the next timed step
(they have completed by then) and at the run's end.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
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
    def __init__(self, keep_events: bool = False, cuda: bool = False, every: int = 1, event=None):
        self.keep_events, self.cuda = keep_events, cuda
        self.every = 1 if keep_events else max(1, every)
        self.events: list[Event] = []
        self.phase = "prefill"             # the engine says which phase its steps are in
        self.steps, self.timed_steps = Counter(), Counter()  # phase -> steps begun, of them timed
        self.timing = True                 # whether the current step is timed
        self._measured = {"prefill": defaultdict(float), "decode": defaultdict(float)}  # phase -> lane -> s
        self.bytes = defaultdict(int)      # link -> bytes
        self.decode_bytes = defaultdict(int)  # link -> bytes, transfers issued during decode steps
        self._lock = threading.Lock()
        self._gpu: list = []               # (lane, name, start event, end event, bytes, phase) not yet resolved
        if cuda:
            import torch
            self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
            self._ref = self._event()
            self._ref.record()
            self._ref.synchronize()
        self.t0 = time.perf_counter()

    def begin_step(self) -> None:
        """A step of the current phase begins: time it or not (one in `every`); a timed step first
        resolves the GPU spans of the last one."""
        phase = self.phase
        self.timing = self.steps[phase] % self.every == 0
        self.steps[phase] += 1
        if self.timing:
            self.timed_steps[phase] += 1
            self.resolve()

    def _scale(self, phase: str) -> float:
        timed = self.timed_steps[phase]
        return self.steps[phase] / timed if timed else 1.0

    @property
    def busy(self) -> dict:
        """lane -> seconds over every step (the timed ones scaled up, phase by phase)."""
        out = defaultdict(float)
        for phase, lanes in self._measured.items():
            for lane, seconds in lanes.items():
                out[lane] += seconds * self._scale(phase)
        return out

    @property
    def decode_busy(self) -> dict:
        """lane -> seconds over every decode step (the timed ones scaled up)."""
        scale = self._scale("decode")
        return defaultdict(float, {lane: s * scale for lane, s in self._measured["decode"].items()})

    def clear_counts(self) -> None:
        """Forget the seconds and bytes so far (a server's next batch reports its own)."""
        with self._lock:
            for lanes in self._measured.values():
                lanes.clear()
            self.bytes.clear()
            self.decode_bytes.clear()
            self.steps.clear()
            self.timed_steps.clear()

    def add(self, lane: str, name: str, start: float, end: float, nbytes: int = 0, link: str | None = None,
            phase: str | None = None):
        """Seconds on `lane` (only in a timed step, or of one: `phase`, when resolved later) and
        the bytes of a transfer on `link` (always)."""
        with self._lock:
            if link:
                self._count(link, nbytes)
            if phase is None and not self.timing:
                return
            self._measured[phase or self.phase][lane] += end - start
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
        if not self.timing:
            try:
                yield
            finally:
                if link:
                    with self._lock:
                        self._count(link, nbytes)
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter(), nbytes, link)

    @contextmanager
    def gpu_span(self, lane: str, name: str, nbytes: int = 0, link: str | None = None):
        timed, phase = self.timing, self.phase
        if timed:
            start = self._event()
            start.record()
        try:
            yield
        finally:
            if timed:
                end = self._event()
                end.record()
            with self._lock:
                if timed:
                    self._gpu.append((lane, name, start, end, nbytes, phase))
                if link:
                    self._count(link, nbytes)

    def _count(self, link: str, nbytes: int) -> None:
        self.bytes[link] += nbytes
        if self.phase == "decode":
            self.decode_bytes[link] += nbytes

    def waited(self, name: str, start: float, end: float) -> None:
        """The scheduling thread blocked on a transfer: the bubble on CPU. On CUDA the bubble
        is read from the compute stream instead, and host blocking is its own lane."""
        if self.timing:
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
        for lane, name, start, end, nbytes, phase in done:
            end.synchronize()
            a = self.t0 + self._ref.elapsed_time(start) / 1e3
            b = self.t0 + self._ref.elapsed_time(end) / 1e3
            self.add(lane, name, a, b, nbytes, phase=phase)
            if lane == "compute":
                compute.append((a, b, phase))
        compute.sort()
        for (_, end0, _), (start1, _, phase) in zip(compute, compute[1:]):
            if start1 > end0:
                self.add("wait", "idle", end0, start1, phase=phase)

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
