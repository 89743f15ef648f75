"""Many experts in one call: a grouped matmul over experts whose weights are stacked along a
first dimension, each taking a contiguous run of rows. A layer's expert phase issues a handful
of kernels whatever the number of experts (a fine-grained model routes a step to 100+), where
one call per expert cost ~8 kernels and a Python round each.

`torch._grouped_mm` computes it where the device and dtype have it (on a CPU in fp32 and
bf16, bit for bit the per-expert products; on CUDA 16-bit on Hopper and later); elsewhere, at
torch versions without it, and for fp32 on a GPU, the fallback is one product per non-empty
group (the per-expert math, exact, and the host counts say where each group's rows are). The
choice is probed once per device and dtype: a call that raises marks that pair as unsupported."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_SUPPORTED: dict = {}  # (device type, dtype) -> whether torch._grouped_mm runs there


@dataclass
class Groups:
    """Rows x[offsets[g-1]:offsets[g]] belong to group g (its weights w[g]): `counts` on the
    host (the fallback's slices), `offsets` on the device as int32 cumulative ends (the grouped
    kernel's)."""
    counts: list[int]
    offsets: torch.Tensor

    def row_group(self) -> torch.Tensor:
        """Each row's group [rows] (to gather per-group biases), made on the offsets' device from
        them: no upload, and the row count given, so no sync."""
        sizes = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))
        return torch.repeat_interleave(torch.arange(len(self.counts), device=self.offsets.device), sizes,
                                       output_size=sum(self.counts))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """x [rows, K] @ w[g] [K, N] for each group's rows -> [rows, N] (gpt-oss stores [in, out])."""
    return _grouped(x, w, groups, lambda part, g: torch.mm(part, w[g]))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """F.linear per group: w [G, out, in] as a checkpoint stores linear weights."""
    return _grouped(x, w.transpose(1, 2), groups, lambda part, g: F.linear(part, w[g]))


def _grouped(x, w_kn, groups: Groups, per_group) -> torch.Tensor:
    """The grouped kernel where it runs; else `per_group` (the per-expert op itself, so the
    fallback is the per-expert path bit for bit) over each non-empty group."""
    key = (x.device.type, x.dtype)
    # fp32 on a GPU stays on the per-expert ops: a grouped kernel there may take TF32 or another
    # summation order, and fp32 is where output must be transformers' token for token
    if _SUPPORTED.get(key, hasattr(torch, "_grouped_mm") and not (x.is_cuda and x.dtype == torch.float32)):
        try:
            out = torch._grouped_mm(x, w_kn, offs=groups.offsets)
            _SUPPORTED[key] = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            _SUPPORTED[key] = False
    parts = [per_group(part, g) for g, part in enumerate(x.split(groups.counts)) if len(part)]
    if not parts:
        return x.new_empty(0, w_kn.shape[-1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def force_fallback(device_type: str, dtype: torch.dtype, fallback: bool = True) -> None:
    """Use the per-group fallback (True) or probe the grouped kernel again (False), for tests."""
    if fallback:
        _SUPPORTED[(device_type, dtype)] = False
    else:
        _SUPPORTED.pop((device_type, dtype), None)


def grouped_swiglu(x: torch.Tensor, w: dict, groups: Groups) -> torch.Tensor:
    """SwiGLU experts (layers.swiglu) over their groups of rows: w2(silu(w1 x) * w3 x)."""
    return grouped_linear(F.silu(grouped_linear(x, w["w1"], groups)) * grouped_linear(x, w["w3"], groups),
                          w["w2"], groups)
