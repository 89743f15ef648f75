"""ExpertPool: one set of device slots that every transferred expert lands in, made once.

Per weight name one device tensor [S, ...] (an expert's `name` is row `slot` of it), a free
list, and which expert sits in which slot. Its S experts' bytes are reserved in the device
`Memory` once, when it is made, and held for the run: an expert landing or leaving moves no
device byte and changes no account, only the free list. So a wave computes every landed
expert of a layer in one grouped call over the pool's tensors (rows in slot order), and the
addresses the copies write and the kernels read never change.

A slot is reused by the next copy only after whoever used it last is past it: on CUDA the
copy waits for the fences the slot collected (an event recorded on the compute stream when
the expert was released, or the discarded copy that was still landing there). On a CPU the
compute is on the scheduling thread and a discarded copy has run by the time it is dropped:
no fences."""
from __future__ import annotations

import heapq
from concurrent.futures import Future

import torch


class ExpertPool:
    def __init__(self, slots: int, like: dict, nbytes: int, device, *, event=None):
        """`slots` experts shaped and typed as `like` (one expert's tensors), `nbytes` each;
        `event` makes a fence (a CUDA event factory; None: no fences, a CPU device)."""
        self.slots, self.expert_nbytes = slots, nbytes
        self.tensors = {n: torch.empty((slots, *t.shape), dtype=t.dtype, device=device) for n, t in like.items()}
        self.tensors_device = torch.device(device)
        # a heap: a run takes the lowest free slots in turn, so experts submitted in id order sit
        # in slot order and a wave's pairs are often one run of the sort (views, no gather)
        self._free = list(range(slots))
        self.slot: dict = {}   # key -> its slot
        self.fences: dict = {}  # slot -> what its next copy must follow
        self.event = event

    @property
    def nbytes(self) -> int:
        return self.slots * self.expert_nbytes

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

    def rows(self, experts: dict) -> list:
        """Slot order: row s is the expert id of the key in slot s among `experts` (key -> id), -1
        elsewhere (an empty group in a wave)."""
        out = [-1] * self.slots
        for key, e in experts.items():
            out[self.slot[key]] = e
        return out


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
