"""The device's resident experts divided among layers by each layer's hits (issue 64, AdapMoE's
adaptive caching: placement/split.py): the dynamic program against brute force, the tiers it
leaves, and a run on such a placement: transformers' tokens in fp32, within its budget."""
import itertools

import numpy as np
import pytest

from conftest import engine_tokens, reference_tokens
from klotski.planning import engine_placement
from placement.placement import Placement
from placement.split import divide_experts, divide_slots, expected_hits, hit_curves, resident_hit_rates


def _brute_force(curves, total):
    """The most hits any division of exactly `total` slots gives (every count tried)."""
    ranges = [range(len(c)) for c in curves]
    return max(sum(c[k] for c, k in zip(curves, ks)) for ks in itertools.product(*ranges) if sum(ks) == total)


@pytest.mark.parametrize("seed", range(40))
def test_divide_slots_is_optimal(seed):
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 5))
    # any curve at all, not only a sorted share's (concave) one: a greedy would fail some of these
    curves = [np.concatenate([[0.0], rng.random(int(rng.integers(0, 6)))]) for _ in range(layers)]
    total = int(rng.integers(0, sum(len(c) - 1 for c in curves) + 1))
    counts = divide_slots(curves, total)
    assert sum(counts) == total and all(0 <= k < len(c) for k, c in zip(counts, curves))
    assert expected_hits(curves, counts) == pytest.approx(_brute_force(curves, total), abs=1e-9)


def test_uneven_routing_moves_slots_and_uniform_keeps_them_even():
    picks = np.array([[90, 5, 3, 2], [25, 25, 25, 25], [40, 40, 10, 10]])
    counts = divide_slots(hit_curves(picks), 6)
    assert counts == [1, 3, 2]  # the concentrated layer needs one; the spread one takes three
    assert expected_hits(hit_curves(picks), counts) > expected_hits(hit_curves(picks), [2, 2, 2])
    assert divide_slots(hit_curves(np.ones((4, 8))), 10) == [3, 3, 2, 2]  # ties: the even split
    assert divide_slots(hit_curves(picks), 99) == [4, 4, 4]  # no more than there are


def test_a_step_of_many_tokens_uses_every_expert_and_divides_evenly():
    """The curve counts transfers a step saves: with 512 tokens top-2 every expert of these layers
    is used every step, so a resident expert saves one transfer wherever it is (the even split);
    with 64, layer 0's rarest expert is sometimes left unused, and it gives up a slot."""
    picks = np.array([[90, 5, 3, 2], [25, 25, 25, 25], [40, 40, 10, 10]])
    assert divide_slots(hit_curves(picks, tokens=512, top_k=2), 6) == [2, 2, 2]
    assert divide_slots(hit_curves(picks, tokens=64, top_k=2), 6)[0] == 1


def _placement(layers, experts, device, host):
    """A plan's even placement: `device` experts a layer resident, `host` on the host, the rest on disk."""
    tiers = {("attn", j): "host" for j in range(layers)}
    for j, e in itertools.product(range(layers), range(experts)):
        tiers["expert", j, e] = "device" if e < device else "host" if e < device + host else "disk"
    return Placement(tiers, "device")


def test_divide_experts_keeps_each_tier_s_count():
    picks = np.array([[0, 0, 0, 0, 1, 1, 50, 48], [10, 10, 10, 10, 10, 10, 10, 10], [1, 2, 3, 4, 5, 6, 7, 8]])
    even = _placement(3, 8, device=2, host=3)
    divided = divide_experts(even, picks, [0, 1, 2])
    assert divided.summary()["expert"] == even.summary()["expert"]
    assert divided.tiers["attn", 1] == "host" and divided.kv == "device"
    on = lambda j: sorted(e for e in range(8) if divided.tiers["expert", j, e] == "device")
    assert on(0) == [6, 7]          # two take 98% of layer 0's picks
    assert on(2) == [4, 5, 6, 7]    # 8/36 .. 5/36 of layer 2's each, more than layer 1's 1/8
    assert on(1) == []
    # each layer keeps its planned disk count (3), its least picked; the host takes the rest
    disk = lambda p, j: sorted(e for e in range(8) if p.tiers["expert", j, e] == "disk")  # noqa: E731
    assert [len(disk(divided, j)) for j in range(3)] == [3, 3, 3]
    assert disk(divided, 2) == [0, 1, 2] and set(disk(divided, 0)) <= {0, 1, 2, 3}
    assert all(divided.tiers["expert", 1, e] == "host" for e in range(5))
    # a step of many tokens uses every expert: ties must not hand one layer's host slots to another
    many = divide_experts(even, picks, [0, 1, 2], tokens=512, top_k=2)
    assert [len(disk(many, j)) for j in range(3)] == [3, 3, 3]
    assert many.summary()["expert"] == even.summary()["expert"]
    resident = [[divided.tiers["expert", j, e] == "device" for e in range(8)] for j in range(3)]
    before = [[even.tiers["expert", j, e] == "device" for e in range(8)] for j in range(3)]
    assert sum(resident_hit_rates(picks, resident)) > sum(resident_hit_rates(picks, before))


