"""Asynchronous transfer channels: `weights`, `experts`, `kv_load`, `kv_store` (+ `disk`).

Each channel is one FIFO worker thread: work submitted to it runs in order, overlapping the
scheduling thread's compute, and returns a `Ticket`. This is the ONLY place where CPU and
CUDA differ, and both follow one discipline for every buffer a transfer touches:

  1. A transfer's destination is fresh memory, allocated by the transfer itself.
  2. A consumer waits on its producer: `Ticket.wait` makes the waiting (compute) stream wait
     on the transfer's event. On CPU the worker's future is that event.
  3. A transfer that reads device memory the compute stream wrote (a KV store) waits on an
     event recorded on the compute stream when it was submitted (`after_compute`), and on any
     ticket it is ordered behind (`after`), e.g. the store a KV load re-reads.
  4. Release happens after the last reader: `Ticket.wait` tags what arrived with the waiting
     stream (`record_stream`), and a transfer tags what it reads (`reads`) with its own, so
     the caching allocator reuses a block only once every stream that used it is past it.
  5. `Ticket.done()` means the data has arrived (the worker ran and, on CUDA, its event
     completed), so the ready-first expert order and speculation see arrivals, not queueing.

  * CPU: `to_device` is a memory copy into a fresh tensor (the device tier is a budgeted
    working set in RAM), or no copy for a fresh disk read only that transfer holds. Without
    an emulated link such a copy runs on the thread that submits it (`inline`), as soon as
    nothing it waits for is pending: there is no link to overlap, only the same cores.
  * CUDA: the worker issues non-blocking copies from pinned memory on the channel's own
    `torch.cuda.Stream` and records an event, so copies overlap kernels as in the paper's
    four streams; their timings come from CUDA events (trace.py). While the CUDA sanitizer
    runs they are issued on the calling thread instead, where it can see them (cudacopies).

`link_gbps` (from `--emulate-link`) makes every host->device transfer take bytes /
bandwidth on ONE link shared by all channels (as streams share a PCIe link), so a CPU run
reproduces a PCIe card's compute/transfer ratio; on CUDA the copy runs at the real link's speed
and its ticket is held until the emulated link would have delivered it (cudacopies.hold). PCIe is
full duplex: device->host transfers (KV stores, the activations host compute takes down)
occupy a second link of the same rate, so host compute is never charged nothing for them. The `disk`
channel reads files into host memory: it is a worker thread on both paths.

Host data crosses a CUDA link only from page-locked memory, through rings (`PinnedRing`: bytes
reused once the copy that last read them is done). Each channel's staging ring (`StagedCopies`)
takes up what is pageable or strided: disk reads, host compute's results, a host KV cache's
slots (kv_load's, handed to each host cache by `execute/caches.KVSpace`). The run owns them (not
the process), the composition root charges those it will use to the host account, and `close`
gives them back. A step's small uploads and the routing ids' reads have small rings of their own.
The rings themselves are execute/staging.py's.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from klotski.execute import cudacopies
from klotski.execute.staging import StagedCopies
from planner.workingset import ACTIVATION_RING_BYTES, KV_STAGING_BYTES, STAGED_RING_BYTES

# the channels disk-tier groups go up on, each through its ring (planner.workingset.STAGED_RINGS)
DISK_CARRIERS = ("weights", "experts")
# the kv_load channel's ring (planner.workingset.KV_STAGING_BYTES): a host KV cache's strided
# slots (fewer rows than the batch, a sparse cache's kept slots, a shared segment's row) are
# gathered into it on their way up, in pieces of half of it; held (and charged to the host
# account) where the KV cache is on the host of a CUDA device (assemble.reserve_staging_rings)
HOST_TO_DEVICE = "host_to_device"  # the links --emulate-link throttles, one per direction
DEVICE_TO_HOST = "device_to_host"

class Ticket:
    def __init__(self, future: Future, event=None, carry: Carry | None = None):
        self.future, self.event = future, event
        self.carry = carry or Carry()
        self.waited_on = None  # the stream last made to wait for it: all its later work follows

    def promote(self) -> None:
        """Compute is about to wait for this transfer: a prefetch's chunks not yet on the link are
        carried as a demand load's (booked whole, ahead of later prefetches)."""
        self.carry.speculative = False

    def done(self) -> bool:
        """The data has arrived (not merely been queued)."""
        return self.future.done() and (self.event is None or self.event.query())

    def wait(self):
        """The result, usable on the calling thread's current stream. A run of experts moved in
        one submission is waited for by each member: the stream waits on the event once."""
        result = self.future.result()
        if self.event is not None:
            stream = torch.cuda.current_stream()
            if stream != self.waited_on:
                stream.wait_event(self.event)
                for t in device_tensors(result):
                    t.record_stream(stream)
                self.waited_on = stream
        return result

    def discard(self) -> None:
        """The result is not wanted: wait only until the work was issued, never making the
        calling stream wait on the copy (its memory stays the copy stream's until it is done)."""
        self.future.result()

    def landed(self) -> None:
        """Block the host until the transfer has finished (its own event: no device-wide
        synchronize), before the host reads or rewrites the memory it writes."""
        self.future.result()
        if self.event is not None:
            self.event.synchronize()


