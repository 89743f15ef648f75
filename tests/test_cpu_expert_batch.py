"""The CPU expert phase without a call per expert (issue 60, item 2): a wave of SwiGLU experts in
fp32 on a CPU runs through MKL's sgemm_batch (models/grouped.py `BatchedGemm`, `wave_runner`),
every group's product in one BLAS call, the wave's pointers worked out once. Held here: each
group gets the bits of the per-group ops (at one thread, and whatever the thread count), the
check made before it is used can fail, the resident wave on a CPU passes only the experts its
rows reach, a wave's ATen ops do not grow with its experts, and the 128-expert twin's greedy
tokens are transformers'."""
import pytest
import torch

from klotski.execute.experts import LayerExperts, Routed, SortKeys
from klotski.models import grouped as G
from klotski.measure.opcounter import OpCounter

batched = pytest.mark.skipif(G.batched_gemm() is None, reason="this torch has no MKL sgemm_batch that agrees")

SHAPES = [(4, 64, 96), (8, 72, 96), (16, 200, 72), (128, 64, 128), (64, 64, 32)]  # experts, hidden, width


def _wave(E, H, I, T, k, seed, experts=None, threads=1, mode="batched"):
    """The top-k slots of one wave over E stacked experts for T random tokens."""
    g = torch.Generator().manual_seed(seed)
    w = {"w1": torch.randn(E, I, H, generator=g) * .2, "w3": torch.randn(E, I, H, generator=g) * .2,
         "w2": torch.randn(E, H, I, generator=g) * .2}
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        if mode == "per-group":
            G.force_fallback("cpu", torch.float32)  # the per-expert ops themselves, whole experts a call
        else:
            G.force_fallback("cpu", torch.float32, False)
            G._SUPPORTED[("cpu", torch.float32)] = False  # the same cuts as the per-group path
        moe = LayerExperts(Routed(x, weights, ids, None, [T], [None]), k, None)
        moe.count(ids, E)
        moe.run_wave(G.grouped_swiglu, w, list(range(E)) if experts is None else experts, lambda t: t)
        return moe.slots
    finally:
        G.force_fallback("cpu", torch.float32, False)
        torch.set_num_threads(before)


@batched
@pytest.mark.parametrize("E,H,I", SHAPES)
def test_a_batched_wave_is_the_per_group_ops_bit_for_bit(E, H, I):
    """Groups of 0, 1 and many rows (a lone row is MKL's matrix-vector product, as F.linear's),
    widths that are not a multiple of the vector width, rows of a pool that are in no wave
    (-1): the slots equal the per-group fallback's, at one thread."""
    for seed, (T, k) in enumerate([(1, 2), (7, 4), (32, 8), (45, 1), (64, 8)]):
        k = min(k, E)
        holes = [e if e % 3 else -1 for e in range(E)]
        for experts in (None, holes):
            ours = _wave(E, H, I, T, k, seed, experts)
            assert torch.equal(ours, _wave(E, H, I, T, k, seed, experts, mode="per-group")), (E, H, I, T, k)


@batched
def test_a_batched_wave_does_not_depend_on_the_thread_count():
    """MKL computes each product of the batch on one thread: two threads give one thread's bits
    (the per-expert F.linear at two threads may not: MKL splits some of its products)."""
    for seed, (E, H, I, T, k) in enumerate([(8, 512, 1024, 3, 2), (64, 256, 384, 7, 8), (16, 1024, 512, 300, 1)]):
        assert torch.equal(_wave(E, H, I, T, k, seed, threads=1), _wave(E, H, I, T, k, seed, threads=2))


@batched
def test_the_check_before_use_can_fail():
    """BatchedGemm.agrees compares a wave with the per-group ops: a BLAS that computes anything
    else (nothing at all, or every product times zero) is not used."""
    real = G.batched_gemm().fn
    assert G.BatchedGemm(real).agrees()
    assert not G.BatchedGemm(lambda *args: None).agrees()

    def scaled_by_zero(*args):  # alpha's argument given beta's zeros: every product 0
        return real(*args[:5], args[10], *args[6:])
    assert not G.BatchedGemm(scaled_by_zero).agrees()


def test_without_mkl_a_wave_goes_call_by_call(monkeypatch):
    """KLOTSKI_NO_BATCHED_GEMM (or a torch without MKL): no batch, the per-call path, the same
    tokens as the per-group ops."""
    monkeypatch.setenv("KLOTSKI_NO_BATCHED_GEMM", "1")
    monkeypatch.setattr(G, "_BATCH", G._UNSET)
    assert G.batched_gemm() is None
    x, w = torch.randn(4, 8), {n: torch.randn(3, 8, 8) for n in ("w1", "w3", "w2")}
    assert G.wave_runner(G.grouped_swiglu, x, w) is None
    assert G.cpu_kernel() in ("grouped", "per-group")
    monkeypatch.setattr(G, "_BATCH", G._UNSET)
    monkeypatch.delenv("KLOTSKI_NO_BATCHED_GEMM")


