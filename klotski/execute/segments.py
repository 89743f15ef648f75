"""Shared prompt segments as the executor holds them (the scheduler finds and keeps them:
klotski/schedule/prefix.py): a segment's keys and values are a row of a cache prefilled for a
group of segments (`SegmentKV`, `SegmentGroup`); for a step, one layer's segments are read once
for the whole group of batches (on the host tier, loaded once on `kv_load`) and joined side by
side for each batch that reads them (`SharedLayer`)."""
from __future__ import annotations

import torch

from klotski.execute.kvcache import upload


class SegmentGroup:
    """The segments prefilled together, a row each of one cache: `close()` (the cache and its
    accounting group given back) runs once the last of them is released."""

    def __init__(self, close, users: int):
        self.close, self.users = close, users

    def release(self) -> None:
        self.users -= 1
        if not self.users:
            self.close()


class SegmentKV:
    """One segment's keys and values: row `row` of its group's cache `kv`, the newest `length`
    slots (left-padded beside longer ones)."""

    def __init__(self, group: SegmentGroup, kv, row: int, length: int):
        self.group, self.kv, self.row, self.length = group, kv, row, length
        self.slots = slice(kv.filled - length, kv.filled)

    @property
    def on_host(self) -> bool:
        return self.kv.on_host

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` where they live, as [kv_heads, length, dim] views."""
        return (self.kv.keys[layer][self.slots, self.row].transpose(0, 1),
                self.kv.values[layer][self.slots, self.row].transpose(0, 1))

    def nbytes(self) -> int:
        """One layer's keys and values: what a load moves."""
        k, v = self.kv.keys[self.kv.kv_layer], self.kv.values[self.kv.kv_layer]
        return self.length * (k[0, 0].numel() + v[0, 0].numel()) * k.element_size()

    def load(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A device copy of `layer`'s keys and values (host tier). On CUDA every copy reads
        page-locked memory, contiguous, and is asynchronous on the channel's stream: the slots
        themselves when the segment has its cache to itself, else its row of them gathered into
        the kv_load channel's staging ring (BatchKV.staging), never a pageable copy made on the way."""
        staging, out = self.kv.staging, []
        for src in (self.kv.keys[layer][self.slots, self.row], self.kv.values[layer][self.slots, self.row]):
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)
            if staging is None or src.is_contiguous():
                upload(dst, src)
            else:
                self.kv.landed(layer)  # the host reads the slots now: their store must have landed
                staging.gather(dst, src, send=upload)
            out.append(dst.transpose(0, 1))
        return out[0], out[1]

    def release(self) -> None:
        self.group.release()


def joined(parts: list) -> tuple:
    """Segments' (keys, values) [kv_heads, length, dim] side by side: one segment as it is."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)


class SharedLayer:
    """One layer's shared-segment keys/values for a step, by segment: `get(layout)` waits for
    a host load once (timed as bubble) and joins a batch's segments; `release()` gives the
    room back (to `memory`) after the layer's attention."""

    def __init__(self, res, memory, tensors, ticket=None, nbytes: int = 0, name: str = ""):
        self.res, self.memory = res, memory
        self.tensors, self.ticket, self.nbytes, self.name = tensors, ticket, nbytes, name

    def get(self, layout: list):
        if self.tensors is None and self.ticket is not None:
            self.tensors = self.res.wait(self.ticket, self.name)
        return joined([self.tensors[id(p)] for p in layout])

    def release(self) -> None:
        if self.ticket is not None:
            self.res.wait(self.ticket, self.name)  # no copy into the room is still running
            self.tensors, self.ticket = None, None
            self.memory.free(self.nbytes)
