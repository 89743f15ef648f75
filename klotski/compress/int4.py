"""4-bit weights repacked once for torch's CPU int4 kernel (issue 60): the layout, the check
that this torch writes it, and HQQ 4-bit weights in it (GGUF Q4_0/Q4_K: compress/ggml.py).

On a CPU in bf16 or fp16, multiplying 4-bit codes where they lie (models/int4.py) beats
decoding a full copy per use (docs/benchmarks.md, issue 60), so 4-bit weights are read into
that form once, with the same bytes as they are stored in, so every tier, link, pool row and
the planner count the same as before: the codes, uint8 [..., N, K/2] in the layout torch's CPU
kernel reads (`pack_codes`), and the stored scale fields, from which each use builds only the
kernel's [..., K/g, N, 2] scales and zeros (1/g of the weights' count). GGUF Q4_0/Q4_K:
`ggml.GgufCodec`; HQQ 4-bit (`--quantize hqq4`): `quantized.QuantCodec`, with the functions
below. fp32 runs keep decoding per use (torch's kernel has no fast fp32 path, and fp32 is
where tokens must equal transformers'). Where torch lacks the kernel, or its layout is not
the one `pack_codes` writes (checked once on this machine), weights stay as stored and the
run says so once on stderr.
"""
from __future__ import annotations

import functools
import os
import sys

import torch

from klotski.models.int4 import product

BLOCK_N = 64  # torch's CPU layout interleaves rows in blocks of 64: row j with row j + 32, per column


@functools.cache
def available() -> bool:
    """Whether the kernel is there and `pack_codes` writes its layout (checked once, against
    torch's own converter and a dequantized product); if not, says so once."""
    why = None
    if os.environ.get("KLOTSKI_NO_INT4_KERNEL"):
        why = "KLOTSKI_NO_INT4_KERNEL is set"
    elif not all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                                         "_convert_weight_to_int4pack_for_cpu")):
        why = f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    else:
        try:
            if not _layout_agrees():
                why = "torch's int4 layout is not the one expected"
        except (RuntimeError, NotImplementedError) as e:
            why = f"torch's int4 kernel failed its check ({str(e).splitlines()[0][:120]})"
    if why:
        print(f"klotski: 4-bit weights on the CPU are decoded per use (no int4 kernel): {why}", file=sys.stderr)
    return why is None


def scales_zeros(scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's [..., K/g, N, 2] in `dtype` from per-group scales and zeros [..., N, K/g]
    (None: zeros), each written once into its column of the output (a stack, then a transposed
    copy, made three passes over it)."""
    *lead, N, groups = scale.shape
    out = torch.empty(*lead, groups, N, 2, dtype=dtype)
    out[..., 0].copy_(scale.transpose(-1, -2))
    if zero is None:
        out[..., 1].zero_()
    else:
        out[..., 1].copy_(zero.transpose(-1, -2))
    return out


def _layout_agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    for N, K in ((128, 96), (64, 256)):
        codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
        if not torch.equal(pack_codes(codes), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)):
            return False
        sz = torch.rand(K // 32, N, 2, generator=gen).bfloat16()
        x = torch.randn(3, K, generator=gen).bfloat16()
        w = (codes.float() - 8).view(N, K // 32, 32).mul(sz[..., 0].float().t()[..., None]).add(
            sz[..., 1].float().t()[..., None]).view(N, K)
        if not torch.allclose(product(x, pack_codes(codes), sz).float(), x.float() @ w.t(), rtol=2e-2, atol=0.5):
            return False
    return True


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., N, K] -> [..., N, K/2] in torch's CPU int4 layout: per block of 64
    rows, column by column, a byte of row j (low nibble) and row j + 32 (high), j < 32. A
    height that is not whole blocks goes through torch's own converter, matrix by matrix."""
    *lead, N, K = codes.shape
    if N % BLOCK_N:
        flat = codes.reshape(-1, N, K)
        out = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(m.int(), 1) for m in flat])
        return out.view(*lead, N, K // 2)
    q = codes.reshape(*lead, N // BLOCK_N, 2, BLOCK_N // 2, K)
    pair = q.select(-3, 0) | (q.select(-3, 1) << 4)  # [..., N/64, 32, K]
    return pair.transpose(-1, -2).reshape(*lead, N, K // 2).contiguous()  # (one block: reshape is a view)


# ---- HQQ 4-bit (--quantize hqq4): w = (q - z)·s per group of g weights of a row -------------
HQQ_CODES = "q@int4"  # the part that holds an HQQ weight's codes in the kernel's layout
HQQ_GROUPS = (32, 64, 128, 256)  # the group sizes torch's kernel takes


def hqq_applies(header_shape, dtype: torch.dtype) -> bool:
    """Whether an HQQ weight (its header's shape: ..., bits, gs, meta gs, rows, cols) is held as
    int4 codes for compute in `dtype` on the CPU: 4 bits, whole groups of a size the kernel
    takes, rows in sixteens (then its codes fill exactly the bytes hqq's packing does)."""
    _, bits, gs, _, rows, cols = header_shape[-6:]
    return (bits == 4 and gs in HQQ_GROUPS and cols % gs == 0 and rows % 16 == 0
            and dtype in (torch.bfloat16, torch.float16) and available())


def from_hqq(parts: dict) -> tuple[torch.Tensor, dict]:
    """One HQQ weight's parts -> (its codes in the kernel's layout, its other parts)."""
    from klotski.compress import hqq
    rest = {k: v for k, v in parts.items() if k != "q"}
    return pack_codes(hqq.codes_of(parts)), rest


def hqq_scales_zeros(rest: dict, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's [..., K/g, N, 2] from an HQQ weight's parts less its codes: s, and
    z = (8 - zero)·s, since (q - zero)·s = (q - 8)·s + (8 - zero)·s; in fp32, then `dtype`."""
    from klotski.compress import hqq
    scale, zero = hqq.scales_and_zeros_of(rest)
    return scales_zeros(scale, (8 - zero) * scale, dtype)  # (the parts may hold these very tensors)