@batched
def test_only_fp32_swiglu_waves_on_a_cpu_take_the_batch():
    x, w = torch.randn(4, 8), {n: torch.randn(3, 8, 8) for n in ("w1", "w3", "w2")}
    assert G.wave_runner(G.grouped_swiglu, x, w) is not None
    assert G.wave_runner(lambda *a: None, x, w) is None  # another family's grouped FFN
    assert G.wave_runner(G.grouped_swiglu, x.bfloat16(), {n: t.bfloat16() for n, t in w.items()}) is None
    assert G.wave_runner(G.grouped_swiglu, x, {**w, "w1": w["w1"][:, :, ::2]}) is None  # strided: not BLAS's layout
    G.force_fallback("cpu", torch.float32)
    try:
        assert G.wave_runner(G.grouped_swiglu, x, w) is None and G.cpu_kernel() == "per-group"
    finally:
        G.force_fallback("cpu", torch.float32, False)


@pytest.mark.parametrize("batch", [True, False])
def test_a_waves_ops_do_not_grow_with_its_experts(batch):
    """The same 32 tokens top-8 over 8 and over 128 experts (every one resident): with the
    batch, the wave's ATen ops are the same whatever the number of experts; without it (the
    grouped kernel, a call per run of rows) too."""
    if batch and G.batched_gemm() is None:
        pytest.skip("no MKL sgemm_batch")
    counts = {}
    for E in (8, 128):
        g = torch.Generator().manual_seed(0)
        w = {"w1": torch.randn(E, 32, 16, generator=g), "w3": torch.randn(E, 32, 16, generator=g),
             "w2": torch.randn(E, 16, 32, generator=g)}
        x = torch.randn(32, 16, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(32)])
        routed = Routed(x, torch.rand(32, 8, generator=g), ids, None, [32], [None])
        if not batch:
            G._BATCHED[("cpu", torch.float32)] = False
        try:
            moe = LayerExperts(routed, 8, SortKeys.of(list(range(E)), E, lambda t: t))
            with OpCounter() as ops:
                moe.run_resident(G.grouped_swiglu, w)
            counts[E] = ops.total
        finally:
            G._BATCHED.pop(("cpu", torch.float32), None)
    assert counts[128] == counts[8], counts


def test_the_resident_wave_on_a_cpu_passes_only_the_experts_its_rows_reach(monkeypatch):
    """A call of the resident wave gets the run of experts its rows reach (views of the stack),
    not the whole stack with empty groups (~900 of them a decode layer on 128 experts before)."""
    E, T, k = 128, 32, 8
    g = torch.Generator().manual_seed(1)
    w = {"w1": torch.randn(E, 32, 16, generator=g), "w3": torch.randn(E, 32, 16, generator=g),
         "w2": torch.randn(E, 16, 32, generator=g)}
    x = torch.randn(T, 16, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    seen = []

    def ffn(x, w, groups):
        seen.append(len(groups.host_counts()))
        return G.grouped_swiglu(x, w, groups)
    moe = LayerExperts(Routed(x, torch.rand(T, k, generator=g), ids, None, [T], [None]), k,
                       SortKeys.of(list(range(E)), E, lambda t: t))
    moe.run_resident(ffn, w)
    assert moe.resident_done and seen and max(seen) < E // 2, seen
    ref = LayerExperts(Routed(moe.routed.x, moe.routed.weights, ids, None, [T], [None]), k, None)
    ref.count(ids, E)
    ref.run_wave(G.grouped_swiglu, w, list(range(E)), lambda t: t)
    torch.testing.assert_close(moe.slots, ref.slots, rtol=1e-5, atol=1e-6)


@batched
def test_the_fine_grained_twin_decodes_transformers_tokens(tmp_path):
    """The 128-expert Qwen3-shaped twin (klotski/measure/op_count.py), every expert resident,
    its waves batched: greedy tokens in fp32 equal transformers'."""
    from tests.conftest import engine_tokens, reference_tokens
    from klotski.builtin.families import build_family
    model = build_family(tmp_path / "fine", "qwen3_moe", num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=32, num_hidden_layers=2)
    ours, _ = engine_tokens(model, batch_size=3, num_batches=2, threads=1)
    assert ours == reference_tokens(model)
