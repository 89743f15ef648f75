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
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from klotski.execute import cudacopies
from placement import pinned
from planner.workingset import ACTIVATION_RING_BYTES, KV_STAGING_BYTES, STAGED_RING_BYTES, STEP_RING_BYTES

# the channels disk-tier groups go up on, each through its ring (planner.workingset.STAGED_RINGS)
DISK_CARRIERS = ("weights", "experts")
# the kv_load channel's ring (planner.workingset.KV_STAGING_BYTES): a host KV cache's strided
# slots (fewer rows than the batch, a sparse cache's kept slots, a shared segment's row) are
# gathered into it on their way up, in pieces of half of it; held (and charged to the host
# account) where the KV cache is on the host of a CUDA device (assemble.reserve_staging_rings)
HOST_TO_DEVICE = "host_to_device"  # the links --emulate-link throttles, one per direction
DEVICE_TO_HOST = "device_to_host"

class Ticket:
    def __init__(self, future: Future, event=None):
        self.future, self.event = future, event
        self.waited_on = None  # the stream last made to wait for it: all its later work follows

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
    def __init__(self, name: str, device: torch.device, trace, link: EmulatedLink | None = None,
                 down: EmulatedLink | None = None, staged_bytes: int = STAGED_RING_BYTES):
        self.name, self.device, self.trace = name, device, trace
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
               after: list[Ticket] = (), after_compute: bool = False, reads=()) -> Ticket:
        """Run `fn()` on this channel after everything submitted before it, after the tickets
        in `after` and, with `after_compute`, after the compute queued so far; `reads` are
        device tensors `fn` reads (kept from reuse until this transfer is past them)."""
        if not self.cuda:
            after = [t for t in after if not t.done()]

            def work():
                for t in after:
                    t.wait()
                start = time.perf_counter()
                emulated = self.links.get(link)
                done_at = emulated.occupy(nbytes, start) if emulated else None
                result = fn()
                ahead = done_at - time.perf_counter() if done_at is not None else 0.0
                if ahead > SLEEP_GRAIN:
                    time.sleep(ahead)
                self.trace.add(self.name, name, start, time.perf_counter(), nbytes, link)
                return result

            # inline only behind nothing: the channel stays first in, first out
            if self.inline and not after and (self._queued is None or self._queued.done()):
                done = Future()
                try:
                    done.set_result(work())
                except Exception as e:  # raised where the ticket is waited for, as on a worker
                    done.set_exception(e)
                return Ticket(done)
            self._queued = self._pool.submit(work)
            return Ticket(self._queued)
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
                    result = fn()
                event.record(self.stream)
            cudacopies.hold(self.links.get(link), nbytes, start)  # --emulate-link: arrival at the link's rate
            return result

        if self.on_caller:  # the CUDA sanitizer sees the copies only on its own thread
            return Ticket(cudacopies.run_here(work), event)
        self._queued = self._pool.submit(work)
        return Ticket(self._queued, event)

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
            if t.is_pinned():  # the host tier's locked blocks
                return t.to(self.device, non_blocking=True)
            return self.staged.copy(t, torch.empty(t.shape, dtype=t.dtype, device=self.device))
        return t if owned else t.clone()

    def empty(self, shape, dtype) -> torch.Tensor:
        """Fresh device memory for a transfer to land in (called inside submitted work)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a host tensor into device memory `dst` (called inside submitted work)."""
        if self.cuda and not src.is_pinned():
            self.staged.copy(src, dst)
        else:
            dst.copy_(src, non_blocking=self.cuda)

    def close(self) -> None:
        """After the channel's last work: its staging ring (if made) is unlocked and its charge
        given back once the copies out of it are done."""
        self._pool.shutdown(wait=True)
        self.staged.release()


def make_channels(device: torch.device, trace, link_gbps: float | None) -> dict[str, Channel]:
    # one link each way, shared by every channel like PCIe
    up, down = (EmulatedLink(link_gbps), EmulatedLink(link_gbps)) if link_gbps else (None, None)
    # host compute's results come up on their own channel: behind the KV loads they would
    # wait for transfers they do not depend on
    names = ("weights", "experts", "kv_load", "kv_store", "activations", "disk")
    rings = {"activations": ACTIVATION_RING_BYTES, "kv_load": KV_STAGING_BYTES}
    return {n: Channel(n, device, trace, *((None, None) if n == "disk" else (up, down)),
                       staged_bytes=rings.get(n, STAGED_RING_BYTES))
            for n in names}


