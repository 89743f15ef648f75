"""Many experts in one call: a grouped matmul over experts whose weights are stacked along a
first dimension, each taking a contiguous run of rows. A layer's expert phase issues a handful
of kernels whatever the number of experts (a fine-grained model routes a step to 100+), where
one call per expert cost ~8 kernels and a Python round each.

`torch._grouped_mm` computes it where the device and dtype have it (on a CPU in fp32 and
bf16, bit for bit the per-expert products; on CUDA bf16 on Hopper and Blackwell); elsewhere, at
torch versions without it, and for fp32 on a GPU, the fallback is one product per non-empty
group (the per-expert math, exact, and the host counts say where each group's rows are). The
choice is made once per device and dtype: a call the kernel refuses marks that pair as
unsupported (running out of memory, or a device error, is raised as it is)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_SUPPORTED: dict = {}  # (device type, dtype) -> whether torch._grouped_mm runs there
_DEVICE_ERRORS = tuple(e for e in (getattr(torch, "AcceleratorError", None),) if e is not None)


@dataclass
class Groups:
    """Rows x[offsets[g-1]:offsets[g]] belong to group g (its weights w[g]): `offsets` on the
    device as int32 cumulative ends (the grouped kernel's), `counts` on the host (the fallback's
    slices) or None where they were counted on the device (a wave launched before the routing
    ids reached the host). Rows past the last offset belong to no group: their outputs are
    undefined (the caller overwrites them)."""
    counts: list[int] | None
    offsets: torch.Tensor

    def host_counts(self) -> list[int]:
        """`counts`, read from the device if only the offsets exist (a sync: only where a device
        and dtype turned out to lack the grouped kernel after a wave had been launched for it)."""
        if self.counts is None:
            self.counts = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1)).tolist()
        return self.counts

    def row_group(self, rows: int) -> torch.Tensor:
        """Each of `rows` rows' group (to gather per-group biases), found on the offsets' device
        (the number of ends at or before the row; a row past the last group takes the last): no
        upload, no sync."""
        at = torch.arange(rows, device=self.offsets.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets, at, right=True).clamp_(max=len(self.offsets) - 1)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """x [rows, K] @ w[g] [K, N] for each group's rows -> [rows, N] (gpt-oss stores [in, out])."""
    return _grouped(x, w, groups, lambda part, g: torch.mm(part, w[g]))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """F.linear per group: w [G, out, in] as a checkpoint stores linear weights."""
    return _grouped(x, w.transpose(1, 2), groups, lambda part, g: F.linear(part, w[g]))


def runs_grouped(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the grouped kernel computes for this device and dtype (as probed, or as expected
    before the first call): the offsets alone then say where each group's rows are."""
    key = (device_type, dtype)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _expected(device_type, dtype)
    return _SUPPORTED[key]


def _expected(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type != "cuda":
        return True
    # On CUDA torch's own kernel takes bf16 on compute capability 9.x and 10.x (Hopper, Blackwell;
    # torch 2.10-2.11); elsewhere its fallback copies the offsets to the host, a sync per call:
    # the per-group path here does with the host's counts. fp32 stays on the per-expert ops: a
    # grouped kernel may take TF32 or another summation order, and fp32 is where output must be
    # transformers' token for token.
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10)


def _grouped(x, w_kn, groups: Groups, per_group) -> torch.Tensor:
    """The grouped kernel where it runs; else `per_group` (the per-expert op itself, so the
    fallback is the per-expert path bit for bit) over each non-empty group."""
    key = (x.device.type, x.dtype)
    if runs_grouped(*key):
        try:
            return torch._grouped_mm(x, w_kn, offs=groups.offsets)
        except (torch.OutOfMemoryError, *_DEVICE_ERRORS):
            raise  # the device's trouble, not the kernel's: never a reason to leave it
        except (RuntimeError, NotImplementedError, TypeError):
            _SUPPORTED[key] = False
    counts = groups.host_counts()
    parts = [per_group(part, g) for g, part in enumerate(x[:sum(counts)].split(counts)) if len(part)]
    if sum(counts) < len(x):  # rows in no group: as the kernel leaves them (undefined), zeros here
        parts.append(x.new_zeros(len(x) - sum(counts), w_kn.shape[-1]))
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
