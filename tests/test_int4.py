"""4-bit weights multiplied in their stored form on a CPU (issue 60, item 1): GGUF Q4_0/Q4_K
and HQQ 4-bit codes repacked once for torch's int4 kernel (compress/int4.py, models/int4.py).

Each kernel's output is checked against the dequantize-then-multiply reference: the weights
decoded by ggml's decoders (the `gguf` package's arithmetic) or hqq's, multiplied in fp32.
The bound: a relative (Frobenius) error within 1.5x that of today's bf16 path (the same
weights decoded into bf16 and multiplied in bf16), and under 1e-2: the int4 kernel rounds its
scales to bf16 and accumulates in fp32, so it lands where a bf16 run already was."""
import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

import gguf_models as gm  # noqa: E402
from conftest import PROMPTS, requests  # noqa: E402
from klotski.compress import ggml, hqq, int4  # noqa: E402
from klotski.models import int4 as mm  # noqa: E402

BOUND = 1e-2


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("N,K", [(128, 64), (64, 64), (48, 96), (192, 512)])
def test_codes_packed_as_torch_packs_them(N, K):
    codes = torch.randint(0, 16, (2, N, K), dtype=torch.uint8, generator=torch.Generator().manual_seed(N))
    want = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.int(), 1) for c in codes])
    assert torch.equal(int4.pack_codes(codes), want)
    assert int4.pack_codes(codes[0]).is_contiguous()  # what the kernel requires


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("N,K", [(256, 512), (64, 768)])
def test_gguf_product_agrees_with_dequantize_then_multiply(qtype, N, K):
    rng = np.random.default_rng(N + K)
    raw, _ = gm.expert_blocks(qtype, rng.normal(0, 0.02, (N, K)), rng)
    raw = torch.from_numpy(np.ascontiguousarray(raw))
    codes, meta = ggml.int4_from_blocks(raw, qtype)
    assert codes.numel() + meta.numel() * meta.element_size() == raw.numel()  # the blocks' bytes, split
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    ref = x @ ggml.dequantize(raw, qtype, torch.float32).t()
    today = x.bfloat16() @ ggml.dequantize(raw, qtype, torch.bfloat16).t()
    got = mm.product(x.bfloat16(), codes, ggml.int4_scales_zeros(meta, qtype, torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert rel(got, ref) < min(BOUND, 1.5 * rel(today, ref))
    # a leading expert dimension decodes each expert as alone
    two = ggml.int4_scales_zeros(torch.stack([meta, meta]), qtype, torch.bfloat16)
    assert torch.equal(two[1], ggml.int4_scales_zeros(meta, qtype, torch.bfloat16))


def test_hqq_product_agrees_with_dequantize_then_multiply():
    w = torch.randn(256, 576, generator=torch.Generator().manual_seed(2)) * 0.02
    parts = hqq.quantize_tensor(w)
    assert int4.hqq_applies(parts["header"].shape, torch.bfloat16)
    codes, rest = int4.from_hqq(parts)
    assert codes.numel() == parts["q"].numel()  # the same bytes as hqq's packing
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(3))
    ref = x @ hqq.dequantize_tensor(parts, torch.float32).t()
    today = x.bfloat16() @ hqq.dequantize_tensor(parts, torch.bfloat16).t()
    got = mm.product(x.bfloat16(), codes, int4.hqq_scales_zeros(rest, torch.bfloat16))
    assert rel(got, ref) < min(BOUND, 1.5 * rel(today, ref))


def test_fp32_keeps_the_blocks():
    """fp32 must stay token-identical to transformers: its experts are decoded per use as before."""
    assert not ggml.int4_applies("Q4_0", torch.float32, 256)
    assert not ggml.int4_applies("Q8_0", torch.bfloat16, 256) and ggml.int4_applies("Q4_K", torch.bfloat16, 256)


def run(path, **placement):
    """Greedy tokens in bf16 with every group on the device, or as `placement` says (a given
    placement and batch shape: no plan, so no profile to measure)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    ckpt = Checkpoint.open(str(path))
    keys = ckpt.spec.group_keys()
    ckpt.close()
    cfg = RunConfig(model=str(path), progress=False, dtype="bfloat16", batch_size=3, num_batches=2)
    engine, seqs, errors = open_engine(cfg, requests(PROMPTS, 8), placement=Placement.by_kind(keys, **placement))
    assert not errors
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine


def test_q4_0_experts_computed_as_int4_codes_in_bf16(tmp_path):
    """A Q4_0 GGUF model in bf16 on the CPU: experts read into the int4 form (same bytes as their
    blocks, so the planner's sizes hold), computed resident and streamed through the pool alike.
    (Greedy agreement with the blocks decoded per use: benchmarks/int4_agreement.py.)"""
    path = gm.write(tmp_path / "m.gguf", "Q4_0", gm.QWEN3)
    ours, engine = run(path)
    parts = engine.cache.codec.read(("expert", 1, 2))
    assert set(parts) == {f"{w}.Q4_0{s}" for w in ("w1", "w2", "w3") for s in (ggml.CODES, ggml.META)}
    streamed, moving = run(path, expert="host")
    assert moving.pipeline.experts_loaded > 0
    assert streamed == ours  # the same kernel over the same codes, wherever they were held
