"""ExpertPool: one set of device slots that every transferred expert lands in, made once; and
Landing, its overflow (a run stacked in memory of its own while every slot is taken).

Per weight name one device tensor [S, ...] (an expert's `name` is row `slot` of it), a free
list, and which expert sits in which slot. Its S experts' bytes are reserved in the device
`Memory` once, when it is made, and held for the run: an expert landing or leaving moves no
device byte and changes no account, only the free list. So a wave computes every landed
expert of a layer in one grouped call over the pool's tensors (rows in slot order), and the
addresses the copies write and the kernels read never change.

Packed experts (HQQ, MXFP4, GGUF blocks) have a second row per slot, `packed`, that their copy
lands in; the slot itself holds the expert decoded (the compute dtype's shapes), so waves
compute them like 16-bit ones. A run moved together is decoded in codec calls over contiguous
slots (`segments`), at most `decode_rows` experts a call, whose decoded copies and temporaries
the pool's `workspace` bytes hold.

A slot is reused by the next copy only after whoever used it last is past it: on CUDA the
copy waits for the fences the slot collected (an event recorded on the compute stream when
the expert was released, or the discarded copy that was still landing there). On a CPU the
compute is on the scheduling thread and a discarded copy has run by the time it is dropped:
no fences."""
from __future__ import annotations

import heapq
import math
from concurrent.futures import Future

import torch


class ExpertPool:
    def __init__(self, slots: int, like: dict, nbytes: int, device, *, event=None, packed: dict | None = None,
                 workspace: int = 0, decode_rows: int = 0):
        """`slots` experts shaped and typed as `like` (one expert's tensors), `nbytes` each;
        `event` makes a fence (a CUDA event factory; None: no fences, a CPU device). Packed
        experts: `packed` is one expert's packed parts or their FlatLayout (a row per slot,
        counted in `nbytes`), `workspace` the bytes kept for decoding, `decode_rows` experts a decode call."""
        self.slots, self.expert_nbytes, self.workspace, self.decode_rows = slots, nbytes, workspace, decode_rows
        self.tensors = {n: torch.empty((slots, *t.shape), dtype=t.dtype, device=device) for n, t in like.items()}
        # a packed expert's row: one row of bytes its parts are views of (a FlatLayout: it lands in
        # one copy), or a row per part
        self.flat, self.layout = None, packed if isinstance(packed, FlatLayout) else None
        if self.layout is not None:
            self.flat = torch.empty((slots, packed.nbytes), dtype=torch.uint8, device=device)
            self.packed = packed.views(self.flat)
        else:
            self.packed = {n: torch.empty((slots, *t.shape), dtype=t.dtype, device=device)
                           for n, t in (packed or {}).items()}
        self.tensors_device = torch.device(device)
        # a heap: a run takes the lowest free slots in turn, so experts submitted in id order sit
        # in slot order and a wave's pairs are often one run of the sort (views, no gather)
        self._free = list(range(slots))
        self.slot: dict = {}   # key -> its slot
        self.fences: dict = {}  # slot -> what its next copy must follow
        self.event = event

    @property
    def nbytes(self) -> int:
        return self.slots * self.expert_nbytes + self.workspace

    def free(self) -> int:
        return len(self._free)

    def take(self, key) -> int:
        """A free slot for `key` (the caller checked `free()`)."""
        s = heapq.heappop(self._free)
        self.slot[key] = s
        return s

    def after(self, slots) -> list:
        """The fences copies into `slots` must follow (taken: a slot's are waited for once)."""
        return list({id(f): f for s in slots for f in self.fences.pop(s, ())}.values())

    def fence(self):
        """One event on the compute stream, recorded now, that experts released together share
        (a wave's), or None on a CPU."""
        return Fence(self.event) if self.event is not None else None

    def give(self, key, fence=None) -> None:
        """`key` leaves its slot; the next copy into it waits for `fence`: the copy of `key`
        dropped unused (on CUDA it may still be writing the slot), or an event recorded after
        the compute that read it (`fence()`, shared by a wave; made here if none is given)."""
        s = self.slot.pop(key)
        if self.event is not None:
            self.fences.setdefault(s, []).append(fence if fence is not None else Fence(self.event))
        heapq.heappush(self._free, s)

    def view(self, key) -> dict:
        """`key`'s tensors: views of its row of the pool."""
        s = self.slot[key]
        return {n: t[s] for n, t in self.tensors.items()}

    def segments(self, slots) -> list:
        """`slots` as (first, end) ranges of adjacent slots, at most `decode_rows` long: what one
        decode call takes (views of the packed and decoded rows, no gather)."""
        out = []
        for s in sorted(slots):
            if out and out[-1][1] == s and s - out[-1][0] < self.decode_rows:
                out[-1][1] = s + 1
            else:
                out.append([s, s + 1])
        return [tuple(r) for r in out]

    def rows(self, experts: dict) -> list:
        """Slot order: row s is the expert id of the key in slot s among `experts` (key -> id), -1
        elsewhere (an empty group in a wave)."""
        out = [-1] * self.slots
        for key, e in experts.items():
            out[self.slot[key]] = e
        return out


