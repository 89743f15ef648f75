"""Runs correct the profile (planner/calibrate.py, klotski/planning.py: learn_from_run): a run
on a quiet machine refits the terms it exercised, weighted by how much of each phase they
explain, so the next prediction starts from what was measured; a busy run corrects nothing;
`klotski profile --show` says where each term came from.

The runs here are synthetic: a phase's time is a sum of the cost model's op times written out
below, and the machine's truth is that sum with attention 0.7x and the expert 1.5x what the
profile says (planted here, not by the code under test)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from klotski import learning, planning
from klotski.cli import main as cli
from klotski.config import RunConfig
from planner import calibrate
from planner.costmodel import CostModel
from planner.profile import Profile
from planner.shapes import ModelShape

SHAPE = ModelShape(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=64, num_experts=8, top_k=2, vocab_size=1000, dtype="float32")
TRUTH = {"attention": 0.7, "expert": 1.5}


def phases(cm: CostModel, attention: float = 1.0, expert: float = 1.0) -> dict:
    """A job's prefill and decode seconds: 8 sequences, 64-token prompts, 16 new tokens; the
    link's transfers beside compute in prefill."""
    L = SHAPE.num_layers
    prefill = L * (attention * cm.t_attn(8, 64, 64) + cm.t_gate(512) + expert * 8 * cm.t_expert(128)
                   + cm.t_io(cm.expert_bytes)) + cm.t_head(8)
    decode = 16 * (L * (attention * cm.t_attn(8, 72) + cm.t_gate(8) + expert * 8 * cm.t_expert(2)) + cm.t_head(8))
    return {"prefill": prefill, "decode": decode}


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A cached profile file, and learn_from_run's planning seams pointed at it: the replay is
    `phases` at the profile it is handed."""
    path = tmp_path / "profile.json"
    prof = Profile(name="measured-x", flops=2e10, mem_bw=1e10, links={"host_to_device": 5e9, "disk_to_host": 1e9,
                                                                       "device_to_host": 5e9},
                   shape_key=SHAPE.key(), judged={"verdict": "cached: quiet in 9 load reads, samples agree"})
    path.write_text(prof.to_json())

    def profile_for(*a, **kw):
        p = Profile.from_json(path.read_text())
        p.cached_at = str(path)
        return p

    def replayed_plan(config, ckpt, setup, prompt_lens, gen_lens, pipeline_cost=None, popularity=None, profile=None,
                      **kw):
        times = phases(CostModel(profile, SHAPE))
        return SimpleNamespace(job_prefill_s=times["prefill"], job_decode_s=times["decode"])
    monkeypatch.setattr(planning, "profile_for", profile_for)
    monkeypatch.setattr(planning, "replayed_plan", replayed_plan)
    monkeypatch.setattr(planning, "compute_shape", lambda ckpt, dtype, kept=False: SHAPE)
    measured = phases(CostModel(prof, SHAPE), **TRUTH)
    setup = SimpleNamespace(plan=object(), dtype=torch.float32, device=torch.device("cpu"))

    def run(busy=False, skip=None):
        return learning.learn_from_run(RunConfig(), None, setup, [64] * 8, [16] * 8, measured, busy=busy, skip=skip)
    return SimpleNamespace(path=path, run=run, measured=measured, load=profile_for)


def _errors(machine) -> dict:
    predicted = phases(CostModel(machine.load(), SHAPE))
    return {k: predicted[k] / machine.measured[k] - 1 for k in predicted}


def test_one_quiet_run_brings_the_next_prediction_within_a_fifth(machine):
    before = _errors(machine)
    assert before["decode"] < -0.2 or before["prefill"] < -0.2  # the measured profile is off
    section = machine.run()
    assert section["corrected"] and section["judged"].startswith("cached: quiet")
    after = _errors(machine)
    assert all(abs(e) < 0.2 for e in after.values()), after
    factors = section["factors"]
    # the term that explains most of the miss moved most (one job's two phases cannot tell every term apart)
    assert factors["expert"] > 1.15 and abs(factors["expert"] - 1) > abs(factors["attention"] - 1)
    # a term the run barely exercised stays near the measurement
    assert abs(factors.get("dequant", 1.0) - 1.0) < 0.01
    # evidence accumulates: three runs bring it closer still
    machine.run()
    machine.run()
    assert all(abs(e) < 0.05 for e in _errors(machine).values()), _errors(machine)
    assert json.loads(machine.path.read_text())["calibration"]["runs"] == 3


def test_a_phase_the_plan_does_not_price_is_reported_not_learned(machine):
    """A prefill shortened by shared prefixes (which the plan does not price) teaches nothing:
    only the decode phase becomes evidence."""
    section = machine.run(skip={"prefill": "shared prompt prefixes were prefilled once"})
    assert section["corrected"] and "shared" in section["phases"]["prefill"]["not_learned"]
    evidence = json.loads(machine.path.read_text())["calibration"]["evidence"]
    assert [o["phase"] for o in evidence] == ["decode"]


def test_a_busy_run_corrects_nothing(machine):
    before = machine.path.read_text()
    section = machine.run(busy=True)
    assert not section["corrected"] and "busy" in section["why"]
    assert machine.path.read_text() == before


def test_the_refit_is_the_ridge_solution():
    """One term explaining all of a phase measured 1.3x: x = e·y / (e² + PRIOR), by hand."""
    obs = calibrate.observation("decode", 1.3, 1.0, {"expert": 1.0}, {})
    assert calibrate.refit([obs])["expert"] == pytest.approx(math.exp(math.log(1.3) / (1 + calibrate.PRIOR)))
    # relative to the uncorrected profile: a run predicted with the factor already at 1.3 and
    # measured as predicted is evidence of 1.3 again, not of 1
    again = calibrate.observation("decode", 1.3, 1.3, {"expert": 1.0}, {"expert": 1.3})
    assert again["y"] == pytest.approx(math.log(1.3))


def test_factors_scale_the_terms_they_name():
    prof = Profile(name="p", flops=2e10, mem_bw=1e10, links={"host_to_device": 5e9, "disk_to_host": 1e9,
                                                            "device_to_host": 5e9},
                   shape_key=SHAPE.key(), overhead_s={"batch_layer": 1e-4})
    plain = CostModel(prof, SHAPE)
    prof.calibration = {"factors": {"expert": 2.0, "host_to_device": 3.0, "pipeline": 0.5}}
    cm = CostModel(prof, SHAPE)
    assert cm.t_expert(4) == pytest.approx(2 * plain.t_expert(4))
    assert cm.t_wave(4, 16) == pytest.approx(2 * plain.t_wave(4, 16))
    assert cm.t_io(1e6) == pytest.approx(3 * plain.t_io(1e6))
    assert cm.t_pipeline(batch_layers=10) == pytest.approx(0.5 * plain.t_pipeline(batch_layers=10))
    assert cm.t_attn(4, 64) == pytest.approx(plain.t_attn(4, 64))
    # a profile measured at other shapes is not this model's: its factors do not apply either
    other = CostModel(prof, SHAPE.__class__(**{**SHAPE.__dict__, "num_layers": 2, "hidden_size": 128}))
    assert other.factors == {}


def test_profile_show_says_where_each_term_came_from(machine, monkeypatch, capsys):
    machine.run()
    monkeypatch.setattr(planning, "measure_here", lambda *a, **kw: machine.load())
    assert cli.main(["profile", "--show"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "refitted from 1 run" in lines["expert"] and "+" in lines["expert"]
    assert lines["dequant"].rstrip().endswith("measured")
    assert "cached: quiet" in lines["judged"]


def test_one_disturbed_run_among_quiet_ones_counts_less():
    """A first run 2.5x slow (disturbed in a way its busy check missed), then three measured as
    the profile says: the factor stays near 1, not the mean's 2.5^(1/4) = 1.26."""
    quiet = [calibrate.observation("decode", 1.0, 1.0, {"expert": 1.0}, {}) for _ in range(3)]
    disturbed = calibrate.observation("decode", 2.5, 1.0, {"expert": 1.0}, {})
    assert abs(calibrate.refit([disturbed, *quiet])["expert"] - 1) < 0.1
