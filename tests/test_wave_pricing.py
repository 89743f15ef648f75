"""The planner prices a layer's experts as the engine computes them: in waves, many experts a
grouped call (planner/layer.py `expert_phase`, planner/waves.py, the cost model's
`t_wave_call`/`t_wave_expert`, fitted from the waves the profile times)."""
from __future__ import annotations

import dataclasses

import pytest

from klotski.measure.profile_ops import EngineOps
from planner import profile as P
from planner.costmodel import CostModel
from planner.layer import LayerIO, Phase, ineq_terms, layer_time
from planner.profile import Profile, builtin_profiles, load_profile, measure
from planner.shapes import KNOWN_MODELS, ModelShape
from planner.waves import landing_waves, resident_calls, wave_calls

# 8 experts top-8 and 128 experts top-8 of one expert size: equal FLOPs a token
FEW = ModelShape(hidden_size=256, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                 num_experts=8, top_k=8, vocab_size=128, dtype="bfloat16")
MANY = dataclasses.replace(FEW, num_experts=128)
CALL, GROUP = 40e-6, 3e-6  # a grouped call's own cost, and what each expert adds to it


def wave_profile(**links) -> Profile:
    """Compute free but for the stated fixed costs (peaks effectively infinite): a grouped call
    CALL, each expert in it GROUP, a single expert's call both."""
    bw = links.get("bw", 1e30)
    return Profile(name="waves", flops=1e30, mem_bw=1e30,
                   links={"host_to_device": bw, "device_to_host": bw, "disk_to_host": bw},
                   overhead_s={"attention": 0.0, "gate": 0.0, "head": 0.0, "expert": CALL + GROUP,
                               "wave": CALL, "wave_group": GROUP})


def experts_s(shape, tier="device", bs=32, n=1, new=1, **links) -> float:
    """The priced expert phase of one layer (every expert on `tier`, uniform routing)."""
    cost = CostModel(wave_profile(**links), shape)
    E, k = shape.num_experts, shape.top_k
    io = LayerIO("device", "device", "device", (tier,) * E, "device")
    parts = ineq_terms(cost, io, Phase(bs, n, 64, new), [k / E] * E, set(range(k)))[2]
    return parts["hot"] + parts["cold"]


def used(shape, tokens) -> float:
    m = shape.top_k / shape.num_experts
    return shape.num_experts * (1 - (1 - m) ** tokens)


def test_many_small_experts_add_their_group_part_not_a_call_each():
    """Decode at bs 32: 8 experts top-8 use all 8; 128 experts top-8 use ~125 of them. Computed
    in one wave each (8 calls of 32 rows: a token's 8 picks), the 128-expert layer costs more by
    each further expert's part of the wave, not by a call per expert (the old pricing:
    used · t_expert, 117 calls more)."""
    few, many = experts_s(FEW), experts_s(MANY)
    assert few == pytest.approx(8 * CALL + 8 * GROUP)
    assert many - few == pytest.approx((used(MANY, 32) - 8) * GROUP)
    assert many < 2 * few  # per-call pricing: ~14x


def test_a_wave_of_one_expert_costs_a_single_expert_call():
    cost = CostModel(wave_profile(), FEW)
    for pairs in (1, 7, 300):
        assert cost.t_wave(1, pairs) == pytest.approx(cost.t_expert(pairs))
    assert cost.t_wave(8, 64, calls=2) == pytest.approx(2 * CALL + 8 * GROUP)


def test_the_calls_of_a_wave_follow_the_engines_rows_per_call():
    # the resident wave computes tokens·min(k, R) rows, a call per group's tokens (at most 4096)
    assert resident_calls(32, 8, 128) == 8 and resident_calls(32, 8, 3) == 3
    assert resident_calls(8192, 8, 128) == 16 and resident_calls(0, 8, 128) == 0
    # a wave's last call is part-filled: half a call more on average, at least one a wave
    assert wave_calls(64, 32, 1) == pytest.approx(2.5)
    assert wave_calls(3, 32, 2) == 2 and wave_calls(0, 32, 2) == 0


def test_cold_experts_land_in_as_many_waves_as_the_link_allows():
    # slower link than a wave of one: a wave each; faster than an expert's compute: one wave
    assert landing_waves(10, fetch=1.0, call=0.1, expert=0.1) == 10
    assert landing_waves(10, fetch=0.01, call=0.1, expert=0.05) == 1
    # between: those landed while the last wave ran, m = call / (fetch − expert)
    assert landing_waves(10, fetch=0.1, call=0.1, expert=0.05) == pytest.approx(5)
    # streamed over a slow link each cold expert pays a call of its own; over a fast one they share
    slow = experts_s(MANY, "host", bw=MANY.expert_nbytes() / 1e-3)
    fast = experts_s(MANY, "host", bw=1e30)
    cold = 120 * (1 - (1 - 8 / 128) ** 32)  # the 120 not prefetched, each used with this chance
    assert slow - fast == pytest.approx((cold - 8) * CALL)  # 8: the fast link's one wave of 240 pairs


def test_multibatch_prices_its_experts_over_the_whole_group():
    """FlexGen-style schedules compute every batch's experts at once (all of them landed): one
    wave of n·bs tokens, not a wave per batch."""
    cost = CostModel(wave_profile(), MANY)
    E, k = MANY.num_experts, MANY.top_k
    io = LayerIO("device", "device", "device", ("device",) * E, "device")
    t4 = layer_time(cost, io, Phase(8, 4, 64, 1), [k / E] * E, set(), "multibatch")[0]
    assert t4 == pytest.approx(8 * CALL + used(MANY, 32) * GROUP)


