"""Planner side of host compute and continuous batching: the solver and simulator move
attention and experts to the host where the cost model says, batches grow when the KV and
attention live on the host, and slot utilisation follows the job's output lengths."""
from __future__ import annotations

import dataclasses

import pytest

from planner.costmodel import CostModel
from planner.layer import Host
from planner.moegen import run
from planner.occupancy import slot_utilisation
from planner.profile import load_profile
from planner.shapes import ModelShape
from planner.simulate import simulate
from planner.solve import Budgets, solve
from planner.workingset import ACTIVATION_RING_BYTES

SMALL = ModelShape(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                   head_dim=32, num_experts=8, top_k=2, vocab_size=128, dtype="bfloat16")


def test_slot_utilisation_replays_the_job():
    # static: groups [4, 1] and [4, 1] each run 4 steps: 10 useful rows of 2 x 8 computed
    assert slot_utilisation([4, 1, 4, 1], 2, "static") == pytest.approx(10 / 16)
    # continuous: the short ones' slot takes the next sequence at once; 5 steps, no idle row
    assert slot_utilisation([4, 1, 4, 1], 2, "continuous") == pytest.approx(1.0)
    # the drain: one long sequence at the end keeps the other slots idle
    assert slot_utilisation([1, 1, 1, 9], 2, "continuous") == pytest.approx(12 / 20)
    assert slot_utilisation([3, 3], 4, "continuous") == pytest.approx(6 / 12)  # more slots than sequences
    with pytest.raises(ValueError, match="batching"):
        slot_utilisation([1], 1, "dynamic")


def test_solver_scales_rows_by_slot_utilisation_and_says_so():
    profile = load_profile("rtx3090-pcie4")
    cost = CostModel(profile, SMALL)
    budgets = Budgets(device=2e9, host=64e9)
    lens = [8, 64] * 32
    kw = dict(prompt_len=64, gen_len=64, batch_sizes=(8,), num_batches=2, max_sequences=len(lens))
    plain = solve(SMALL, cost, budgets, **kw)
    cont = solve(SMALL, cost, budgets, gen_lens=lens, batching="continuous", **kw)
    stat = solve(SMALL, cost, budgets, gen_lens=lens, batching="static", **kw)
    u_c, u_s = slot_utilisation(lens, 16, "continuous"), slot_utilisation(lens, 16, "static")
    assert u_s == pytest.approx(36 / 64) and u_c > u_s
    # the job's rate: 64 prompts prefilled in 4 groups of 16; their tokens after the first
    # decoded 16·u to a step. Static steps compute the whole group; continuous ones compute
    # live rows only, so its drain costs less than full steps would
    step = plain.decode_s / (64 - 1)
    full = {u: sum(lens) / (4 * plain.prefill_s + sum(g - 1 for g in lens) / (16 * u) * step) for u in (u_c, u_s)}
    assert stat.predicted_tokens_per_s == pytest.approx(full[u_s])
    assert full[u_c] < cont.predicted_tokens_per_s < sum(lens) / (4 * plain.prefill_s)
    assert cont.predicted_tokens_per_s > stat.predicted_tokens_per_s
    assert cont.slot_utilisation == {"continuous": pytest.approx(u_c), "static": pytest.approx(u_s)}
    assert any(m.startswith(f"continuous batching: expected slot utilisation {u_c:.2f} (static {u_s:.2f})")
               for m in cont.moves)


def test_host_experts_in_the_simulator_follow_the_cost_model():
    """Every expert on the host, decode of 2 sequences: a fast host computes the cold ones
    where they live (no expert crosses the link, the step is sooner); a host 10^4 times
    slower is never chosen under auto."""
    base = load_profile("rtx3090-pcie4")
    fast = CostModel(base, SMALL)
    slow = CostModel(dataclasses.replace(base, host_flops=base.host_flops / 1e4, host_mem_bw=base.host_mem_bw / 1e4),
                     SMALL)
    kw = dict(bs=2, n=1, prompt_len=16, gen_len=2, K=0, decode_samples=1)
    off = simulate(fast, SMALL, host=Host(experts="off"), **kw)
    on = simulate(fast, SMALL, host=Host(experts="auto"), **kw)
    assert fast.expert_on_host(0.5) and off.busy_s["host"] == 0 and on.busy_s["host"] > 0
    assert on.busy_s["experts"] < off.busy_s["experts"] and on.step_s["decode"][0][1] < off.step_s["decode"][0][1]
    lazy = simulate(slow, SMALL, host=Host(experts="auto"), **kw)
    assert not slow.expert_on_host(0.5) and lazy.busy_s["host"] == 0


