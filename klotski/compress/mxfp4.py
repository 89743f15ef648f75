"""MXFP4 experts kept packed (gpt-oss checkpoints as OpenAI ships them).

Each expert matrix is stored out-dim major as `*_blocks` [rows, cols/32, 16] uint8 (two
4-bit E2M1 codes a byte, the low nibble first) and `*_scales` [rows, cols/32] uint8 (a
power-of-two exponent + 127 shared by 32 weights): 4.25 bits a weight, about a quarter of
bf16. Experts stay in that form in every tier and on every link; the codec below hands the
WeightCache the packed parts and decodes them on the compute device just before use, the
way the HQQ codec (klotski/compress/quantized.py) does. Decoding follows transformers' own
(`integrations/mxfp4.py`): a table lookup and a power-of-two scale, exact in fp32 and bf16.
"""
from __future__ import annotations

import torch

# E2M1 values of the 16 codes (sign bit high)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MATRICES = ("gate_up", "down")  # group-local names of an expert's packed matrices
PACKED_PARTS = tuple(f"{m}_{p}" for m in MATRICES for p in ("blocks", "scales"))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [rows, cols/32, 16], scales [rows, cols/32] -> the weight transposed, [cols, rows]
    (what `x @ W` takes, as transformers lays gpt-oss experts out in memory)."""
    rows, groups, width = blocks.shape
    # one lookup per byte gives both of its values (low nibble first); scaling by an exact power
    # of two is what transformers' ldexp does, bit for bit
    out = torch.nn.functional.embedding(blocks.reshape(rows, -1).long(), _byte_values(dtype, blocks.device))
    out = out.reshape(rows, groups, 2 * width) * torch.exp2(scales.float() - 127).to(dtype)[..., None]
    return out.reshape(rows, groups * 2 * width).t().contiguous()


def _byte_values(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values of every byte."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] weight (cols a multiple of 32) -> (blocks, scales): per 32 weights the
    smallest exponent that brings the largest into ±6, each weight to its nearest code. For
    writing test checkpoints and benchmarks; gpt-oss checkpoints ship packed."""
    rows, cols = weight.shape
    g = weight.float().reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def group_nbytes(spec, store, key, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of expert group `key` packed, as it sits in a tier and crosses a link; bytes of
    its decoded copy) in the compute dtype: blocks and scales as stored, biases in `dtype`."""
    packed = decoded = 0
    for name, ref in spec.group_refs(key).items():
        if name in PACKED_PARTS:
            packed += store.nbytes(ref.name, ref.index, ref.rows)
        else:
            shape = store.entries[ref.name].span(ref.index, ref.rows)[2]
            numel = 1
            for d in shape:
                numel *= d
            packed += numel * dtype.itemsize
            decoded += numel * dtype.itemsize
    H, I = spec.hidden_size, spec.intermediate_size
    return packed, decoded + 3 * H * I * dtype.itemsize


class Mxfp4Codec:
    """The WeightCache's codec for an MXFP4 checkpoint: experts read and moved packed, decoded
    on the device per use (the pipeline times it as compute)."""

    def __init__(self, store, spec, dtype: torch.dtype):
        self.store, self.spec, self.dtype = store, spec, dtype

    def covers(self, key) -> bool:
        return key[0] == "expert"

    def packed_nbytes(self, key) -> int:
        return group_nbytes(self.spec, self.store, key, self.dtype)[0]

    def decoded_nbytes(self, key) -> int:
        return group_nbytes(self.spec, self.store, key, self.dtype)[1]

    def read(self, key) -> dict:
        """Host tensors of an expert: packed parts as stored, biases in the compute dtype."""
        out = {}
        for name, ref in self.spec.group_refs(key).items():
            t = self.store.read(ref.name, ref.index, ref.rows)
            out[name] = t if name in PACKED_PARTS else t.to(self.dtype)
        return out

    def decode(self, parts: dict) -> dict:
        out = {n: t for n, t in parts.items() if n not in PACKED_PARTS}
        for m in MATRICES:
            out[m] = dequantize(parts[f"{m}_blocks"], parts[f"{m}_scales"], self.dtype)
        return out
