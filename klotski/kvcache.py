"""Per-batch KV cache, on the device or offloaded to host.

One `BatchKV` per batch of a group: keys/values per layer [B, kv_heads, capacity, head_dim],
a validity mask over cache slots (False = left padding) and the number of slots filled.
Sequences in a batch share slot indices; left padding keeps every sequence's newest token
in the same slot.

On the device tier attention writes straight into the cache. On the host tier the
pipeline asks for `load(layer)` (on `kv_load`: a device buffer holding the prefix plus room
for this step) ahead of the batch's attention, and `store(layer, buf)` (on `kv_store`:
only this step's new slots go back) after it.
"""
from __future__ import annotations

import torch


class BatchKV:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, *, device="cpu", on_host: bool = False, pin=lambda t: t):
        shape = (batch, kv_heads, capacity, head_dim)
        home = "cpu" if on_host else device
        self.keys = [pin(torch.zeros(shape, dtype=dtype, device=home)) for _ in range(num_layers)]
        self.values = [pin(torch.zeros(shape, dtype=dtype, device=home)) for _ in range(num_layers)]
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.on_host = on_host
        self.filled = 0
        self.new = 0
        self.capacity = capacity

    def begin_step(self, valid_new: torch.Tensor, sink: int | None = None, recent: int | None = None):
        """Reserve slots for this step's tokens ([B, T] validity); return the validity of
        every slot so far. With StreamingLLM-style sparsity (`sink` first tokens and the
        `recent` last ones of each sequence) only old slots some sequence can still see are
        loaded from the host: `self.old_slots`."""
        t = valid_new.shape[1]
        if self.filled + t > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.filled}+{t} > {self.capacity} slots")
        self.valid[:, self.filled:self.filled + t] = valid_new
        self.new = t
        self.old_slots = None
        if recent is not None:
            old = self.valid[:, :self.filled]
            rank = old.long().cumsum(-1) - 1
            last_query = self.filled + t - 1
            keep = old & ((rank < sink) | (torch.arange(self.filled, device=old.device) > last_query - recent))
            self.old_slots = torch.nonzero(keep.any(0)).flatten()
        return self.valid[:, :self.filled + t]

    def step_columns(self) -> torch.Tensor | None:
        """Cache slots this step attends over, in buffer order (None = all of them)."""
        if self.old_slots is None:
            return None
        return torch.cat([self.old_slots, torch.arange(self.filled, self.filled + self.new,
                                                         device=self.old_slots.device)])

    def _old_count(self) -> int:
        return self.filled if self.old_slots is None else len(self.old_slots)

    def end_step(self) -> None:
        self.filled += self.new
        self.new = 0

    # ---- device-resident use ------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, buf=None):
        """Store this step's k, v [B, kvh, T, D]; return every key/value attended over. `buf` is
        the (keys, values, offset) device buffer from `load` when the cache lives on the host."""
        if buf is None:
            keys, values, offset = self.keys[layer], self.values[layer], self.filled
        else:
            keys, values, offset = buf
        end = offset + k.shape[2]
        keys[:, :, offset:end] = k
        values[:, :, offset:end] = v
        if buf is None and self.old_slots is not None:
            cols = self.step_columns()
            return keys.index_select(2, cols), values.index_select(2, cols)
        return keys[:, :, :end], values[:, :, :end]

    # ---- host-tier moves (run on channels) ----------------------------------------------
    def _bytes(self, slots: int) -> int:
        k = self.keys[0]
        return 2 * k.shape[0] * k.shape[1] * slots * k.shape[3] * k.element_size()

    def step_nbytes(self) -> int:
        """Device bytes of one layer's loaded buffer for this step."""
        return self._bytes(self._old_count() + self.new)

    def prefix_nbytes(self) -> int:
        """Bytes a load moves: the old slots this step can see."""
        return self._bytes(self._old_count())

    def new_nbytes(self) -> int:
        return self._bytes(self.new)

    def nbytes(self) -> int:
        """The whole cache of this batch, every layer, at full capacity."""
        return 2 * len(self.keys) * self.keys[0].numel() * self.keys[0].element_size()

    def load(self, layer: int, device):
        """Device buffer with the visible old slots of `layer`, and room for this step's tokens.
        `copy_` with non_blocking works for both a CPU working set and a CUDA stream."""
        old = self._old_count()
        k, v = self.keys[layer], self.values[layer]
        keys = torch.empty(k.shape[0], k.shape[1], old + self.new, k.shape[3], dtype=k.dtype, device=device)
        values = torch.empty_like(keys)
        if self.old_slots is None:
            keys[:, :, :old].copy_(k[:, :, :old], non_blocking=True)
            values[:, :, :old].copy_(v[:, :, :old], non_blocking=True)
        else:
            slots = self.old_slots.to(k.device)
            keys[:, :, :old].copy_(k.index_select(2, slots), non_blocking=True)
            values[:, :, :old].copy_(v.index_select(2, slots), non_blocking=True)
        return keys, values, old

    def store(self, layer: int, buf) -> None:
        """Copy this step's new slots of `layer` from the device buffer back home."""
        keys, values, offset = buf
        new, src = slice(self.filled, self.filled + self.new), slice(offset, offset + self.new)
        self.keys[layer][:, :, new].copy_(keys[:, :, src], non_blocking=True)
        self.values[layer][:, :, new].copy_(values[:, :, src], non_blocking=True)
