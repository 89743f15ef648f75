"""GGUF block decoding (klotski/compress/ggml.py) against the gguf package's own decoders."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from klotski.compress import ggml  # noqa: E402

# byte offsets of each type's fp16 scales inside a block (random bytes elsewhere)
F16_AT = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random valid raw blocks: random code bytes, finite fp16 scales (MXFP4: exponents in a sane range)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for at in F16_AT.get(qtype, ()):
        raw[:, at:at + 2] = rng.normal(0, 0.05, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == "MXFP4":
        raw[:, 0] = rng.integers(100, 140, size=raw.shape[0])
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_equals_gguf_dequantize(qtype):
    raw = random_blocks(qtype, rows=6, blocks_per_row=3)
    want = gguf.quants.dequantize(raw, T[qtype])
    got = ggml.dequantize(torch.from_numpy(raw), qtype, torch.float32)
    assert got.shape == want.shape
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_quantizer_round_trip(qtype):
    """Blocks written by gguf's own quantizer decode as gguf decodes them."""
    w = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[qtype])
    got = ggml.dequantize(torch.from_numpy(raw), qtype)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, T[qtype])))
    assert ggml.row_nbytes(qtype, 64) == raw.shape[1]


def test_leading_dims_and_dtype():
    raw = random_blocks("Q4_K", rows=6, blocks_per_row=1).reshape(2, 3, 144)
    got = ggml.dequantize(torch.from_numpy(raw), "Q4_K", torch.bfloat16)
    want = gguf.quants.dequantize(raw.reshape(6, 144), T.Q4_K).reshape(2, 3, 256)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.from_numpy(want).to(torch.bfloat16))


def test_non_finite_scales_counted():
    raw = random_blocks("Q6_K", rows=2, blocks_per_row=2)
    raw[1, 208 + 210:210 + 210] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert ggml.non_finite_scales(torch.from_numpy(raw), "Q6_K") == 1
    assert ggml.non_finite_scales(torch.from_numpy(random_blocks("Q6_K", 2, 2)), "Q6_K") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_cuda_decode_equals_cpu(qtype):
    """The same code on the device: bit-identical to gguf's decode, no host sync needed."""
    raw = torch.from_numpy(random_blocks(qtype, rows=64, blocks_per_row=4))
    want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw.numpy(), T[qtype])))
    got = ggml.dequantize(raw.cuda(), qtype, torch.float32)
    assert got.is_cuda and torch.equal(got.cpu(), want)
