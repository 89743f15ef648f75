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

import functools
import math

import torch

# E2M1 values of the 16 codes (sign bit high)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MATRICES = ("gate_up", "down")  # group-local names of an expert's packed matrices
PACKED_PARTS = tuple(f"{m}_{p}" for m in MATRICES for p in ("blocks", "scales"))
# cap on one decode slab's temporaries: larger means fewer kernel launches per expert, but more
# device bytes reserved while an expert decodes (workspace_nbytes)
WORKSPACE_BYTES = 16 << 20


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., rows, cols/32, 16], scales [..., rows, cols/32] -> the weight transposed,
    [..., cols, rows] (what `x @ W` takes, as transformers lays gpt-oss experts out in memory);
    leading dimensions are experts decoded together, each bit for bit as alone. Beyond the output
    it takes at most `workspace_nbytes(rows, cols, dtype)` bytes of temporaries per expert."""
    *lead, rows, groups, width = blocks.shape
    n = math.prod(lead)
    blocks, scales = blocks.reshape(n, rows, groups, width), scales.reshape(n, rows, groups)
    table = byte_values(dtype, blocks.device)
    # scaling by an exact power of two is what transformers' ldexp does, bit for bit; in place, so
    # the float copy is the only temporary
    scale = scales.to(torch.float32, copy=True).sub_(127).exp2_().to(dtype)
    out = torch.empty(n, groups * 2 * width, rows, dtype=dtype, device=blocks.device)
    step = _chunk_groups(n * rows, groups, dtype)
    for g in range(0, groups, step):
        k = min(step, groups - g)
        # one lookup per byte gives both of its values (low nibble first); a slab of whole groups is
        # a contiguous block of rows of each expert's transposed output
        codes = blocks[:, :, g:g + k].to(torch.int32, memory_format=torch.contiguous_format)
        vals = torch.nn.functional.embedding(codes.view(n, rows, k * width), table)
        del codes
        vals = vals.view(n, rows, k, 2 * width).mul_(scale[:, :, g:g + k, None])
        out[:, g * 2 * width:(g + k) * 2 * width].copy_(vals.view(n, rows, k * 2 * width).transpose(1, 2))
        del vals
    return out.view(*lead, groups * 2 * width, rows)


@functools.cache
def byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values of every byte, built once per (dtype, device): a decode per
    expert per step must not upload it again. Built on the host and copied synchronously, so a
    decode on any stream finds it whole."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = torch.arange(256)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).to(device)


def _chunk_groups(rows: int, groups: int, dtype: torch.dtype) -> int:
    """Groups of 32 columns decoded at once: as many as keep a slab's int32 codes (2 bytes a
    weight) and values within WORKSPACE_BYTES, at least one."""
    return max(1, min(groups, WORKSPACE_BYTES // (rows * 32 * (2 + dtype.itemsize))))


def workspace_nbytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes of temporaries `dequantize` holds at once beyond its output, at most: the float
    scales while they become `dtype`, then the scales beside one slab's codes and values."""
    groups, item = cols // 32, dtype.itemsize
    slab = _chunk_groups(rows, groups, dtype) * rows * 32 * (2 + item)
    return max((4 + item) * rows * groups, rows * groups * item + slab)


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
    H, I = spec.shape.hidden_size, spec.shape.intermediate_size
    return packed, decoded + 3 * H * I * dtype.itemsize


def group_workspace_nbytes(spec, store, key, dtype: torch.dtype) -> int:
    """Device bytes of temporaries decoding expert group `key` holds beside its decoded copy while
    it runs, at most (the matrices decode one after the other): reserved for the call only."""
    refs, work = spec.group_refs(key), 0
    for m in MATRICES:
        ref = refs[f"{m}_blocks"]
        rows, groups, width = store.entries[ref.name].span(ref.index, ref.rows)[2]
        work = max(work, workspace_nbytes(rows, groups * 2 * width, dtype))
    return work


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

    def workspace_nbytes(self, key) -> int:
        return group_workspace_nbytes(self.spec, self.store, key, self.dtype)

    def read(self, key) -> dict:
        """Host tensors of an expert: packed parts as stored, biases in the compute dtype."""
        out = {}
        for name, ref in self.spec.group_refs(key).items():
            t = self.store.read(ref.name, ref.index, ref.rows)
            out[name] = t if name in PACKED_PARTS else t.to(self.dtype)
        return out

    def int4_held(self, key) -> bool:
        return False  # no CPU kernel multiplies MXFP4 blocks here

    def kept_copy(self, key) -> dict:
        """`key` decoded once, to be kept for the run (WeightCache's `kept`)."""
        return self.decode(self.read(key))

    def decode(self, parts: dict) -> dict:
        out = {n: t for n, t in parts.items() if n not in PACKED_PARTS}
        for m in MATRICES:
            out[m] = dequantize(parts[f"{m}_blocks"], parts[f"{m}_scales"], self.dtype)
        return out