class PinnedRing:
    """Page-locked bytes reused in turn by copies that cross the link: `take(n)` gives the next n
    free bytes, `busy(start, n)` marks them read or written by a copy until an event recorded on
    the current stream completes. Bytes are reused only once their event has completed (waited
    for only if the ring came round that fast). `buffer` and `event` replace the page-locked
    bytes and CUDA events (tests check the bookkeeping on a CPU)."""

    ALIGN = 256

    def __init__(self, nbytes: int, *, buffer=None, event=None):
        self.bytes = buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.event = event or (lambda: torch.cuda.Event())
        self.head = 0
        self.pending: deque = deque()  # (start, end, event) of bytes a copy may still be using

    def __len__(self) -> int:
        return len(self.bytes)

    def take(self, nbytes: int) -> int:
        """The start of `nbytes` free bytes, waiting for the oldest copies out of them if needed."""
        while self.pending and self.pending[0][2].query():  # done already: free, no wait
            self.pending.popleft()
        start = -(-self.head // self.ALIGN) * self.ALIGN
        if start + nbytes > len(self.bytes):
            start = 0
        # A ring's copies are queued on one stream, so they finish in the order they were taken:
        # the bytes in use run from the oldest copy's start round to the newest copy's end, and
        # the oldest is waited for until these bytes are clear of them (after a wrap the oldest
        # may be a straggler at the ring's end while a newer one holds its start: both count)
        while self.pending and self._in_use(start, start + nbytes):
            self.pending.popleft()[2].synchronize()
        self.head = start + nbytes
        return start

    def _in_use(self, start: int, end: int) -> bool:
        first, last = self.pending[0][0], self.pending[-1][1]
        if first < last:
            return start < last and first < end
        return start < last or first < end  # the copies in use wrap round the ring's end

    def busy(self, start: int, nbytes: int):
        """Bytes [start, start + nbytes) are in a copy queued on the current stream; its event."""
        done = self.event()
        done.record()
        self.pending.append((start, start + nbytes, done))
        return done

    def drain(self) -> None:
        """Wait for every copy still using the ring (before it is replaced)."""
        while self.pending:
            self.pending.popleft()[2].synchronize()


class SmallUploads:
    """A step's small host tensors (ids, masks, RoPE tables, a wave's rows and offsets) on their
    way to a CUDA device, through one persistent page-locked ring (PinnedRing): each is copied
    into the next free bytes and sent up non-blocking, an event marking when the device has read
    them. No `pin_memory()` per tensor. A tensor larger than half the ring, or a CPU device,
    takes the plain path. The ring is held for the run (`pinned_bytes`: what the composition
    root charges to the host budget)."""

    def __init__(self, device: torch.device, nbytes: int = STEP_RING_BYTES // 2, *, buffer=None, event=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ring = PinnedRing(nbytes, buffer=buffer, event=event) if self.cuda or buffer is not None else None

    @property
    def pinned_bytes(self) -> int:
        return pinned.charge(len(self.ring)) if self.ring is not None and self.cuda else 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == self.device.type:
            return t
        nbytes = t.numel() * t.element_size()
        if self.ring is None or nbytes > len(self.ring) // 2:
            return t.to(self.device)  # no ring here (CPU, or too large): a plain copy
        start = self.ring.take(nbytes)
        staged = self.ring.bytes[start:start + nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        self.ring.busy(start, nbytes)
        return out


class HostReads:
    """Small device tensors read on the host (a layer's routing ids): each copied non-blocking
    into the next bytes of a persistent page-locked ring, an event recorded behind it on the
    compute stream, so the kernels queued after it run on while the host waits for the values
    (`Read.wait`) only where a decision needs them. On a CPU the tensor is on the host already:
    no copy. The ring is held for the run at a fixed size (`pinned_bytes`, charged to the host
    budget by the composition root): a tensor larger than half of it (the ids of a prefill of
    over 32k routed pairs) is read with a plain blocking copy, a wait behind that layer's work,
    where a grown ring would be page-locked bytes the budget never gave."""

    def __init__(self, device: torch.device, nbytes: int = STEP_RING_BYTES // 2, *, buffer=None, event=None):
        self.cuda = torch.device(device).type == "cuda"
        self.ring = PinnedRing(nbytes, buffer=buffer, event=event) if self.cuda or buffer is not None else None

    @property
    def pinned_bytes(self) -> int:
        return pinned.charge(len(self.ring)) if self.ring is not None and self.cuda else 0

    def __call__(self, t: torch.Tensor) -> "Read":
        if self.ring is None:
            return Read(t)
        nbytes = t.numel() * t.element_size()
        if nbytes > len(self.ring) // 2:
            return Read(t.to("cpu"))
        start = self.ring.take(nbytes)
        staged = self.ring.bytes[start:start + nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t, non_blocking=True)
        return Read(staged, self.ring.busy(start, nbytes))


class Read:
    """A device tensor on its way to the host: `wait()` gives the host copy once it has landed."""

    def __init__(self, value: torch.Tensor, event=None):
        self.value, self.event = value, event

    def wait(self) -> torch.Tensor:
        if self.event is None:
            return self.value
        self.event.synchronize()  # the copy, not the compute queued behind it
        return self.value.clone()  # the ring's bytes are reused from now on


class Landed:
    """The event of a copy that is complete when it returns (on a CPU "device"): never waited for."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _send(dst: torch.Tensor, staged: torch.Tensor) -> None:
    dst.copy_(staged, non_blocking=True)  # on the current stream: the channel's


class StagedCopies:
    """A channel's staging ring: host data crosses the link from it, never from pageable or
    strided memory (which a CUDA copy reads synchronously, through the driver's own bounce
    buffer). Pageable tensors (a disk-tier group as read from the file, host compute's results)
    go up piece by piece (`copy`); a host KV cache's strided slots are gathered into it, as many
    whole slots a piece as fit (`gather`, on kv_load). A piece is at most half the ring, so the
    next is staged while the last one moves, and bytes are refilled only once the copy that last
    read them has completed (its event: PinnedRing). Made on first use (a run with no disk tier
    never allocates the carriers' rings), in one exactly sized page-locked block
    (placement/pinned.py); the composition root charges it to the run's host account where it
    will be used (`charge`) and the channel's close gives both back (`release`). `buffer` and
    `event` replace the block and the CUDA events (tests); `on_host` is the same ring in plain
    memory with copies complete when they return (the CUDA path's bookkeeping on a CPU)."""

    def __init__(self, nbytes: int = STAGED_RING_BYTES, *, buffer=None, event=None, locked: bool = True):
        self.nbytes, self.buffer, self.event, self.locked = nbytes, buffer, event, locked
        self.ring: PinnedRing | None = None
        self._blocks: pinned.PinnedBlocks | None = None
        self._charges: list = []  # (account, bytes) this ring holds there
        self._lock = threading.Lock()  # one copy at a time through the ring

    @classmethod
    def on_host(cls, nbytes: int) -> "StagedCopies":
        return cls(nbytes, locked=False)

    def charge(self, account, what: str) -> int:
        """Hold the bytes the ring takes in `account` (a placement.tiers.Memory; raises OverBudget
        when they do not fit) until `release`; the bytes charged."""
        nbytes = pinned.charge(len(self.buffer) if self.buffer is not None else self.nbytes)
        account.reserve(nbytes, what)
        self._charges.append((account, nbytes))
        return nbytes

    def charged(self, account) -> int:
        """The bytes this ring holds in `account` now."""
        return sum(n for a, n in self._charges if a is account)

    def _ring(self) -> PinnedRing:
        if self.ring is None:
            buffer = self.buffer
            if buffer is None:
                self._blocks = pinned.PinnedBlocks(pinned=self.locked)
                buffer = self._blocks.buffer(self.nbytes)
            event = self.event or (None if self.locked else Landed)
            self.ring = PinnedRing(len(buffer), buffer=buffer, event=event)
        return self.ring

    def copy(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`t`'s bytes into device tensor `out` (same shape and dtype), piece by piece; `out`."""
        with self._lock:
            self._pieces(self._ring(), t, out, _send)
        return out

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor | None = None, send=None) -> None:
        """dst[i] = src[i], or src[index[i]], for every slot i of the contiguous device buffer
        `dst` (slots along dim 0 of the host tensor `src`, each contiguous, the slots strided):
        as many whole slots as half the ring holds are gathered into it and sent up at once
        (`send(dst_piece, staged)`, a non-blocking copy unless given); a slot larger than half
        the ring goes up in pieces of its bytes, so the ring never grows past what it was charged."""
        count = dst.shape[0]
        if not count:
            return
        send = send or _send
        slot = dst[0].numel() * dst.element_size()
        with self._lock:
            ring = self._ring()
            step = (len(ring) // 2) // slot
            if not step:
                for i in range(count):
                    self._pieces(ring, src[i] if index is None else src[int(index[i])], dst[i], send)
                return
            for a in range(0, count, step):
                b = min(count, a + step)
                n = (b - a) * slot
                start = ring.take(n)
                staged = ring.bytes[start:start + n].view(dst.dtype).view(b - a, *dst.shape[1:])
                if index is None:
                    staged.copy_(src[a:b])
                else:
                    torch.index_select(src, 0, index[a:b], out=staged)
                send(dst[a:b], staged)
                ring.busy(start, n)  # behind the copy on the current stream (the channel's)

    @staticmethod
    def _pieces(ring: PinnedRing, t: torch.Tensor, out: torch.Tensor, send) -> None:
        src = t.contiguous().reshape(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8)
        piece = len(ring) // 2
        for a in range(0, len(src), piece):
            n = min(piece, len(src) - a)
            start = ring.take(n)
            staged = ring.bytes[start:start + n]
            staged.copy_(src[a:a + n])
            send(dst[a:a + n], staged)
            ring.busy(start, n)

    def release(self) -> None:
        """Wait for the copies still reading the ring, unlock its memory, give back its charges."""
        with self._lock:
            if self.ring is not None:
                self.ring.drain()
                self.ring = None
            if self._blocks is not None:
                self._blocks.close()
                self._blocks = None
            for account, nbytes in self._charges:
                account.free(nbytes)
            self._charges.clear()
