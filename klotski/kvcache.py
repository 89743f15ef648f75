"""Per-batch KV cache.

One `BatchKV` per batch of a group: preallocated keys/values per layer
[B, kv_heads, capacity, head_dim], a validity mask over cache slots (False = left padding)
and the number of slots filled. Sequences in a batch share slot indices; left padding
keeps every sequence's newest token in the same slot.
"""
from __future__ import annotations

import torch


class BatchKV:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device="cpu"):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.filled = 0
        self.capacity = capacity

    def begin_step(self, valid_new: torch.Tensor) -> torch.Tensor:
        """Reserve slots for this step's tokens ([B, T] validity); return the mask prefix."""
        t = valid_new.shape[1]
        if self.filled + t > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.filled}+{t} > {self.capacity} slots")
        self.valid[:, self.filled:self.filled + t] = valid_new
        return self.valid[:, :self.filled + t]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this step's k, v [B, kvh, T, D] for `layer`; return all keys/values so far."""
        end = self.filled + k.shape[2]
        self.keys[layer][:, :, self.filled:end] = k
        self.values[layer][:, :, self.filled:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def end_step(self, t: int) -> None:
        self.filled += t

    def layer_nbytes(self) -> int:
        return 2 * self.keys[0].numel() * self.keys[0].element_size()