def fitted(call, group, single, shape=FEW, disturbed=1.0) -> Profile:
    """A measured profile of `shape` whose single-expert op costs `single` + work(n) and whose
    waves cost `call` + g·(`group` + work(n)), work(n) = 1 µs a pair."""
    work = lambda n: 1e-6 * n  # noqa: E731
    waves = [[g, g * n, call + g * (group + work(n))] for n in (1, 8, 64) for g in (1, 8)]
    waves[-1][-1] *= disturbed
    return Profile(name="fit", flops=1e12, mem_bw=1e11, links={"host_to_device": 1e9}, shape_key=shape.key(),
                   samples={"expert": [[n, single + work(n)] for n in (1, 8, 64, 512)], "wave": waves})


def test_the_wave_terms_are_fitted_from_the_timed_waves():
    cost = CostModel(fitted(call=30e-6, group=5e-6, single=50e-6), FEW)
    assert cost.t_wave_call() == pytest.approx(30e-6)
    for n in (1, 8, 64):
        assert cost.t_wave_expert(n) == pytest.approx(5e-6 + 1e-6 * n)
        assert cost.t_wave(8, 8 * n) == pytest.approx(30e-6 + 8 * (5e-6 + 1e-6 * n))
    # beyond the timed pairs an expert's part scales as the single-expert op does
    assert cost.t_wave_expert(512) == pytest.approx(cost.t_expert(512) * (5e-6 + 64e-6) / (50e-6 + 64e-6))
    # a wave caught by another process for every repetition is left out of the fit
    assert CostModel(fitted(30e-6, 5e-6, 50e-6, disturbed=40.0), FEW).t_wave_call() == pytest.approx(30e-6)
    # the call's part never goes below 0 nor above the cheapest wave of one (noise)
    assert CostModel(fitted(-10e-6, 5e-6, 50e-6), FEW).t_wave_call() == 0.0
    # most waves disturbed (a busy machine): the undisturbed one is the odd one out, yet the
    # call's part stays within it, the fastest wave of one timed (a disturbance only adds time)
    busy = fitted(30e-6, 5e-6, 50e-6)
    busy.samples["wave"] = [row[:2] + [row[2] * (40 if i else 1)] for i, row in enumerate(busy.samples["wave"])]
    assert CostModel(busy, FEW).t_wave_call() <= busy.samples["wave"][0][2]


@pytest.mark.parametrize("name", builtin_profiles())
def test_builtin_profiles_infer_their_wave_terms(name):
    """A built-in profile times no wave: a grouped call pays a single expert call's fixed cost
    once, each expert its roofline; a 128-expert decode is priced far below a call per expert."""
    prof = load_profile(name)
    cost = CostModel(prof, KNOWN_MODELS["qwen3-30b-a3b"])
    assert cost.t_wave_call() == prof.overhead_s["expert"]
    assert cost.t_wave(1, 64) == pytest.approx(cost.t_expert(64))
    E, k = cost.shape.num_experts, cost.shape.top_k
    io = LayerIO("device", "device", "device", ("device",) * E, "device")
    parts = ineq_terms(cost, io, Phase(32, 1, 512, 1), [k / E] * E, set(range(k)))[2]
    per_call = used(cost.shape, 32) * cost.t_expert(32 * k / used(cost.shape, 32))
    assert parts["hot"] + parts["cold"] < 0.5 * per_call


def test_the_profile_times_waves_of_one_and_of_several_experts(tmp_path):
    shape = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, num_experts=4, top_k=2, vocab_size=128, dtype="bfloat16")
    prof = measure(shape, ops=EngineOps(), io_dir=tmp_path, batch_sizes=(1, 2), context_lengths=(8,),
                   token_counts=(1, 4), reps=2, io_bytes=4 << 20)
    g = P.wave_groups(shape)
    assert g == 4  # the model's experts, fewer than WAVE_GROUPS
    assert [r[:2] for r in prof.samples["wave"]] == [[1, 1], [g, g], [1, 8], [g, 8 * g], [1, 64], [g, 64 * g]]
    assert all(r[2] > 0 for r in prof.samples["wave"])
    cost = CostModel(prof, shape)
    assert 0 <= cost.t_wave_call() <= min(r[2] for r in prof.samples["wave"] if r[0] == 1)
    assert cost.t_wave_expert(8) > 0


def test_a_resident_waves_calls_pay_for_the_empty_groups_they_pass():
    """Each call of the resident wave takes the layer's whole stack (it runs before the counts
    reach the host): at bs 32 its 8 calls pass 8·128 groups, ~125 with pairs. Where the kernel
    visits an empty group (a CPU), the profile's wave of one expert's pairs among empty groups
    prices each."""
    plain = fitted(call=30e-6, group=5e-6, single=50e-6, shape=MANY)
    with_empty = fitted(call=30e-6, group=5e-6, single=50e-6, shape=MANY)
    one = next(t for g, p, t in with_empty.samples["wave"] if (g, p) == (1, 8))
    with_empty.samples["wave_empty"] = [[8, 8, one + 7 * 2e-6]]
    assert CostModel(with_empty, MANY).t_wave_slot() == pytest.approx(2e-6)
    assert CostModel(plain, MANY).t_wave_slot() == 0.0  # not timed: a GPU's kernel skips them

    def resident(prof):
        io = LayerIO("device", "device", "device", ("device",) * 128, "device")
        parts = ineq_terms(CostModel(prof, MANY), io, Phase(32, 1, 64, 1), [8 / 128] * 128, set())[2]
        return parts["hot"] + parts["cold"]
    assert resident(with_empty) - resident(plain) == pytest.approx((8 * 128 - used(MANY, 32)) * 2e-6)
