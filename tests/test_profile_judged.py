"""A measured profile is judged before it is cached (planner/profile_checks.py): the load read
through the whole measure, the samples checked against each other and the disagreeing ones
measured again. The disturbances here are synthetic: ops that sleep their roofline time (rates
chosen here, not the cost model's fit), slowed 20x where a disturbance is injected, and a fake
load reader; nothing spins."""
from __future__ import annotations

import time

import pytest

from planner import profile as P
from planner import profile_checks
from planner.costmodel import CostModel
from planner.profile import Profile, measure
from planner.shapes import ModelShape

SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, num_experts=4, top_k=2, vocab_size=128, dtype="float32")
GRID = dict(batch_sizes=(1, 2), context_lengths=(8,), token_counts=(1, 4), reps=3, io_bytes=1 << 20)
FLOPS, BYTES, FIXED = 2e8, 1e8, 1e-3   # the fake machine: ops take ~1-3 ms
SLOW = 20.0


class FakeOps:
    """An ops factory whose ops sleep their roofline time on the fake machine. `slow(kind,
    point, made)` says whether the `made`-th time this point's op is prepared (0, 1, 2: the three
    rounds; 3 on: re-measures) runs under a disturbance."""
    key = "fake"

    def __init__(self, slow=lambda kind, point, made: False, disturbed=None, factor=SLOW):
        self.slow, self.made, self.factor = slow, {}, factor
        self.disturbed = disturbed if disturbed is not None else {"now": False}
        self.unit = CostModel(Profile(name="unit", flops=1.0, mem_bw=1.0, links={}), SHAPE)

    def __call__(self, shape, dtype, device):
        return self

    def _op(self, kind, point):
        key = (kind, tuple(point))
        made = self.made[key] = self.made.get(key, -1) + 1
        flops, nbytes = self.unit.work(kind, point)
        seconds = max(flops / FLOPS, nbytes / BYTES) + FIXED

        def run():
            time.sleep(seconds * (self.factor if self.slow(kind, point, made) or self.disturbed["now"] else 1.0))
        return run

    def attention(self, bs, ctx, new):
        return self._op("attention", (bs, ctx, new))

    def gate(self, n):
        return self._op("gate", (n,))

    def expert(self, n):
        return self._op("expert", (n,))

    def head(self, n):
        return self._op("head", (n,))

    def dequant(self):
        return self._op("dequant", (SHAPE.expert_params,))


def _measure(tmp_path, ops, busy=None):
    return measure(SHAPE, ops=ops, cache_dir=tmp_path, io_dir=tmp_path, busy=busy, **GRID)


def _cached(tmp_path):
    return list(tmp_path.glob("*.json"))


def _times(prof):
    cm = CostModel(prof, SHAPE)
    return {"decode attention": cm.t_attn(2, 8), "prefill attention": cm.t_attn(1, 8, 8), "gate": cm.t_gate(3),
            "expert": cm.t_expert(3), "head": cm.t_head(2)}


def test_the_issue_s_profile_breaks_its_own_shape():
    """Attention for one sequence at 128 keys 56 ms beside 4 sequences at 512 keys 0.58 ms (the
    issue's cached profile): the smaller point is blamed; the quiet profile's pair is not."""
    unit = CostModel(Profile(name="unit", flops=1.0, mem_bw=1.0, links={}), SHAPE)
    bad = {"attention": [[1, 128, 1, 56e-3], [4, 512, 1, 0.58e-3]]}
    assert profile_checks.disagreements(bad, unit.work) == {("attention", 0)}
    quiet = {"attention": [[1, 128, 1, 0.21e-3], [4, 512, 1, 0.58e-3]]}
    assert profile_checks.disagreements(quiet, unit.work) == set()
    # a bigger point far slower than its work grows is blamed too (1 -> 4 tokens: 4x the FLOPs, not 200x)
    grown = {"expert": [[1, 1e-3], [4, 200e-3]]}
    assert profile_checks.disagreements(grown, unit.work) == {("expert", 1)}


def test_a_quiet_measure_is_cached_and_says_so(tmp_path):
    prof = _measure(tmp_path, FakeOps(), busy=lambda: None)
    assert prof.judged["cached"] and prof.judged["checks"]["still"] == []
    assert prof.judged["verdict"].startswith("cached: quiet")
    assert len(_cached(tmp_path)) == 1


def test_load_that_starts_midway_keeps_the_profile_out_of_the_cache(tmp_path, monkeypatch):
    """Two processes start spinning after the first round (the fake reader sees them from then on,
    and every op runs slower): quiet before, busy after. The old guard read the load after
    the measure only when it was busy before, and cached this profile."""
    monkeypatch.setattr(profile_checks, "WATCH_EVERY_S", 0.0)  # read between every op (the fake measure is short)
    disturbed = {"now": False}
    ops = FakeOps(disturbed=disturbed, factor=3.0)  # all ops alike: no shape check can see it
    reads = []

    def reader():
        reads.append(disturbed["now"])
        return 2.0 if disturbed["now"] else None
    original = P.time_points

    def rounds(points, reps, sync, watch=None, calls=[0]):  # the spinners start with the second round
        calls[0] += 1
        disturbed["now"] = calls[0] > 1
        return original(points, reps, sync, watch)
    monkeypatch.setattr(P, "time_points", rounds)
    prof = _measure(tmp_path, ops, busy=reader)
    assert reads[0] is False and reads[-1] is True  # quiet when the measure started
    assert not _cached(tmp_path) and not prof.judged["cached"]
    assert "other processes held the cores" in prof.judged["verdict"]
    assert prof.machine["busy_runnable_threads"] == 2.0


@pytest.mark.parametrize("lasting", [False, True])
def test_a_burst_the_reader_misses_is_measured_again(tmp_path, lasting):
    """A burst slows decode attention at one sequence and the expert at one token in two of the
    three rounds (their medians disturbed) while the load reader saw nothing: the shape checks
    blame them and they are timed again. Burst over by then: the profile is within 2x of a quiet
    one at every sample, its op times within 25%, and cached. Burst still on: not cached."""
    quiet = _measure(tmp_path / "quiet", FakeOps(), busy=lambda: None)
    hit = {("attention", (1, 8, 1)), ("expert", (1,))}

    def slow(kind, point, made):
        return (kind, tuple(point)) in hit and (made in (1, 2) or (lasting and made >= 3))
    prof = _measure(tmp_path / "burst", FakeOps(slow=slow), busy=lambda: None)
    checks = prof.judged["checks"]
    assert checks["disagreed"] >= 2 and checks["remeasured"] >= 2
    if lasting:
        assert not _cached(tmp_path / "burst") and checks["still"]
        assert "still disagree" in prof.judged["verdict"]
        return
    assert checks["still"] == [] and len(_cached(tmp_path / "burst")) == 1
    for kind, rows in quiet.samples.items():
        for q, b in zip(rows, prof.samples[kind]):
            assert 0.5 < b[-1] / q[-1] < 2.0, (kind, q, b)
    expected, got = _times(quiet), _times(prof)
    for name in expected:
        assert abs(got[name] / expected[name] - 1) < 0.25, (name, got[name], expected[name])


def test_one_slow_first_call_does_not_decide_the_repetitions():
    """A 0.6 s first call (a disturbance) of an op that takes 10 ms: more calls follow, and the
    sample is the op's own time, not the disturbed call's."""
    durations = iter([0.0, 0.6] + [0.01] * 10)
    sample = P.time_op(lambda: time.sleep(next(durations)), 5, lambda: None)
    assert sample < 0.1
