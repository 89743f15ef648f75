"""--adaptive-gating (AdapMoE, issue 64): off, nothing changes; thresholds no share reaches,
token-identical to transformers; every second expert skipped, token-identical to transformers'
top-1 model of the same folder (the skipped pairs really drop out: fewer experts loaded); the
calibrated thresholds are saved beside the output and a resumed run takes them; a bad value is
one line."""
import json

import torch

from conftest import PROMPTS, engine_tokens, reference_tokens, requests
from klotski.assemble import open_engine
from klotski.cli import main as cli
from klotski.config import RunConfig
from klotski.execute.contract import SKIP_NONE
from klotski.schedule import gating as gating_calibration

NEW = 6
OFFLOADED = 400_000  # device bytes: most of tiny's experts stream in (98 KiB each, 16 of them)


def top1_reference(model_dir, prompts=PROMPTS, max_new_tokens=NEW):
    """transformers' Mixtral of the same folder routing each token to its top-1 expert alone
    (weight 1 after the top-k renormalisation): what skipping every second expert must give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_experts_per_tok=1).eval()
    out = []
    for p in prompts:  # one at a time: no padding to line up
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            row = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        out.append(row[:next((i for i, t in enumerate(row) if t in eos), len(row))])
    return out


def gated_run(model_dir, thresholds, **config):
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", max_new_tokens=NEW, **config)
    engine, seqs, errors = open_engine(cfg, requests(PROMPTS, NEW))
    assert not errors
    engine.pipeline.set_gating([thresholds] * engine.spec.shape.num_layers)
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine


def test_off_by_default_and_off_is_exact(checkpoints):
    model = checkpoints["gqa"]
    assert RunConfig().adaptive_gating is None
    got, engine = engine_tokens(model, max_new_tokens=NEW, adaptive_gating=None, device_memory=OFFLOADED)
    assert engine.pipeline.gating is None
    assert got == reference_tokens(model, max_new_tokens=NEW)


def test_thresholds_no_share_reaches_skip_nothing_and_stay_exact(checkpoints):
    model = checkpoints["gqa"]
    got, engine = gated_run(model, SKIP_NONE, device_memory=OFFLOADED)
    g = engine.pipeline.gating
    assert g.pairs > 0 and g.skipped == 0 and g.experts_not_loaded == 0
    assert got == reference_tokens(model, max_new_tokens=NEW)


def test_every_second_expert_skipped_is_transformers_top1_and_loads_fewer(checkpoints):
    model = checkpoints["gqa"]
    _, exact = engine_tokens(model, max_new_tokens=NEW, device_memory=OFFLOADED)
    got, engine = gated_run(model, 0.0, device_memory=OFFLOADED)
    g = engine.pipeline.gating
    assert g.skipped * 2 == g.pairs  # top-2: every token's second pair
    assert got == top1_reference(model)
    assert got != reference_tokens(model, max_new_tokens=NEW)  # (the experts differ: skipping shows)
    assert g.experts_not_loaded > 0 and g.bytes_not_loaded > 0
    assert engine.pipeline.experts_loaded < exact.pipeline.experts_loaded


def test_calibrated_thresholds_are_saved_and_a_resumed_run_takes_them(checkpoints, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    args = ["generate", str(jobs), "--model", str(checkpoints["gqa"]), "-o", str(out), "--max-new-tokens", "4",
            "--dtype", "float32", "--no-progress", "--adaptive-gating", "0.5", "--report", str(report),
            "--batch-size", "1", "--num-batches", "1"]
    assert cli.main(args) == 0
    saved = tmp_path / "out.jsonl.gating.json"
    first = json.loads(saved.read_text())
    gating = json.loads(report.read_text())["adaptive_gating"]
    assert gating["calibration"]["reused"] is False and gating["calibration"]["agreement"] >= 0.5
    assert gating["calibration"]["lines"] == len(PROMPTS)  # not the first group's one line: too few tokens
    layers = json.loads((checkpoints["gqa"] / "config.json").read_text())["num_hidden_layers"]
    assert len(first["thresholds"]) == layers and 1 <= len(first["probes"]) <= gating_calibration.MAX_PROBES
    assert json.loads(report.read_text())["config"]["adaptive_gating"] == 0.5
    records = out.read_text()
    out.write_text(records.splitlines(keepends=True)[0])  # as if the run had stopped after one line
    assert cli.main(args) == 0
    gating = json.loads(report.read_text())["adaptive_gating"]
    assert gating["calibration"]["reused"] is True and json.loads(saved.read_text()) == first
    assert sorted(out.read_text().splitlines()) == sorted(records.splitlines())  # answers as the first run did
    # thresholds are for this job, dtype and output: another job file, bf16, or --no-resume calibrate again
    other = tmp_path / "other.jsonl"
    other.write_text(jobs.read_text().replace("p0", "q0"))
    for changed in ([str(other) if a == str(jobs) else a for a in args], [*args, "--dtype", "bfloat16"],
                    [*args, "--no-resume"]):
        out.write_text("")  # every line to run again, the thresholds file kept beside
        assert cli.main(changed) == 0
        assert json.loads(report.read_text())["adaptive_gating"]["calibration"]["reused"] is False, changed


def test_a_bad_value_is_one_line(checkpoints, tmp_path, capsys):
    jobs = tmp_path / "j.jsonl"
    jobs.write_text('{"prompt": "x"}\n')
    assert cli.main(["generate", str(jobs), "--model", str(checkpoints["gqa"]), "--adaptive-gating", "1.5",
                     "-o", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--adaptive-gating" in err[0] and "[0, 1]" in err[0]


def test_the_search_goes_down_to_the_small_share_that_passes_and_refines_it():
    """Free-running agreement falls steeply with the share q of routings skipped, so at a bound
    like 0.95 only a small q passes: the search must go down to it (five halvings from 1/2
    stopped at 1/32) and refine it to its resolution within its probes."""
    calls = []

    def passes(q):
        calls.append(q)
        return q <= 0.004

    best = gating_calibration.search(passes, smallest=1e-4)
    assert len(calls) <= gating_calibration.MAX_PROBES
    assert 0.004 / gating_calibration.RESOLUTION < best <= 0.004
    assert gating_calibration.search(lambda q: False, smallest=1e-3) == 0.0  # none passes: skip nothing
    assert gating_calibration.search(lambda q: True, smallest=1e-3) == 0.5


def test_the_calibration_leaves_the_runs_counts_and_predictor_as_they_were(checkpoints):
    """The calibration decodes the first group again and again: the run's routing counts (the
    report's experts, the next plans' popularity) and its predictor's table learn none of it; a
    group with no lines skips nothing."""
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", max_new_tokens=NEW)
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS, NEW))
    try:
        pipeline = engine.pipeline
        routed, predictor = pipeline.routed.copy(), pipeline.predictor
        table = predictor.counts.clone()
        done = gating_calibration.calibrate(engine, seqs, 0.5)
        assert done["tokens"] > 0 and len(done["probes"]) >= 1
        assert (pipeline.routed == routed).all() and pipeline.predictor is predictor
        assert torch.equal(predictor.counts, table)
        none = gating_calibration.calibrate(engine, [], 0.5)
        assert set(none["thresholds"]) == {SKIP_NONE} and none["probes"] == []
    finally:
        engine.close()
