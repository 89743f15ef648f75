"""Packed experts (HQQ 4-bit, MXFP4, GGUF blocks) moved to the device land in the expert pool:
a run in one submission, each expert's parts one row of bytes (one copy), decoded into their
slots in codec calls over adjacent slots, computed in the grouped wave like 16-bit experts.
The codecs decode a leading expert dimension bit for bit as each expert alone; the tokens are
those of the per-expert path (each expert decoded into a copy of its own) and transformers'."""
import pytest
import torch

from klotski.compress import hqq, mxfp4
from placement.pool import FlatLayout


@pytest.mark.parametrize("spec", [hqq.QuantSpec(), hqq.QuantSpec(bits=3), hqq.QuantSpec(bits=2, group_size=32),
                                  hqq.QuantSpec(bits=8, meta_group_size=None)], ids=lambda s: s.tag())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hqq_decodes_stacked_experts_each_as_alone(spec, dtype):
    """Rows of odd lengths (padded groups) and every packing: one call over five experts
    stacked gives each expert's weight bit for bit."""
    torch.manual_seed(0)
    parts = [hqq.quantize_tensor(torch.randn(40, 200, dtype=dtype) * 0.02, spec) for _ in range(5)]
    stacked = hqq.dequantize_tensor({n: torch.stack([p[n] for p in parts]) for n in parts[0]})
    assert stacked.shape == (5, 40, 200) and stacked.is_contiguous()
    for i, p in enumerate(parts):
        assert torch.equal(stacked[i], hqq.dequantize_tensor(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slab", [None, 1])
def test_mxfp4_decodes_stacked_experts_each_as_alone(monkeypatch, dtype, slab):
    """Whole matrices at once, and one group of 32 columns a slab: each expert bit for bit."""
    if slab is not None:
        monkeypatch.setattr(mxfp4, "WORKSPACE_BYTES", 1)
    torch.manual_seed(0)
    packed = [mxfp4.quantize(torch.randn(24, 96)) for _ in range(3)]
    stacked = mxfp4.dequantize(torch.stack([b for b, _ in packed]), torch.stack([s for _, s in packed]), dtype)
    assert stacked.shape == (3, 96, 24)
    for i, (blocks, scales) in enumerate(packed):
        assert torch.equal(stacked[i], mxfp4.dequantize(blocks, scales, dtype))


def test_gguf_gpt_oss_experts_join_stacked_as_alone():
    from klotski.models.gpt_oss import join_gguf_expert
    torch.manual_seed(0)
    shapes = {"gate": (6, 8), "up": (6, 8), "down": (8, 6), "gate_bias": (6,), "up_bias": (6,), "down_bias": (8,)}
    experts = [{n: torch.randn(s) for n, s in shapes.items()} for _ in range(3)]
    stacked = join_gguf_expert({n: torch.stack([w[n] for w in experts]) for n in shapes})
    for i, w in enumerate(experts):
        for n, t in join_gguf_expert(w).items():
            assert torch.equal(stacked[n][i], t) and stacked[n][i].stride() == t.stride()


def test_a_flat_row_holds_every_part_at_its_own_alignment():
    """An HQQ expert's 8 parts a matrix in one row of bytes as long as the parts (no padding),
    rows stacked give each part stacked; a layout that would misalign a part is refused."""
    parts = hqq.quantize_group({"w1": torch.randn(32, 64), "w2": torch.randn(64, 32)})
    layout = FlatLayout.of(parts)
    assert layout.nbytes == hqq.packed_nbytes(parts)
    rows = torch.stack([layout.flatten(parts), layout.flatten(parts)])
    for n, view in layout.views(rows).items():
        assert view.shape == (2, *parts[n].shape) and torch.equal(view[1], parts[n])
    assert FlatLayout.of({"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(1)}) is None


def test_the_pools_size_counts_packed_rows_and_a_decode_workspace():
    """Hand-worked: 100 bytes free besides the working set's 10 of activations; slots of 8
    (decoded 6 + packed 2), one expert's decode 7 (decoded + temporaries), the workspace capped
    at 64 MiB: 4 slots take 32 + 28 = 60, 6 take 48 + 42 = 90, 7 would take 105. Without the
    workspace (16-bit) 11 fit; with a cap of one expert's decode the workspace stays 7."""
    from planner import workingset
    ws = {"activations": 10, "decoded": 0, "attention_buffers": 0, "gate_buffers": 0, "expert_buffers": 0,
          "head_buffer": 0, "kv_buffers": 0}
    assert workingset.decode_workspace(4, 7) == 28
    assert workingset.expert_pool_slots(ws, "overlap", {}, 110, 8, "multibatch", 16, 2, decode_bytes=7) == 6
    assert workingset.expert_pool_slots(ws, "overlap", {}, 110, 8, "multibatch", 16, 2) == 12
    assert workingset.decode_workspace(100, workingset.DECODE_WORKSPACE_BYTES) == workingset.DECODE_WORKSPACE_BYTES
    assert workingset.expert_pool_slots(ws, "minimum", {}, 24, 8, "klotski", 16, 2, decode_bytes=7) == 0
    assert workingset.expert_pool_slots(ws, "minimum", {}, 25, 8, "klotski", 16, 2, decode_bytes=7) == 1


def _hqq_run(model, tmp, budget, pooled: bool, schedule="klotski"):
    """Tokens and engine of an hqq4 run with every expert on the host tier; `pooled=False`
    opens no pool (each expert moved and decoded into a copy of its own: the reference path)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.execute.experts import LayerExperts
    from klotski.io.checkpoint import Checkpoint
    from placement.cache import WeightCache
    from placement.placement import Placement
    from tests.conftest import PROMPTS, requests
    placement = Placement.by_kind(Checkpoint.open(str(model)).spec.group_keys(), expert="host")
    n = 1 if schedule == "simple" else 2
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=n,
                    device_memory=budget, quantize="hqq4", offload_dir=str(tmp / "off"), schedule=schedule)
    real_open, real_wave, waves = WeightCache.open_pool, LayerExperts.run_wave, []
    if not pooled:
        WeightCache.open_pool = lambda self, slots, **kw: None

    def run_wave(self, ffn, w, experts, upload):
        waves.append((tuple(t.data_ptr() for t in w.values()), sum(e >= 0 for e in experts)))
        return real_wave(self, ffn, w, experts, upload)
    LayerExperts.run_wave = run_wave
    try:
        engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 10), placement=placement)
        done = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        WeightCache.open_pool, LayerExperts.run_wave = real_open, real_wave
        engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine, waves


@pytest.fixture(scope="module")
def tiny_hqq(tmp_path_factory):
    from klotski.builtin import tiny
    tmp = tmp_path_factory.mktemp("packed")
    model = tiny.build_checkpoint(tmp / "m", "tiny")
    reference, engine, _ = _hqq_run(model, tmp, None, pooled=False)
    assert engine.cache.pool is None
    return model, tmp, reference


@pytest.mark.parametrize("schedule", ["klotski", "multibatch"])
def test_hqq_experts_computed_over_the_pool_token_for_token(tiny_hqq, schedule):
    """Every expert streamed packed: the tokens of the per-expert path; the pool holds decoded
    slots beside their packed rows, charged once (slots x (decoded + packed) + the decode
    workspace), waves computed over its tensors with several experts each, the peak in budget."""
    model, tmp, reference = tiny_hqq
    budget = 64 << 20
    ours, engine, waves = _hqq_run(model, tmp, budget, pooled=True, schedule=schedule)
    assert ours == reference
    cache, pool = engine.cache, engine.cache.pool
    assert pool is not None and pool.slots >= 2 and pool.flat is not None
    # one expert's bytes worked by hand from the tiny preset (hidden 64, intermediate 128), not
    # by the functions the cache sizes it with: decoded, three 64 x 128 fp32 matrices (98,304);
    # packed at 4 bits in groups of 64, each matrix 128 groups of 32 bytes of codes (4,096) and
    # its scales and zeros as 8-bit codes in one meta-group of 128, each with an fp32 scale and
    # zero (2 x (128 + 8) = 272): 3 x 4,368 = 13,104
    decoded, packed = 3 * 64 * 128 * 4, 3 * (128 * 64 * 4 // 8 + 2 * (128 + 2 * 4))
    assert (decoded, packed) == (98_304, 13_104)
    assert pool.expert_nbytes == packed + decoded
    made = sum(t.numel() * t.element_size() for t in (*pool.tensors.values(), pool.flat))  # what was allocated
    assert made == pool.slots * (packed + decoded) and tuple(pool.flat.shape) == (pool.slots, packed)
    assert pool.nbytes == pool.slots * (packed + decoded) + pool.workspace and pool.workspace >= decoded
    over_pool = [n for p, n in waves if p == tuple(t.data_ptr() for t in pool.tensors.values())]
    assert over_pool and max(over_pool) > 1
    assert cache.experts_landed_stacked > 0
    assert engine.memory.peak <= budget
    # each decode's temporaries reserved as the planner counts them (hqq.workspace_nbytes)
    coded = [k for k in cache.sizes if cache.coded(k)]
    assert {k[0] for k in coded} == {"attn", "expert"}
    for k in coded:
        assert cache.workspace[k] == engine.ckpt.hqq_workspace_nbytes(k, cache.dtype, hqq.QuantSpec()) > 0


def test_a_run_is_decoded_in_one_call_per_adjacent_slots(tiny_hqq, monkeypatch):
    """The codec is called once per run of adjacent slots, over as many experts as it holds,
    never once per expert (a 16-expert run: far fewer calls than experts decoded)."""
    from klotski.compress.quantized import QuantCodec
    model, tmp, reference = tiny_hqq
    calls = []
    real = QuantCodec.decode

    def decode(self, parts):
        lead = parts["w1.header"].shape[:-6] if "w1.header" in parts else ()
        calls.append(lead[0] if lead else 1)
        return real(self, parts)
    monkeypatch.setattr(QuantCodec, "decode", decode)
    ours, engine, _ = _hqq_run(model, tmp, 64 << 20, pooled=True, schedule="multibatch")
    assert ours == reference
    experts = [c for c in calls if c > 1]
    assert experts and sum(experts) > 2 * len(experts)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    from conftest import reference_tokens
    from klotski.builtin.families import build_family, pack_mxfp4
    tmp = tmp_path_factory.mktemp("mxfp4")
    mx = pack_mxfp4(build_family(tmp / "fp32", "gpt_oss"), tmp / "mxfp4")
    return mx, reference_tokens(mx)


def test_mxfp4_experts_pooled_equal_transformers(gpt_oss_mxfp4):
    """gpt-oss as OpenAI ships it (MXFP4 experts), every expert on the host tier: the pool
    holds them decoded, and the tokens are transformers'."""
    from conftest import engine_tokens
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    mx, ref = gpt_oss_mxfp4
    placement = Placement.by_kind(Checkpoint.open(str(mx)).spec.group_keys(), expert="host")
    ours, engine = engine_tokens(mx, device_memory=64 << 20, batch_size=3, num_batches=2, placement=placement)
    assert ours == ref
    assert engine.cache.pool is not None and engine.cache.pool.flat is not None
    assert engine.cache.experts_landed_stacked > 0 and engine.memory.peak <= 64 << 20


def test_every_budget_the_plan_takes_holds_packed_experts_within_it(gpt_oss_mxfp4):
    """Budgets from an eighth of the decoded model to all of it, the planner placing it: each
    runs with transformers' tokens and its peak within it (the packed rows and decode workspace
    counted), or is refused naming a budget that does; where experts stream, they move in
    stacked runs (into the pool, or its overflow where the plan's working set is the minimum)."""
    from conftest import engine_tokens
    from klotski.planning import BudgetRefused
    from planner.units import format_size_flag, parse_size
    mx, ref = gpt_oss_mxfp4
    _, probe = engine_tokens(mx, prompts=["x"], max_new_tokens=1)
    total, stacked = sum(probe.cache.full.values()), 0
    for eighths in (1, 2, 3, 4, 6, 8):
        budget = total * eighths // 8
        try:
            ours, engine = engine_tokens(mx, device_memory=budget, batch_size=3, num_batches=2)
        except BudgetRefused as e:
            budget = parse_size(format_size_flag(e.needed))
            ours, engine = engine_tokens(mx, device_memory=budget, batch_size=3, num_batches=2)
        assert ours == ref, (eighths, budget)
        assert engine.memory.peak <= budget, (eighths, budget, engine.memory.peak)
        stacked += engine.cache.experts_landed_stacked > 0
    assert stacked >= 2


def test_packed_copies_follow_their_slots_fences_and_decodes_follow_their_copies(tiny_hqq):
    """The CUDA discipline on a CPU with stub events: a copy into a reused slot's packed row is
    submitted after the fences its last users left, and a run is decoded only once every slot
    it reads has landed (its copy waited for: on CUDA the compute stream waits on its event)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    from tests.conftest import PROMPTS, requests
    from tests.test_expert_pool import watch_slots
    model, tmp, reference = tiny_hqq
    placement = Placement.by_kind(Checkpoint.open(str(model)).spec.group_keys(), expert="host")
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=2,
                    device_memory=64 << 20, quantize="hqq4", offload_dir=str(tmp / "off"))
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 10), placement=placement)
    cache, pool = engine.cache, engine.cache.pool
    used, unfenced, submitted = watch_slots(engine)
    decoded_pending = []
    real_decode, row, runs = cache.codec.decode, pool.flat.stride(0), []

    def decode(parts):
        t = parts.get("w1.q")  # an expert's (attention groups are packed too)
        if t is not None and t.ndim == 3 and pool.flat.data_ptr() <= t.data_ptr() < pool.flat.data_ptr() + pool.flat.numel():
            first = (t.data_ptr() - pool.packed["w1.q"].data_ptr()) // row
            runs.append(t.shape[0])
            decoded_pending.extend(k for k, s in pool.slot.items() if first <= s < first + t.shape[0]
                                   and k in cache.pending)
        return real_decode(parts)
    cache.codec.decode = decode
    try:
        done = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert len(used) > 1 and not unfenced and submitted
    assert runs and max(runs) > 1 and not decoded_pending


def test_gguf_experts_pooled_equal_transformers(tmp_path):
    """A Q4_K_M-like GGUF file (gate and up in Q4_K, down in Q6_K), every expert on the host
    tier: its blocks land in the pool's packed rows, decoded into the slots, and the tokens are
    transformers' reading the same file."""
    pytest.importorskip("gguf")
    import gguf_models as gm
    from conftest import engine_tokens
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    from test_gguf_models import hf_gguf_tokens
    path = gm.write(tmp_path / "model.gguf", {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, gm.QWEN3)
    placement = Placement.by_kind(Checkpoint.open(str(path)).spec.group_keys(), expert="host")
    ours, engine = engine_tokens(path, placement=placement, device_memory=256 << 20, batch_size=3, num_batches=2)
    assert ours == hf_gguf_tokens(path)
    pool = engine.cache.pool
    assert pool is not None and pool.flat is not None and engine.cache.experts_landed_stacked > 0
    assert engine.memory.peak <= 256 << 20