def test_host_compute_needs_host_rates():
    profile = dataclasses.replace(load_profile("rtx3090-pcie4"), host_flops=0.0, host_mem_bw=0.0)
    with pytest.raises(ValueError, match="no host rates"):
        solve(SMALL, CostModel(profile, SMALL), Budgets(device=2e9, host=64e9), prompt_len=64, gen_len=8,
              host_attention="on")


def test_moegen_setting_host_attention_grows_batches_and_decode():
    """Mixtral-8x7B on MoE-Gen's A5000 + 512 GB: with attention next to the host KV the
    device holds no KV, the planner takes batches of hundreds, and simulated decode rises
    (past MoE-Gen's published 469 tokens/s on these datasheet assumptions)."""
    auto, off = run("mixtral-8x7b", "a5000-pcie4-512g", "auto"), run("mixtral-8x7b", "a5000-pcie4-512g", "off")
    pa, po = auto["plan"], off["plan"]
    assert pa.host_attention and not po.host_attention
    # without host attention a batch's KV prefix (and its keys) must fit the device: bs ≤ 64
    assert pa.batch_size >= 128 > po.batch_size
    assert "layers.0-31.kv" in pa.placement and pa.placement["layers.0-31.kv"] == "host"
    assert auto["sim"].busy_s["host"] > 0 and off["sim"].busy_s["host"] == 0
    assert auto["sim"].decode_tokens_per_s > 2 * off["sim"].decode_tokens_per_s
    assert auto["sim"].decode_tokens_per_s > 469
    assert any(m.startswith("attention on host: KV prefix") for m in pa.moves)


def test_host_compute_on_a_gpu_leaves_host_memory_for_the_ring_its_results_go_up_through():
    """On a CUDA device, where host compute may run, the engine holds a page-locked ring of
    ACTIVATION_RING_BYTES in host memory (assemble.reserve_staging_rings): the plan counts it,
    and under a host budget that fitted only without it, the plan places less on the host."""
    cost = CostModel(load_profile("rtx3090-pcie4"), SMALL)
    kw = dict(prompt_len=64, gen_len=16, batch_sizes=(8,), num_batches=2)
    roomy = Budgets(device=20e6, host=64e9)
    off = solve(SMALL, cost, roomy, **kw)
    on = solve(SMALL, cost, roomy, host_experts="on", **kw)
    assert on.peak_bytes["host"] == off.peak_bytes["host"] + ACTIVATION_RING_BYTES
    tight = Budgets(device=roomy.device, host=off.peak_bytes["host"])
    fits = solve(SMALL, cost, tight, host_experts="on", **kw)
    assert fits.peak_bytes["host"] <= tight.host and fits.placement != off.placement


def test_a_host_kv_cache_on_a_gpu_leaves_host_memory_for_the_ring_its_slots_go_up_through():
    """On a CUDA device with the KV cache on the host, the engine holds the kv_load channel's
    page-locked ring (KV_STAGING_BYTES, assemble.reserve_staging_rings): the plan counts it
    there and nowhere else. The same machine called a CPU places the same and holds no ring
    (nor the step's rings every CUDA run holds: STEP_RING_BYTES)."""
    import dataclasses

    from planner.workingset import KV_STAGING_BYTES, STEP_RING_BYTES
    gpu = load_profile("rtx3090-pcie4")
    kw = dict(prompt_len=64, gen_len=16, batch_sizes=(8,), num_batches=2)
    tight = Budgets(device=4e6, host=64e9)  # no room for the KV cache on the device
    on_gpu = solve(SMALL, CostModel(gpu, SMALL), tight, **kw)
    on_cpu = solve(SMALL, CostModel(dataclasses.replace(gpu, device="cpu"), SMALL), tight, **kw)
    assert on_gpu.placement == on_cpu.placement and "host" in [t for g, t in on_gpu.placement.items() if g.endswith(".kv")]
    assert on_gpu.peak_bytes["host"] == on_cpu.peak_bytes["host"] + KV_STAGING_BYTES + STEP_RING_BYTES
    roomy = Budgets(device=64e9, host=64e9)  # the KV cache on the device: no kv_load ring
    assert (solve(SMALL, CostModel(gpu, SMALL), roomy, **kw).peak_bytes["host"]
            == solve(SMALL, CostModel(dataclasses.replace(gpu, device="cpu"), SMALL), roomy, **kw).peak_bytes["host"]
            + STEP_RING_BYTES)
