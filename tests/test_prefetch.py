"""Hot-expert predictors: exactness under every predictor, the table's life cycle, metrics."""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import engine_tokens, experts_on_host, group_keys, reference_tokens
from klotski.prefetch.cooccurrence import CooccurrenceTable
from klotski.prefetch.correlate import new_table, table_path, warmup_prompts
from klotski.prefetch.predictors import TABLE_VERSION, CorrelationPredictor, CorrelationTable
from placement.placement import Placement




@pytest.mark.parametrize("prefetch", ["correlation", "next-gate", "none"])
def test_every_predictor_gives_identical_tokens(checkpoints, prefetch):
    ours, engine = engine_tokens(checkpoints["gqa"], experts_on_host(checkpoints["gqa"]), batch_size=2,
                                 num_batches=3, prefetch=prefetch)
    assert ours == reference_tokens(checkpoints["gqa"])
    report = engine.predictor.report()
    if prefetch == "none":
        assert report["precision"] is None
    else:
        assert 0 < report["precision"] <= 1 and 0 <= report["served_share"] <= 1
        assert len(report["per_layer"]) == engine.spec.shape.num_layers


def test_nothing_is_predicted_where_every_expert_is_resident(checkpoints):
    run = lambda: engine_tokens(checkpoints["gqa"], Placement.by_kind(group_keys(checkpoints["gqa"])), batch_size=2,
                                num_batches=3, prefetch="correlation")
    table_path(run()[1].ckpt).unlink(missing_ok=True)
    ours, engine = run()
    assert ours == reference_tokens(checkpoints["gqa"])
    report = engine.predictor.report()
    assert report["precision"] is None and report["served_share"] == 0  # nothing predicted, nothing served
    assert engine.predictor.table.tokens_seen() > 0  # the routing is learnt all the same (a later run's placement)


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
    run = lambda: engine_tokens(checkpoints["gqa"], experts_on_host(checkpoints["gqa"]), prefetch="correlation",
                                batch_size=3, num_batches=1)[1]
    path = table_path(run().ckpt)
    path.unlink()
    engine = run()
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["kind"] == "exact-path" and data["path"] == 1
    assert data["num_experts"] == engine.spec.shape.num_experts
    first = sum(data["first_layer"])  # every token's top-k at layer 0, over every step of the job
    assert first >= engine.spec.shape.top_k * (engine.stats.prompt_tokens + engine.stats.generated_tokens - 6)
    run()
    assert sum(json.loads(path.read_text())["first_layer"]) == 2 * first
    assert not list(path.parent.glob(".*.tmp"))  # saved atomically, nothing half-written left


@pytest.mark.parametrize("lesson_steps,lesson_ids", [(2, 1 << 20), (64, 1 << 20), (64, 1)])
def test_routing_learnt_in_bulk_counts_what_learning_step_by_step_counts(checkpoints, monkeypatch, lesson_steps,
                                                                         lesson_ids):
    """Every expert resident: nothing predicts, so the pipeline holds the steps' routing and the
    table learns it in passes (every `lesson_steps` steps, once `lesson_ids` ids are held, and at
    each group's end); the table saved is the one a run that predicts (experts on the host) learns
    step by step, count for count."""
    from klotski.execute import pipeline
    monkeypatch.setattr(pipeline, "LESSON_STEPS", lesson_steps)
    monkeypatch.setattr(pipeline, "LESSON_IDS", lesson_ids)
    model = checkpoints["gqa"]
    saved = []
    for placement in (experts_on_host(model), Placement.by_kind(group_keys(model))):
        run = lambda: engine_tokens(model, placement, batch_size=2, num_batches=3, prefetch="correlation")[1]
        table_path(run().ckpt).unlink()
        engine = run()
        saved.append(json.loads(table_path(engine.ckpt).read_text()))
    assert engine.pipeline.K == 0 and not engine.pipeline.lessons
    step_by_step, in_bulk = saved
    assert sum(in_bulk["first_layer"]) > 0 and in_bulk["first_layer"] == step_by_step["first_layer"]
    assert in_bulk["layers"] == step_by_step["layers"]


def test_correlation_prediction_beats_chance_on_skewed_routing(tmp_path):
    """Uniform routing uses every expert, so any guess looks precise; skewed routing with a
    small group (2 x 2 sequences) does not: a wrong table would fall to chance (K/E = 0.25)."""
    from klotski.builtin.tiny import build_checkpoint
    model = build_checkpoint(tmp_path / "skewed", "tiny", routing="skewed")
    _, engine = engine_tokens(model, experts_on_host(model), prompts=warmup_prompts(8, 24), batch_size=2,
                              num_batches=2, prefetch="correlation")
    report = engine.predictor.report()
    assert report["precision"] >= 0.75      # measured 0.84-0.93
    assert report["hot_accuracy"] >= 0.5    # measured 0.65


