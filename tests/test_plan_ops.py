"""`klotski plan`'s kernels and channel submissions per decode layer (planner/decode_ops.py)
against a real run of the plan (issue 45, item 4): the ATen ops that compute or copy, counted
on the compute thread (measure/opcounter.OpCounter) over the job's decode steps, and every transfer
submitted to a channel. Counting, not timing: the same on any CPU."""
import pytest

from klotski.assemble import open_engine
from klotski.measure.op_count import counted_profile, decode_layer_counts
from klotski.builtin.families import build_family
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.planning import engine_placement, make_plan
from planner.profile import load_profile
from planner.report import format_plan
from planner.shapes import as_shape

BS, N, NEW = 4, 2, 6
KERNELS_WITHIN = 0.25     # the model's ops: sums of counted pieces, the experts chosen vary
SUBMISSIONS_WITHIN = 0.10  # with room on the device for a run of experts: exact but for re-predicted hot sets


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Qwen3-shaped: 32 experts top-8, so a decode group of 8 tokens picks ~29 of a layer's."""
    return build_family(tmp_path_factory.mktemp("plan-ops") / "q32", "qwen3_moe", num_experts=32,
                        num_experts_per_tok=8, moe_intermediate_size=64, num_hidden_layers=3)


@pytest.fixture(scope="module")
def profile(model):
    """A built-in profile's times (they only steer the plan's choices) with the counts a
    profile measured here carries: the model math's ops and the pipeline's own, both counted
    by the engine (klotski/measure/op_count.py: counted_profile), never by the code under test."""
    return counted_profile(open_engine, model)


def plan_for(model, profile, device_memory: int):
    spec = Checkpoint.open(str(model)).spec
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=BS, num_batches=N,
                    batching="static", device_memory=device_memory, host_memory=1 << 32)
    plan = make_plan(as_shape(spec), profile, device_memory=device_memory, host_memory=1 << 32, prompt_len=32,
                     longest_prompt=40, gen_len=NEW + 2, config=cfg)
    return cfg, spec, plan


def counted(cfg, spec, plan) -> tuple[float, float]:
    """(kernels, submissions) per decode layer of a real run of `plan` (klotski/measure/op_count.py)."""
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list, a passage", messages=None,
                    max_new_tokens=NEW) for i in range(BS * N)]
    return decode_layer_counts(open_engine, cfg, reqs, engine_placement(plan, spec))


@pytest.mark.parametrize("regime,device_memory", [("resident", 1 << 30), ("streamed", 4_000_000),
                                                  ("kv-host", 2_000_000)])
def test_plan_predicts_a_decode_layers_kernels_and_submissions(model, profile, regime, device_memory):
    """Every expert resident; most experts streamed from host memory; the KV cache on the host
    too (a load and a store per batch and layer). The plan's placement is run as planned."""
    cfg, spec, plan = plan_for(model, profile, device_memory)
    L, E = spec.shape.num_layers, spec.shape.num_experts
    on_host = sum(plan.tier(j, "experts", e) == "host" for j in range(L) for e in range(E))
    if regime == "resident":
        assert on_host == 0 and plan.tier(0, "kv") == "device"
    else:
        assert on_host >= L * E * 3 // 4 and (plan.tier(0, "kv") == "host") == (regime == "kv-host"), plan.placement
    kernels, submissions = counted(cfg, spec, plan)
    predicted = plan.per_layer["kernels"]["decode"], plan.per_layer["submissions"]["decode"]
    assert kernels == pytest.approx(predicted[0], rel=KERNELS_WITHIN), (regime, kernels, predicted)
    if regime == "resident":
        assert submissions == predicted[1] == 0
    else:
        assert submissions == pytest.approx(predicted[1], rel=SUBMISSIONS_WITHIN), (regime, submissions, predicted)
    text = format_plan(plan)
    assert f"kernels per decode layer: {predicted[0]:.0f} " in text
    assert f"channel submissions per decode layer: {predicted[1]:.3g} " in text


def test_the_count_tells_grouped_waves_from_calls_per_expert(model, profile, monkeypatch):
    """The check can fail: priced as if every chosen expert were a call of its own (a wave's
    ops growing with its experts, as before the grouped waves), the prediction is off the
    real count by more than the tolerance."""
    cfg, spec, plan = plan_for(model, profile, 1 << 30)
    kernels, _ = counted(cfg, spec, plan)
    per_expert = dict(profile.kernels, wave_group=profile.kernels["wave"])
    monkeypatch.setattr(profile, "kernels", per_expert)
    wrong = plan_for(model, profile, 1 << 30)[2].per_layer["kernels"]["decode"]
    assert abs(wrong / kernels - 1) > KERNELS_WITHIN, (wrong, kernels)


def test_a_profile_without_counts_predicts_no_kernels(model):
    """A built-in profile (or one cached before the counts) predicts submissions, not kernels:
    no zero passes for a count."""
    spec = Checkpoint.open(str(model)).spec
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=BS, num_batches=N)
    plan = make_plan(as_shape(spec), load_profile("rtx3090-pcie4"), device_memory=4_000_000, host_memory=1 << 32,
                     prompt_len=32, gen_len=8, config=cfg)
    assert plan.per_layer["kernels"]["decode"] is None and plan.per_layer["submissions"]["decode"] > 0
    assert "kernels per decode layer: not counted" in format_plan(plan)
    assert '"kernels": {\n   "decode": null' in plan.to_json()