class _Plan:
    """A plan's tiers as planner.place.layer_ios gives them: the same experts resident in every layer."""

    batch_size, num_batches = 1, 1  # a step routes one token: the division follows the picks' shares

    def __init__(self, layers, experts, device):
        self.placement = _placement(layers, experts, device, host=experts - device)

    def group_tiers(self, num_layers, num_experts):
        return dict(self.placement.tiers), "device"


def test_engine_placement_divides_with_picks(checkpoints):
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(checkpoints["gqa"]), direct_io=False)
    spec = ckpt.spec
    ckpt.close()
    L, E = spec.shape.num_layers, spec.shape.num_experts
    picks = np.ones((L, E))
    picks[0, 3] = 1000  # layer 0 sends nearly everything to expert 3
    plan = _Plan(L, E, device=2)
    even = engine_placement(plan, spec)
    divided = engine_placement(plan, spec, None, picks)
    per_layer = lambda p: [sum(p.tiers["expert", j, e] == "device" for e in range(E)) for j in range(L)]
    assert per_layer(even) == [2] * L
    assert sum(per_layer(divided)) == 2 * L and per_layer(divided)[0] == 1
    assert divided.tiers["expert", 0, 3] == "device"


def test_divided_placement_is_exact_and_within_budget(checkpoints):
    """A run on an uneven division (one layer's experts all resident, another's none), its
    prefetches cut into 64 KiB chunks on an emulated link (execute/channels.py): fp32 tokens equal
    transformers', peak device bytes within a budget that leaves room for little more than the
    resident experts, and the report's hit rates per layer say so."""
    import torch
    from klotski.execute.channels import link_report
    from klotski.io.checkpoint import Checkpoint
    from klotski.schedule.report import resident_hits
    ckpt = Checkpoint.open(str(checkpoints["gqa"]), direct_io=False)
    spec, keys = ckpt.spec, ckpt.spec.group_keys()
    size = {k: ckpt.group_nbytes(k, torch.float32)[0] for k in keys}
    ckpt.close()
    L, E = spec.shape.num_layers, spec.shape.num_experts
    picks = np.ones((L, E))
    picks[1] = 0
    picks[1, :E // 2] = 1  # layer 1's picks on half its experts: the rest of the device goes elsewhere
    even = Placement({k: "host" if k[0] in ("attn", "gate") or (k[0] == "expert" and k[2] >= 2) else "device"
                      for k in keys}, "device")
    divided = divide_experts(even, picks, list(range(L)))
    assert divided.summary()["expert"] == even.summary()["expert"]
    assert [sum(divided.tiers["expert", j, e] == "device" for e in range(E)) for j in range(L)] != [2] * L
    ref = reference_tokens(checkpoints["gqa"], max_new_tokens=6)
    resident = sum(size[k] for k, t in divided.tiers.items() if t == "device")
    budget = resident + size["attn", 0] + size["gate", 0] + 6 * size["expert", 0, 0] + (4 << 20)
    ours, engine = engine_tokens(checkpoints["gqa"], placement=divided, max_new_tokens=6, batch_size=3,
                                 num_batches=2, device_memory=budget, emulate_link_gbps=1.0,
                                 transfer_chunk_ms=0.001, close=False)
    link = link_report(engine.channels)
    engine.close()
    assert ours == ref
    assert engine.memory.peak <= budget
    assert engine.pipeline.experts_loaded > 0
    assert link["chunk_bytes"] == 64 << 10 and link["speculative_chunks"] > 0 and link["demand_loads"] > 0

    class Setup:
        placement, expert_split = divided, "dp"
    hits = resident_hits(engine, Setup)
    assert hits["split"] == "dp" and sum(hits["resident_per_layer"]) == 2 * L
    assert 0 < hits["hit_rate"] < 1 and len(hits["hit_rate_per_layer"]) == L