def test_report_scores_each_group_with_the_state_it_started_in(checkpoints):
    """The first group of a cold run is scored as cold; every later group, and the first
    group of the next run, as learned from the tokens seen before it began."""
    run = lambda: engine_tokens(checkpoints["gqa"], experts_on_host(checkpoints["gqa"]), prefetch="correlation",
                                batch_size=2, num_batches=1)[1]
    table_path(run().ckpt).unlink()
    groups = run().predictor.report()["per_group"]
    assert len(groups) == 3  # 6 prompts, 2 per group
    assert groups[0]["predictor"] == "cold correlation table"
    seen = [int(g["predictor"].split("from ")[1].split()[0]) for g in groups[1:]]
    assert 0 < seen[0] < seen[1]
    assert all(0 <= g["precision"] <= 1 for g in groups)
    again = run().predictor.report()["per_group"]
    assert again[0]["predictor"].startswith("correlation table learned from ")


# ---- fine-grained MoE: 128 experts top-8 --------------------------------------------------

def _blocks(ids, width=8, experts=128):
    """[N, width] rows: token t chooses the block of `width` experts starting at ids[t] * width."""
    return torch.stack([torch.arange(width) + (b * width) % experts for b in ids])


def test_exact_path_table_for_128_experts_top_8_constructs_at_once_and_predicts():
    """Version 1 enumerated C(128, 8) ~ 1.4e12 sets at construction and never finished; now a
    table holds only the sets it has seen."""
    table = CorrelationTable(num_layers=2, num_experts=128, top_k=8, path=1)
    assert not any(table.counts) and not hasattr(table, "combo")
    learner = CorrelationPredictor(table)
    learner.begin_step()
    learner.observe(0, [_blocks([3, 3, 5])[:, torch.randperm(8)]])  # the order within a set does not matter
    learner.observe(1, [_blocks([4, 4, 9])])
    predictor = CorrelationPredictor(table)
    predictor.begin_step()
    assert predictor.predict(0, 8) == list(range(24, 32))      # the most popular block at layer 0
    predictor.observe(0, [_blocks([5])])
    assert predictor.predict(1, 8) == list(range(72, 80))      # block 5 was followed by block 9
    assert len(table.counts[1]) == 2


def test_cooccurrence_learns_which_experts_follow_which():
    """Hand-made rule: a token on block b at layer 0 takes block b + 1 at layer 1, so every
    expert of block b is followed by every expert of block b + 1 and by no other."""
    table = CooccurrenceTable(num_layers=2, num_experts=128, top_k=8)
    learner = CorrelationPredictor(table)
    for _ in range(3):
        learner.begin_step()
        blocks = [0, 3, 3, 5, 7, 15]
        learner.observe(0, [_blocks(blocks[:4]), _blocks(blocks[4:])])  # two batches of one group
        learner.observe(1, [_blocks([b + 1 for b in blocks[:4]]), _blocks([b + 1 for b in blocks[4:]])])
    assert int(table.counts[1, 24, 32]) == 3 * 2 and int(table.counts[1, 24, 40]) == 0
    predictor = CorrelationPredictor(table)
    predictor.begin_step()
    assert predictor.predict(0, 8) == list(range(24, 32))               # popularity: block 3 (x2)
    predictor.observe(0, [_blocks([3, 15, 3])])
    assert predictor.predict(1, 16) == list(range(32, 40)) + list(range(0, 8))  # block 4 (x2), then 16 -> 0
    assert predictor.state() == "co-occurrence table learned from 21 tokens"  # 3 x 6, and the 3 just seen
    assert predictor.report()["predictor"].startswith("co-occurrence table")


def test_cooccurrence_with_one_expert_per_token_is_the_exact_table():
    """With top-1 routing a set is one expert, so both tables must predict alike."""
    tables = [CorrelationTable(2, 4, 1), CooccurrenceTable(2, 4, 1)]
    for table in tables:
        learner = CorrelationPredictor(table)
        for first in ([[0], [0], [2], [1]], [[3], [2], [2], [0]]):
            learner.begin_step()
            first = torch.tensor(first)
            learner.observe(0, [first])
            learner.observe(1, [(first + 1) % 4])
    predictions = []
    for table in tables:
        predictor = CorrelationPredictor(table)
        predictor.begin_step()
        predictions.append(predictor.predict(0, 2))
        predictor.observe(0, [torch.tensor([[2], [2], [1]])])
        predictions.append(predictor.predict(1, 2))
    assert predictions[:2] == predictions[2:] == [[0, 2], [3, 2]]