def device_tensors(value):
    """The CUDA tensors in a transfer's result (a tensor, or dicts/tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_cuda else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in device_tensors(v)]


# The emulated link holds a transfer back only when it is this far ahead of the link's
# schedule: a sleep costs ~70 us here however short (sleep(0) included), which on a small
# model's ~100 transfers a step was 7 ms of channel time no real link has. The schedule
# (`EmulatedLink.free_at`) still books every byte, so later transfers wait for the ones let
# through early, and the link is never more than this ahead of its bandwidth.
SLEEP_GRAIN = 0.5e-3


WAIT_SAMPLES = 1 << 16  # demand waits a link keeps for its percentiles

# The least chunk a speculative transfer is cut into: on CUDA each chunk is a copy launched (the
# count per transfer stays bounded on a slow link), on the emulated link one booking.
MIN_CHUNK_BYTES = 64 << 10


def chunk_bytes(bytes_per_s: float, chunk_ms: float) -> int:
    """A speculative transfer's chunk: `chunk_ms` of the link at `bytes_per_s`, at least
    MIN_CHUNK_BYTES; 0 (whole transfers) where `chunk_ms` is 0."""
    return max(MIN_CHUNK_BYTES, int(bytes_per_s * chunk_ms / 1e3)) if chunk_ms > 0 else 0


class Carry:
    """How one transfer is carried: `speculative` (a prefetch, which yields the link to a demand
    load at its next chunk boundary) until promoted, when compute came to wait for it."""

    __slots__ = ("speculative", "booked", "done_at")

    def __init__(self, speculative: bool = False):
        self.speculative = speculative
        self.booked = False  # a chunk of it is on the link already
        self.done_at = 0.0   # when the link delivers what it booked of it (perf_counter seconds)


class EmulatedLink:
    """A host->device link of fixed bandwidth shared by every channel, at two priorities (ProMoE).
    A demand transfer (compute waits for it) books the link whole, from the moment the link is
    free. A speculative one (a prefetch) books it a chunk of `chunk` bytes at a time, the next
    chunk only once the booked schedule is within SLEEP_GRAIN of now, so a demand arriving while
    a prefetch is on the link starts after that chunk (plus at most half a grain) and the prefetch
    resumes behind it. `chunk` 0: every transfer booked whole, first come first served (a large
    prefetch holds the link until it is done). The link counts what it did: each demand
    transfer's wait for the link (its booked start less its arrival), the chunks booked and how
    often a prefetch resumed behind a demand load (`report`)."""

    def __init__(self, gbps: float, chunk_ms: float = 0.0):
        self.bytes_per_s = gbps * 1e9
        self.chunk = chunk_bytes(self.bytes_per_s, chunk_ms)
        self.free_at = 0.0
        # each demand transfer's (or promoted remainder's) wait, seconds: counted and summed exactly,
        # kept for the percentiles as a uniform sample of at most WAIT_SAMPLES (a long run's are many)
        self.demand_waits: list[float] = []
        self.demand_count, self.demand_sum = 0, 0.0
        self._sampler = random.Random(0)
        self.chunks = 0                      # speculative chunks booked
        self.yields = 0                      # a begun prefetch resumed behind a demand that came meanwhile
        self._last: Carry | None = None      # the transfer that booked last
        self._lock = threading.Lock()

    def occupy(self, nbytes: int, now: float, carry: Carry | None = None) -> float:
        """Book the link for `nbytes` arriving at `now`; return when they are delivered."""
        with self._lock:
            start = max(now, self.free_at)
            if carry is None or not carry.speculative:
                self.record_wait(start - now)
            else:
                self.chunks += 1
                if carry.booked and self._last is not None and self._last is not carry and not self._last.speculative:
                    self.yields += 1  # it had begun, and resumes behind a demand load
            self._last = carry
            self.free_at = start + nbytes / self.bytes_per_s
            if carry is not None:
                carry.booked, carry.done_at = True, self.free_at
            return self.free_at

    def carry(self, nbytes: int, start: float, carry: Carry, fn=None):
        """Carry `nbytes` from `start`, at `carry`'s priority, running `fn()` (the copy itself)
        once the first booking is made; `fn`'s result once the link has delivered the last byte
        (the calling worker sleeps until then)."""
        left, now, result, first = nbytes, start, None, True
        while True:
            piece = min(left, self.chunk) if carry.speculative and self.chunk else left
            done_at = self.occupy(piece, now, carry)
            left -= piece
            if first:
                result, first = (fn() if fn is not None else None), False
            ahead = done_at - time.perf_counter()
            if left <= 0:
                if ahead > SLEEP_GRAIN:
                    time.sleep(ahead)
                return result
            if ahead > SLEEP_GRAIN:  # the next chunk is booked half a grain before this one ends
                time.sleep(ahead - SLEEP_GRAIN / 2)
            now = time.perf_counter()

    def record_wait(self, wait: float) -> None:
        """One demand transfer's wait for the link (reservoir sampling past WAIT_SAMPLES)."""
        self.demand_count += 1
        self.demand_sum += wait
        if len(self.demand_waits) < WAIT_SAMPLES:
            self.demand_waits.append(wait)
        elif (i := self._sampler.randrange(self.demand_count)) < WAIT_SAMPLES:
            self.demand_waits[i] = wait

    def report(self) -> dict:
        """Demand loads' waits for the link (count, sum, p50, p99) and the chunking's counters."""
        with self._lock:
            waits = sorted(self.demand_waits)
        pick = lambda q: round(waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3, 4) if waits else 0.0
        return {"chunk_bytes": self.chunk, "demand_loads": self.demand_count,
                "demand_wait_s": round(self.demand_sum, 5),
                "demand_wait_p50_ms": pick(0.5), "demand_wait_p99_ms": pick(0.99),
                "speculative_chunks": self.chunks, "prefetch_yields": self.yields}