class FlatLayout:
    """One packed expert's parts end to end in one row of bytes, so that it moves in one copy
    (host tier -> a pool slot's packed row) however many parts its codec has (HQQ: 24). The
    widest elements come first: every part starts at a multiple of its element size, with no
    padding, and the row is as long as the parts' bytes (what the accounts and the planner
    count). Rows stacked [n, nbytes] give each part stacked, [n, *shape], as views."""

    def __init__(self, parts: dict):
        self.parts, at = {}, 0
        for name, t in sorted(parts.items(), key=lambda kv: -kv[1].element_size()):
            self.parts[name] = (at, t.dtype, tuple(t.shape))
            at += t.numel() * t.element_size()
        self.nbytes, self.widest = at, max(t.element_size() for t in parts.values())

    @classmethod
    def of(cls, parts: dict) -> "FlatLayout | None":
        """The layout of `parts`, or None where stacked rows would misalign a part (the bytes
        not a multiple of the widest element)."""
        layout = cls(parts)
        return layout if layout.nbytes % layout.widest == 0 else None

    def __eq__(self, other) -> bool:
        return isinstance(other, FlatLayout) and self.parts == other.parts

    def views(self, flat: torch.Tensor) -> dict:
        """The parts of `flat` ([..., nbytes] bytes), as views with the same leading dimensions."""
        out = {}
        for name, (at, dtype, shape) in self.parts.items():
            end = at + math.prod(shape) * dtype.itemsize
            out[name] = flat[..., at:end].view(dtype).unflatten(-1, shape)
        return out

    def flatten(self, parts: dict) -> torch.Tensor:
        """A new row of bytes holding `parts`."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        for name, view in self.views(flat).items():
            view.copy_(parts[name])
        return flat


class Fence:
    """An event recorded on the current (compute) stream: what a channel's `after` takes as a
    ticket already issued (its future done), waited for on the device, never by the host."""

    def __init__(self, event):
        self.event = event()
        self.event.record()
        self.future = Future()
        self.future.set_result(None)

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class Landing:
    """Experts of one layer moved in one submission into stacked tensors of their own (`stacks`,
    one per weight name, row i = keys[i]) while the pool is full and the device has room beside
    it (a decode step's activations are far below the prefill's the pool was sized beside).
    Its bytes are one reservation, freed when the last member leaves."""

    def __init__(self, keys: list, nbytes: int):
        self.keys, self.nbytes, self.live = keys, nbytes, len(keys)
        self.row = {k: i for i, k in enumerate(keys)}
        self.stacks: dict | None = None
        self.decoded = False  # packed stacks are replaced by their decoded ones on first use

    def row_ticket(self, ticket, row: int) -> "_RowTicket":
        return _RowTicket(self, ticket, row)

    def leave(self) -> bool:
        """One member released; True when it was the last."""
        self.live -= 1
        return self.live == 0


class _RowTicket:
    """A Landing member's view of the one transfer: done with it, the stacks set when waited for."""

    def __init__(self, landing: Landing, ticket, row: int):
        self.landing, self.ticket, self.row = landing, ticket, row

    def done(self) -> bool:
        return self.ticket.done()

    def wait(self) -> None:
        stacks = self.ticket.wait()
        if self.landing.stacks is None:  # a later member's wait must not undo their decode
            self.landing.stacks = stacks

    def discard(self) -> None:
        self.ticket.discard()

    def promote(self) -> None:
        self.ticket.promote()
