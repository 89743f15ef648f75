"""Weights multiplied in their 4-bit form on a CPU (issue 60): torch's weight-only int4 kernel.

A weight `name` of a group dict is in this form when the dict also holds `name + SCALES`:
then `w[name]` is its codes, uint8 [..., N, K/2] in the layout torch's CPU kernel reads
(`_convert_weight_to_int4pack_for_cpu`), and `w[name + SCALES]` is [..., K/g, N, 2]: per group
of g weights of a row, a scale s and a zero z in the activation's dtype, each weight being
(q - 8)·s + z. Leading dimensions are experts stacked, as for dense weights. Where a weight is
dense, every function here is F.linear. compress/int4.py builds the form from GGUF blocks and
HQQ codes; this module only multiplies, so the families' math reads one dict either way.
"""
from __future__ import annotations

import torch

from klotski.models import prepacked

SCALES = ".int4_scales_zeros"


def held(w: dict, name: str) -> bool:
    """Whether weight `name` of `w` is held as int4 codes."""
    return name + SCALES in w


def product(x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., K] times one weight held as int4 codes [N, K/2] -> [..., N] in x's dtype."""
    K = codes.shape[-1] * 2
    group = K // scales_zeros.shape[-3]
    rows = x.reshape(-1, K)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, group, scales_zeros)
    return y.view(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, w: dict, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w[name], bias), whichever form w[name] is held in."""
    scales_zeros = w.get(name + SCALES)
    if scales_zeros is None:  # plain, or reordered for oneDNN (models/prepacked.py)
        return prepacked.linear(x, w[name], bias)
    y = product(x, w[name], scales_zeros)
    return y if bias is None else y + bias
