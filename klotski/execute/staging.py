"""Page-locked staging: the rings host data crosses a CUDA link through (execute/channels.py's
discipline, rule 4: bytes reused only once the copy that last read them is done).

- `PinnedRing`: page-locked bytes taken in turn, each span busy until its copy's event completes.
- `StagedCopies`: a channel's ring for what is pageable or strided (disk reads, host compute's
  results, a host KV cache's slots), gathered into the ring and sent up from there.
- `SmallUploads` / `HostReads`: a step's small uploads (ids, positions, masks) and the small
  reads back (routing ids), each through a ring of its own, charged to the host budget by the
  composition root and never grown: an oversize one is a plain blocking copy.

On a CPU "device" none of this runs: copies there are plain memory copies (channels.py).
"""
from __future__ import annotations

import threading
from collections import deque

import torch

from placement import pinned
from planner.workingset import STAGED_RING_BYTES, STEP_RING_BYTES


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
