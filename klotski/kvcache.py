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

    def begin_step(self, valid_new: torch.Tensor) -> torch.Tensor:
        """Reserve slots for this step's tokens ([B, T] validity); return the mask prefix."""
        t = valid_new.shape[1]
        if self.filled + t > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.filled}+{t} > {self.capacity} slots")
        self.valid[:, self.filled:self.filled + t] = valid_new
        self.new = t
        return self.valid[:, :self.filled + t]

    def end_step(self) -> None:
        self.filled += self.new
        self.new = 0

    # ---- device-resident use ------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, buf=None):
        """Store this step's k, v [B, kvh, T, D]; return all keys/values so far. `buf` is the
        (keys, values) device buffer from `load` when the cache lives on the host."""
        keys, values = buf if buf is not None else (self.keys[layer], self.values[layer])
        end = self.filled + k.shape[2]
        keys[:, :, self.filled:end] = k
        values[:, :, self.filled:end] = v
        return keys[:, :, :end], values[:, :, :end]

    # ---- host-tier moves (run on channels) ----------------------------------------------
    def step_nbytes(self) -> int:
        """Device bytes of one layer's loaded buffer for this step."""
        k = self.keys[0]
        return 2 * k.shape[0] * k.shape[1] * (self.filled + self.new) * k.shape[3] * k.element_size()

    def nbytes(self) -> int:
        """The whole cache of this batch, every layer, at full capacity."""
        return 2 * len(self.keys) * self.keys[0].numel() * self.keys[0].element_size()

    def prefix_nbytes(self) -> int:
        k = self.keys[0]
        return 2 * k.shape[0] * k.shape[1] * self.filled * k.shape[3] * k.element_size()

    def new_nbytes(self) -> int:
        k = self.keys[0]
        return 2 * k.shape[0] * k.shape[1] * self.new * k.shape[3] * k.element_size()

    def load(self, layer: int, device):
        """Device buffer with the filled prefix of `layer`, sized for this step's new tokens.
        `copy_` with non_blocking works for both a CPU working set and a CUDA stream."""
        end = self.filled + self.new
        k, v = self.keys[layer], self.values[layer]
        keys = torch.empty(k.shape[0], k.shape[1], end, k.shape[3], dtype=k.dtype, device=device)
        values = torch.empty_like(keys)
        keys[:, :, :self.filled].copy_(k[:, :, :self.filled], non_blocking=True)
        values[:, :, :self.filled].copy_(v[:, :, :self.filled], non_blocking=True)
        return keys, values

    def store(self, layer: int, buf) -> None:
        """Copy this step's new slots of `layer` from the device buffer back home."""
        keys, values = buf
        new = slice(self.filled, self.filled + self.new)
        self.keys[layer][:, :, new].copy_(keys[:, :, new], non_blocking=True)
        self.values[layer][:, :, new].copy_(values[:, :, new], non_blocking=True)
