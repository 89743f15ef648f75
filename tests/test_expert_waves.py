"""Expert waves (issue 45): many experts in one grouped call over stacked weights, the same
numbers as one call per expert; transferred experts landing stacked; every family through it."""
import pytest
import torch

from klotski.models import grouped as G
from klotski.models import gpt_oss
from klotski.models import layers as L


def _case(dtype, experts=6, hidden=64, inter=96, counts=(5, 0, 9, 1, 0, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    w = {"w1": torch.randn(experts, inter, hidden, generator=g).to(dtype) * 0.2,
         "w3": torch.randn(experts, inter, hidden, generator=g).to(dtype) * 0.2,
         "w2": torch.randn(experts, hidden, inter, generator=g).to(dtype) * 0.2}
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, G.Groups(list(counts), offsets)


def _per_expert(ffn, x, w, groups):
    parts = [ffn(p, {n: t[g] for n, t in w.items()}) for g, p in enumerate(x.split(groups.counts)) if len(p)]
    return torch.cat(parts)


@pytest.fixture(params=["kernel", "fallback"])
def path(request):
    """The grouped kernel where torch has it, and the per-group fallback, forced."""
    if request.param == "kernel" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    for dtype in (torch.float32, torch.bfloat16):
        G.force_fallback("cpu", dtype, request.param == "fallback")
    yield request.param
    for dtype in (torch.float32, torch.bfloat16):
        G.force_fallback("cpu", dtype, False)


def test_grouped_swiglu_is_each_experts_swiglu_bit_for_bit(path):
    x, w, groups = _case(torch.float32)
    assert torch.equal(G.grouped_swiglu(x, w, groups), _per_expert(L.swiglu, x, w, groups))


def test_grouped_gpt_oss_experts_are_each_experts_bit_for_bit(path):
    """The clamped activation and per-expert biases (gathered per row), gpt-oss's [in, out] layout."""
    g = torch.Generator().manual_seed(1)
    counts, E, H, I = [4, 0, 7, 2], 4, 32, 48
    x = torch.randn(sum(counts), H, generator=g)
    w = {"gate_up": torch.randn(E, H, 2 * I, generator=g) * 0.3, "gate_up_bias": torch.randn(E, 2 * I, generator=g),
         "down": torch.randn(E, I, H, generator=g) * 0.3, "down_bias": torch.randn(E, H, generator=g)}
    groups = G.Groups(counts, torch.tensor(counts).cumsum(0).to(torch.int32))
    ours = gpt_oss.grouped_clamped_swiglu(x, w, groups, alpha=1.702, limit=2.0)
    assert torch.equal(ours, _per_expert(lambda p, e: gpt_oss.clamped_swiglu(p, e, alpha=1.702, limit=2.0), x, w, groups))


def test_bf16_grouped_agrees_with_per_expert(path):
    """The 16-bit kernel, which the fp32 identity tests never run: within one bf16 rounding of the
    output's scale (on this CPU it is bit for bit; a GPU's kernel may order the sums otherwise)."""
    x, w, groups = _case(torch.bfloat16)
    ours, ref = G.grouped_swiglu(x, w, groups).float(), _per_expert(L.swiglu, x, w, groups).float()
    assert (ours - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_streamed_experts_land_stacked_and_tokens_match_transformers(tmp_path):
    """Every expert streamed from host memory through a small device budget: runs of them move in
    one submission each and compute in waves over their stacks, token for token transformers."""
    from klotski.builtin.families import build_family
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    from tests.conftest import engine_tokens, reference_tokens
    model = build_family(tmp_path / "qwen3", "qwen3_moe")
    keys = Checkpoint.open(str(model)).spec.group_keys()
    placement = Placement.by_kind(keys, expert="host")
    ours, engine = engine_tokens(model, placement=placement, batch_size=3, num_batches=2, device_memory=3 << 20)
    assert ours == reference_tokens(model)
    assert engine.cache.experts_landed_stacked > 0
    assert engine.memory.peak <= 3 << 20
