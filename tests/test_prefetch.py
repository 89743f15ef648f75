"""Hot-expert predictors: exactness under every predictor, the table's life cycle, metrics."""
import json

import pytest
import torch

from conftest import engine_tokens, reference_tokens
from klotski.correlate import table_path, warmup_prompts
from klotski.prefetch import CorrelationPredictor, CorrelationTable


@pytest.mark.parametrize("prefetch", ["correlation", "next-gate", "none"])
def test_every_predictor_gives_identical_tokens(checkpoints, prefetch):
    ours, engine = engine_tokens(checkpoints["gqa"], batch_size=2, num_batches=3, prefetch=prefetch)
    assert ours == reference_tokens(checkpoints["gqa"])
    report = engine.predictor.report()
    if prefetch == "none":
        assert report["precision"] is None
    else:
        assert 0 < report["precision"] <= 1 and 0 <= report["served_share"] <= 1
        assert len(report["per_layer"]) == engine.spec.num_layers


def test_table_counts_paths_and_predicts_the_followers():
    """Hand-made routing: expert e at layer 0 is always followed by expert e+1 (mod 4) at layer 1."""
    table = CorrelationTable(num_layers=2, num_experts=4, top_k=1, path=1)
    recorder = CorrelationPredictor(table)
    for _ in range(3):
        recorder.begin_step()
        first = torch.tensor([[0], [0], [2], [1]])
        recorder.observe(0, [first])
        recorder.observe(1, [(first + 1) % 4])
    predictor = CorrelationPredictor(table)
    predictor.begin_step()
    assert predictor.predict(0, 1) == [0]                # popularity at layer 0
    predictor.observe(0, [torch.tensor([[2], [2], [1]])])
    assert predictor.predict(1, 2) == [3, 2]             # followers of 2 (x2) then of 1


def test_table_is_learned_from_the_job_and_saved_for_the_next_run(checkpoints):
    """No warm-up run: a run without a table starts empty, learns from its own gates and
    saves the table; the next run starts from it and adds what it sees (the same job adds
    the same counts: predictions never change the numbers)."""
    run = lambda: engine_tokens(checkpoints["gqa"], prefetch="correlation", batch_size=3, num_batches=1)[1]
    path = table_path(run().ckpt)
    path.unlink()
    engine = run()
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["path"] == 1 and data["num_experts"] == engine.spec.num_experts
    first = sum(data["first_layer"])  # every token's top-k at layer 0, over every step of the job
    assert first >= engine.spec.top_k * (engine.stats.prompt_tokens + engine.stats.generated_tokens - 6)
    run()
    assert sum(json.loads(path.read_text())["first_layer"]) == 2 * first
    assert not list(path.parent.glob(".*.tmp"))  # saved atomically, nothing half-written left


def test_correlation_prediction_beats_chance_on_skewed_routing(tmp_path):
    """Uniform routing uses every expert, so any guess looks precise; skewed routing with a
    small group (2 x 2 sequences) does not: a wrong table would fall to chance (K/E = 0.25)."""
    from klotski.tiny import build_checkpoint
    model = build_checkpoint(tmp_path / "skewed", "tiny", routing="skewed")
    _, engine = engine_tokens(model, prompts=warmup_prompts(8, 24), batch_size=2, num_batches=2,
                              prefetch="correlation")
    report = engine.predictor.report()
    assert report["precision"] >= 0.75      # measured 0.84-0.93
    assert report["hot_accuracy"] >= 0.5    # measured 0.65


def test_report_scores_each_group_with_the_state_it_started_in(checkpoints):
    """The first group of a cold run is scored as cold; every later group, and the first
    group of the next run, as learned from the tokens seen before it began."""
    run = lambda: engine_tokens(checkpoints["gqa"], prefetch="correlation", batch_size=2, num_batches=1)[1]
    table_path(run().ckpt).unlink()
    groups = run().predictor.report()["per_group"]
    assert len(groups) == 3  # 6 prompts, 2 per group
    assert groups[0]["predictor"] == "cold correlation table"
    seen = [int(g["predictor"].split("from ")[1].split()[0]) for g in groups[1:]]
    assert 0 < seen[0] < seen[1]
    assert all(0 <= g["precision"] <= 1 for g in groups)
    again = run().predictor.report()["per_group"]
    assert again[0]["predictor"].startswith("correlation table learned from ")