@pytest.mark.parametrize("make", [lambda: CorrelationTable(3, 128, 8, path=2), lambda: CooccurrenceTable(3, 128, 8)])
def test_tables_survive_a_save_and_load(tmp_path, make):
    table = make()
    learner = CorrelationPredictor(table)
    for step in range(2):
        learner.begin_step()
        for layer in range(3):
            learner.observe(layer, [_blocks([step, layer + step, 7, 12])])
    path = tmp_path / "table.json"
    table.save(path, "model-key")
    spec = SimpleNamespace(num_layers=3, num_experts=128, top_k=8)
    loaded = type(table).load(path, spec)
    assert json.loads(path.read_text())["version"] == TABLE_VERSION == 2
    assert loaded.to_json("model-key") == table.to_json("model-key")
    before, after = CorrelationPredictor(table), CorrelationPredictor(loaded)
    for p in (before, after):
        p.begin_step()
        p.observe(0, [_blocks([1, 7])])
        p.observe(1, [_blocks([1, 7])])
    # block 1 was followed by block 1 (and, at one layer of history, also by block 2); block 7 by itself
    assert before.predict(2, 16) == after.predict(2, 16)
    assert sorted(before.predict(2, 16)) == list(range(8, 16)) + list(range(56, 64))
    other = CooccurrenceTable if isinstance(table, CorrelationTable) else CorrelationTable
    with pytest.raises(ValueError, match="table kind"):
        other.load(path, spec)
    with pytest.raises(ValueError, match="layers/experts/top-k"):
        type(table).load(path, SimpleNamespace(num_layers=3, num_experts=64, top_k=8))


def test_the_table_kind_follows_the_number_of_expert_sets():
    shape = lambda e, k: SimpleNamespace(num_layers=48, num_experts=e, top_k=k)
    assert type(new_table(shape(8, 2))) is CorrelationTable      # Mixtral: 28 sets
    assert type(new_table(shape(16, 4))) is CorrelationTable     # 1820 sets
    assert type(new_table(shape(64, 6))) is CooccurrenceTable
    assert type(new_table(shape(128, 8))) is CooccurrenceTable   # Qwen3-MoE


def test_an_old_version_table_is_ignored_with_a_warning_and_replaced(checkpoints, capsys):
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(checkpoints["gqa"])
    path = table_path(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "model": ckpt.key, "num_layers": ckpt.spec.shape.num_layers,
                                "num_experts": ckpt.spec.shape.num_experts, "top_k": ckpt.spec.shape.top_k, "path": 1,
                                "first_layer": [5.0] * ckpt.spec.shape.num_experts,
                                "layers": [{"27": [1.0] * ckpt.spec.shape.num_experts}] * ckpt.spec.shape.num_layers}))
    _, engine = engine_tokens(checkpoints["gqa"], prefetch="correlation", batch_size=3, num_batches=1)
    err = capsys.readouterr().err
    assert "ignoring the expert-correlation table" in err and "version 1, expected 2" in err
    assert "no expert-correlation table for this model yet" not in err  # one line, not two
    assert engine.predictor.report()["per_group"][0]["predictor"] == "cold correlation table"
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["kind"] == "exact-path"


def test_a_fine_grained_model_runs_the_cooccurrence_table_and_stays_exact(tmp_path):
    from klotski.builtin.tiny import build_checkpoint
    model = build_checkpoint(tmp_path / "fine", "tiny", routing="skewed", num_local_experts=128,
                             num_experts_per_tok=8, intermediate_size=16, num_hidden_layers=2)
    prompts = warmup_prompts(4, 12)
    run = lambda prefetch: engine_tokens(model, experts_on_host(model), prompts=prompts, max_new_tokens=4,
                                         batch_size=2, num_batches=1, prefetch=prefetch)
    plain, _ = run("none")
    ours, engine = run("correlation")
    assert ours == plain
    report = engine.predictor.report()
    assert report["predictor"].startswith("co-occurrence table")
    assert [g["predictor"] for g in report["per_group"]][0] == "cold co-occurrence table"
    assert report["per_group"][1]["predictor"].startswith("co-occurrence table learned from ")
    assert 0 < report["precision"] <= 1
    data = json.loads(table_path(engine.ckpt).read_text())
    assert data["kind"] == "co-occurrence" and len(data["counts"][1]) == 128