class Channel:
    def __init__(self, name: str, device: torch.device, trace, link: EmulatedLink | None = None,
                 down: EmulatedLink | None = None, staged_bytes: int = STAGED_RING_BYTES,
                 gate: "LinkGate | None" = None):
        self.name, self.device, self.trace = name, device, trace
        self.gate = gate or LinkGate(0)  # CUDA: speculative copies in chunks, behind demand copies
        self._carry: Carry | None = None  # the transfer this channel's worker is issuing (CUDA)
        self.links = {HOST_TO_DEVICE: link, DEVICE_TO_HOST: down}
        # the disk channel only reads files into host memory: host work, timed by the host clock
        self.cuda = device.type == "cuda" and name != "disk"
        # A CPU copy with no link to wait for is memory traffic on the cores compute runs on:
        # on a worker thread it only made three threads share two cores, and the scheduling
        # thread lost its core mid-step (the demo at 900 MiB: 27.2 tok/s threaded, 32.5 inline,
        # decode 15.2 -> 11.2 s, medians of 3 alternating). Disk reads stay on their thread.
        self.inline = device.type == "cpu" and name != "disk" and link is None and down is None
        self.on_caller = self.cuda and cudacopies.sanitizer_on()
        self._queued: Future | None = None  # the last work handed to the worker thread
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # pageable sources (disk reads, host compute's results) and, on kv_load, a host KV cache's
        # strided slots cross the link from locked memory: the channel's staging ring, the run's own
        self.staged = StagedCopies(staged_bytes)
        # On CPU a copy on a worker would start its own OpenMP team as wide as the machine,
        # whose threads spin on the cores compute runs on: one thread per channel (measured on
        # tiny-mixtral with a 2 GB/s link on 2 cores: 36.8 -> 66 tokens/s).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"klotski-{name}",
                                        initializer=None if self.cuda else torch.set_num_threads,
                                        initargs=() if self.cuda else (1,))

    def submit(self, fn, *, name: str, nbytes: int = 0, link: str | None = HOST_TO_DEVICE,
               after: list[Ticket] = (), after_compute: bool = False, reads=(), speculative: bool = False) -> Ticket:
        """Run `fn()` on this channel after everything submitted before it, after the tickets
        in `after` and, with `after_compute`, after the compute queued so far; `reads` are
        device tensors `fn` reads (kept from reuse until this transfer is past them).
        `speculative`: a prefetch, which yields the link to demand loads at chunk boundaries
        (EmulatedLink; on CUDA its copies are cut into chunks: copy_into) until promoted."""
        carry = Carry(speculative)
        if not self.cuda:
            after = [t for t in after if not t.done()]

            def work():
                for t in after:
                    t.wait()
                start = time.perf_counter()
                emulated = self.links.get(link)
                result = emulated.carry(nbytes, start, carry, fn) if emulated else fn()
                self.trace.add(self.name, name, start, time.perf_counter(), nbytes, link)
                return result

            # inline only behind nothing: the channel stays first in, first out
            if self.inline and not after and (self._queued is None or self._queued.done()):
                done = Future()
                try:
                    done.set_result(work())
                except Exception as e:  # raised where the ticket is waited for, as on a worker
                    done.set_exception(e)
                return Ticket(done, carry=carry)
            self._queued = self._pool.submit(work)
            return Ticket(self._queued, carry=carry)
        event = torch.cuda.Event()
        computed = torch.cuda.Event() if after_compute else None
        if computed is not None:
            computed.record()  # the scheduling thread's current stream: compute
        waits = [t.event for t in after if t.event is not None] + ([computed] if computed else [])

        def work():
            for t in after:
                t.future.result()  # its event is recorded once its work has been issued
            start = time.perf_counter()
            with torch.cuda.stream(self.stream):
                for e in waits:
                    self.stream.wait_event(e)
                for t in reads:
                    t.record_stream(self.stream)
                with self.trace.gpu_span(self.name, name, nbytes, link):
                    self._carry = carry  # copy_into cuts a speculative transfer's copies into chunks
                    try:
                        result = fn()
                    finally:
                        self._carry = None
                event.record(self.stream)
                if not carry.speculative and link == HOST_TO_DEVICE and computed is None:
                    # a demand copy up the link a prefetch must not delay; not a copy down, nor
                    # one waiting for compute (a prefetch waiting for those would wait for compute)
                    self.gate.issued(event)
            cudacopies.hold(self.links.get(link), nbytes, start, carry)  # --emulate-link: arrival at its rate
            return result

        if self.on_caller:  # the CUDA sanitizer sees the copies only on its own thread
            return Ticket(cudacopies.run_here(work), event, carry)
        self._queued = self._pool.submit(work)
        return Ticket(self._queued, event, carry)

    def link_report(self) -> dict | None:
        """What the emulated host->device link this channel shares saw (EmulatedLink.report); None
        without one."""
        link = self.links.get(HOST_TO_DEVICE)
        return link.report() if link is not None else None

    def drain(self) -> None:
        """Wait until everything submitted so far has run and its copies are done (before the
        memory they read goes: a failed step's loads issued ahead)."""
        if self._queued is not None:
            wait([self._queued])  # its own failure, if any, is its ticket's to raise
        if self.stream is not None:
            self.stream.synchronize()

    def to_device(self, t: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Copy a host tensor into device memory (called inside submitted work). On CPU the
        "device" is the same RAM: a host-tier tensor is cloned (the copy is what the tier
        budgets count), while a fresh read only this transfer holds (`owned`) is handed over."""
        if self.cuda:
            if t.is_pinned() and self._chunked():
                return self.copy_into(torch.empty(t.shape, dtype=t.dtype, device=self.device), t)
            if t.is_pinned():  # the host tier's locked blocks
                return t.to(self.device, non_blocking=True)
            return self.staged.copy(t, torch.empty(t.shape, dtype=t.dtype, device=self.device))
        return t if owned else t.clone()

    def empty(self, shape, dtype) -> torch.Tensor:
        """Fresh device memory for a transfer to land in (called inside submitted work)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy a host tensor into device memory `dst` (called inside submitted work); `dst`."""
        if self.cuda and not src.is_pinned():
            self.staged.copy(src, dst)
        elif self._chunked() and dst.is_contiguous() and src.is_contiguous():
            copy_in_chunks(dst, src, self.gate, self._carry, torch.cuda.Event)
        else:
            dst.copy_(src, non_blocking=self.cuda)
        return dst

    def _chunked(self) -> bool:
        """This worker is issuing a speculative CUDA transfer that the link's gate cuts into chunks."""
        return self.cuda and self._carry is not None and self._carry.speculative and self.gate.chunk > 0

    def close(self) -> None:
        """After the channel's last work: its staging ring (if made) is unlocked and its charge
        given back once the copies out of it are done."""
        self._pool.shutdown(wait=True)
        self.staged.release()


# Without an emulated link a CUDA prefetch is cut at the link's nominal rate (PCIe 4.0 x16) times
# --transfer-chunk-ms: the real rate is not known before a profile, and the chunk only bounds
# how long a demand copy waits (and, from below, how many copies a prefetch launches).
CUDA_LINK_BYTES_PER_S = 25e9


DEFAULT_CHUNK_MS = 0.25  # --transfer-chunk-ms unset, on an emulated link


def make_channels(device: torch.device, trace, link_gbps: float | None,
                  chunk_ms: float | None = 0.0) -> dict[str, Channel]:
    """The run's channels. `chunk_ms`: a speculative transfer yields the host->device link to
    demand loads every this many ms of the link (EmulatedLink, LinkGate); 0: whole transfers;
    None: DEFAULT_CHUNK_MS on an emulated link, whole transfers on CUDA (LinkGate's chunked
    copies have not yet run on a GPU: opt in with a value)."""
    # one link each way, shared by every channel like PCIe; a prefetch yields only the link up
    emulated_ms = DEFAULT_CHUNK_MS if chunk_ms is None else chunk_ms
    up, down = (EmulatedLink(link_gbps, emulated_ms), EmulatedLink(link_gbps)) if link_gbps else (None, None)
    cuda = torch.device(device).type == "cuda"
    gate = LinkGate(chunk_bytes(up.bytes_per_s if up else CUDA_LINK_BYTES_PER_S, chunk_ms or 0) if cuda else 0)
    # host compute's results come up on their own channel: behind the KV loads they would
    # wait for transfers they do not depend on
    names = ("weights", "experts", "kv_load", "kv_store", "activations", "disk")
    rings = {"activations": ACTIVATION_RING_BYTES, "kv_load": KV_STAGING_BYTES}
    return {n: Channel(n, device, trace, *((None, None) if n == "disk" else (up, down)),
                       staged_bytes=rings.get(n, STAGED_RING_BYTES), gate=gate)
            for n in names}


def link_report(channels: dict) -> dict | None:
    """What the emulated host->device link the channels share saw (EmulatedLink.report); None
    without one."""
    return next((r for c in channels.values() if (r := c.link_report()) is not None), None)


class LinkGate:
    """The CUDA side of two priorities on one link (the channels going up share it): demand
    transfers' events as they are issued (`issued`), and the chunk a speculative copy is cut
    into (0: not cut). Before each chunk a prefetch's worker waits, on its own thread, for the
    demand copies issued so far (`clear`), and keeps at most two of its own chunks queued
    (copy_in_chunks), so a demand copy queues behind at most those, not the whole prefetch.
    No wait is on the compute thread. `event` replaces torch.cuda.Event (tests)."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self.pending: deque = deque()  # events of demand copies issued, not yet seen complete
        self._lock = threading.Lock()

    def issued(self, event) -> None:
        with self._lock:
            while self.pending and self.pending[0].query():  # complete: no longer in anyone's way
                self.pending.popleft()
            self.pending.append(event)

    def clear(self) -> None:
        """Wait for every demand copy issued so far (called by a prefetch's worker)."""
        while True:
            with self._lock:
                if not self.pending:
                    return
                first = self.pending[0]
            first.synchronize()
            with self._lock:
                if self.pending and self.pending[0] is first:
                    self.pending.popleft()


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, gate: LinkGate, carry: Carry, event, copy=None) -> None:
    """A speculative transfer's copy `src` -> `dst` (both contiguous) in `gate.chunk`-byte
    chunks, each issued once the demand copies issued before it are done and at most one of its
    own earlier chunks is still queued (an event recorded behind each: `event()`); promoted
    (`carry.speculative` false), the rest goes in one copy. `copy(dst, src)` issues one copy (a
    non-blocking copy_ on the current stream unless given)."""
    copy = copy or (lambda d, s: d.copy_(s, non_blocking=True))
    a, b = src.reshape(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    queued: deque = deque()
    for i in range(0, len(a), gate.chunk):
        if not carry.speculative:
            copy(b[i:], a[i:])
            return
        gate.clear()
        while len(queued) > 1:
            queued.popleft().synchronize()
        copy(b[i:i + gate.chunk], a[i:i + gate.chunk])
        done = event()
        done.record()
        queued.append(done)
