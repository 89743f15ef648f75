"""Shared prompt prefixes priced (issue 61, part 3): the engine prefills each shared segment
once and every line only its own tokens after it; the plan prices that job, not the job
without the prefix cache (three interleaved rubrics before 48 lines were predicted at 5.4
tok/s where the run measured 29.9)."""
from __future__ import annotations

from types import SimpleNamespace

from klotski import planning
from klotski.config import RunConfig
from planner.costmodel import CostModel
from planner.prediction import segments_s
from planner.profile import Profile
from planner.shapes import ModelShape
from planner.solve import Budgets, solve

SHAPE = ModelShape(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=64, num_experts=8, top_k=2, vocab_size=1000, dtype="float32")
PROFILE = Profile(name="p", flops=2e10, mem_bw=1e10, links={"host_to_device": 5e9, "disk_to_host": 1e9,
                                                            "device_to_host": 5e9})
RUBRIC, ITEM, LINES = 300, 20, 48


def test_a_segment_is_prefilled_in_chunked_passes_over_the_keys_before_it():
    passes = []
    segments_s([(300, 300), (340, 40)], 128, lambda k, ctx, new: passes.append((k, ctx, new)) or 1.0)
    assert passes == [(1, 128, 128), (1, 256, 128), (1, 300, 44), (1, 340, 40)]


def _plan(prompt_lens, segments=(), bs=16):
    cm = CostModel(PROFILE, SHAPE)
    lines = len(prompt_lens)
    return solve(SHAPE, cm, Budgets(device=64 << 30, host=64 << 30), prompt_len=round(sum(prompt_lens) / lines),
                 gen_len=8, gen_lens=[8] * lines, prompt_lens=prompt_lens, batch_sizes=(bs,), num_batches=1,
                 batching="static", segments=segments)


def test_a_job_whose_lines_share_rubrics_is_priced_as_the_prefix_cache_runs_it():
    whole = _plan([RUBRIC + ITEM] * LINES)
    shared = _plan([ITEM] * LINES, [(RUBRIC, RUBRIC)] * 3)
    own_only = _plan([ITEM] * LINES)
    # the rubrics' prefill is paid three times, not 48: far less than the whole prompts', more than none
    assert own_only.job_prefill_s < shared.job_prefill_s < whole.job_prefill_s / 4
    three = shared.job_prefill_s - own_only.job_prefill_s
    one_row = _plan([RUBRIC], bs=1).job_prefill_s  # a job of one line, the rubric: its prefill
    assert 0.5 < three / (3 * one_row) < 2.0  # each segment about a one-row prefill of its tokens
    assert shared.predicted_tokens_per_s > 2 * whole.predicted_tokens_per_s


def test_the_plan_finds_the_segments_the_prefix_cache_will():
    rubrics = [[1000 + r] * RUBRIC for r in range(3)]
    seqs = [SimpleNamespace(prompt_ids=rubrics[i % 3] + [i] * ITEM) for i in range(LINES)]
    spec = SimpleNamespace(family=SimpleNamespace(SHARED_PREFIX=True),
                           shape=SimpleNamespace(model_type="mixtral", num_layers=2), window=lambda j: None)
    own, segments = planning.shared_prefixes(RunConfig(), spec, seqs)
    assert own == [ITEM] * LINES and sorted(segments) == [(RUBRIC, RUBRIC)] * 3
    off = planning.shared_prefixes(RunConfig(prefix_cache=False), spec, seqs)
    assert off == ([RUBRIC + ITEM] * LINES, [])