def test_a_cooccurrence_file_of_the_wrong_size_is_refused(tmp_path):
    table = CooccurrenceTable(2, 16, 4)
    data = table.to_json("model-key")
    data["counts"] = data["counts"][:1]
    (tmp_path / "t.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="co-occurrence counts of shape"):
        CooccurrenceTable.load(tmp_path / "t.json", SimpleNamespace(num_layers=2, num_experts=16, top_k=4))


def _planned_distinct_experts(capsys, model) -> float:
    """`klotski plan`'s expected distinct experts per decode layer step for `model` (a 3090)."""
    from klotski.cli import main as cli
    capsys.readouterr()
    assert cli.main(["plan", "--model", str(model), "--hardware", "rtx3090-pcie4", "--batch-size", "4",
                     "--num-batches", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["per_layer"]["expected_distinct_experts"]


def test_a_learned_table_puts_the_most_picked_experts_on_the_device(tmp_path, capsys):
    """The plan prices every expert alike and places expert slots; once the model's correlation
    table has seen a job, slot i of each layer is that layer's i-th most picked expert, so the
    experts the plan keeps resident are the ones the tokens pick most: fewer moved, the same
    tokens (on the realdims Qwen3 shape, skewed: decode bytes over the link 106 -> 33 MB); the
    plan prices the routing the table saw, and `klotski plan` too."""
    from klotski.builtin import tiny
    from klotski.prefetch.correlate import learned_routing
    model = tiny.build_checkpoint(tmp_path / "skewed", "tiny", routing="skewed", num_local_experts=8,
                                  num_experts_per_tok=2)
    from klotski.io.checkpoint import Checkpoint
    table_path(Checkpoint.open(str(model))).unlink(missing_ok=True)  # (tables are keyed by content)
    budget = int(3_614_976 * 0.6)  # of the model's bytes: some experts resident, the rest streamed
    uniform = _planned_distinct_experts(capsys, model)
    first, engine = engine_tokens(model, device_memory=budget, max_new_tokens=8)
    assert engine.setup.expert_ranking is None  # nothing learned yet: slot i is expert i
    ranking, picks = learned_routing(engine.ckpt)
    assert ranking and picks.shape == (engine.ckpt.spec.shape.num_layers, 8)
    again, engine = engine_tokens(model, device_memory=budget, max_new_tokens=8)
    assert again == first == reference_tokens(model, max_new_tokens=8)
    assert engine.setup.expert_ranking == ranking
    # the plan priced the table's routing over its slots: slot 0, each layer's most picked, first
    routing = engine.setup.planned_routing
    assert routing == sorted(routing, reverse=True) and routing[0] > 2 / 8, routing
    # `klotski plan` prices the same routing: skewed, 4 sequences reach fewer distinct experts
    assert _planned_distinct_experts(capsys, model) < uniform
    tiers = engine.setup.placement.tiers
    for layer, order in ranking.items():
        resident = {e for e in range(len(order)) if tiers["expert", layer, e] == "device"}
        assert resident == set(order[:len(resident)]), f"layer {layer}: resident {resident}, most picked {order}"


def test_the_plans_expert_slots_go_to_the_experts_a_ranking_names():
    """engine_placement: the plan's slot i of a ranked layer is that layer's i-th expert of the
    ranking (the plan keeps slots 0 and 1 resident: experts 2 and 0 here); unranked layers keep
    slot i = expert i."""
    from klotski.planning import engine_placement
    tiers = {("embed",): "host", ("head",): "device"}
    for j in range(2):
        tiers.update({("attn", j): "device", ("gate", j): "device"})
        tiers.update({("expert", j, e): "device" if e < 2 else "host" for e in range(4)})
    plan = SimpleNamespace(group_tiers=lambda layers, experts: (dict(tiers), "device"))
    spec = SimpleNamespace(shape=SimpleNamespace(num_layers=2, num_experts=4, experts_in=lambda j: 4))
    placed = engine_placement(plan, spec, {0: [2, 0, 3, 1]}).tiers
    assert [placed["expert", 0, e] for e in range(4)] == ["device", "host", "device", "host"]
    assert [placed["expert", 1, e] for e in range(4)] == ["device", "device", "host", "host"]
