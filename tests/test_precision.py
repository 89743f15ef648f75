"""The planner weighs precision (issue 39): `klotski plan` plans every precision the model can
take and prints each; `--quantize auto` takes the fastest option predicting >= 1.3x the exact
one, `none` (the default) stays exact; a run under auto says which it took and why."""
import json

import pytest

from klotski.cli import main as cli
from planner.precision import AUTO_SPEEDUP, Precision, QualityBound, Weighed, choose


def _plan_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["precision"]


def _by_name(precision: dict) -> dict:
    return {o["name"]: o for o in precision["options"]}


def test_auto_takes_4_bit_for_mixtral_8x22b_on_a_3090(capsys):
    args = ["--model", "mixtral-8x22b", "--hardware", "rtx3090-pcie4", "--host-memory", "256GiB", "--quantize", "auto"]
    p = _plan_json(capsys, *args)
    opts = _by_name(p)
    assert set(opts) == {"bfloat16", "hqq4"} and p["chosen"] == "hqq4" and p["quantize"] == "hqq4"
    assert opts["hqq4"]["tokens_per_s"] >= AUTO_SPEEDUP * opts["bfloat16"]["tokens_per_s"]
    assert opts["hqq4"]["link_bytes_per_step"] < opts["bfloat16"]["link_bytes_per_step"]
    assert cli.main(["plan", *args]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert any(line.startswith("  bfloat16") for line in lines) and any(line.startswith("* hqq4") for line in lines)
    assert "chosen: hqq4: --quantize auto: hqq4 predicts" in text and "weights HQQ 4-bit" in text


def test_auto_keeps_16_bit_on_an_h800_unless_4_bit_pays(capsys):
    p = _plan_json(capsys, "--model", "mixtral-8x7b", "--hardware", "h800-pcie5", "--quantize", "auto")
    opts = _by_name(p)
    pays = opts["hqq4"]["tokens_per_s"] >= AUTO_SPEEDUP * opts["bfloat16"]["tokens_per_s"]
    assert p["chosen"] == ("hqq4" if pays else "bfloat16")
    assert not pays and "bfloat16 kept" in p["why"]  # on this profile 4-bit is slower (dequantization)


def test_none_is_the_default_and_exact_but_every_option_is_shown(capsys):
    args = ["--model", "mixtral-8x22b", "--hardware", "rtx3090-pcie4", "--host-memory", "256GiB"]
    default, none = _plan_json(capsys, *args), _plan_json(capsys, *args, "--quantize", "none")
    assert default == none
    assert none["chosen"] == "bfloat16" and none["quantize"] == "none" and "--quantize none" in none["why"]
    assert {o["name"] for o in none["options"]} == {"bfloat16", "hqq4"}


def test_quality_costs_come_from_the_committed_table(capsys):
    from klotski import planning
    table = planning.quality_table()
    assert table is not None and table["model"] == "smollm2-moe"
    rows = table["options"]
    assert all(0 <= rows[r]["agreement"] <= 1 for r in ("hqq4", "Q8_0", "Q4_0"))
    for four in ("hqq4", "Q4_0"):  # 4 bits cost more than 8
        assert rows[four]["logprob_gap"] > rows["Q8_0"]["logprob_gap"] and rows[four]["agreement"] < rows["Q8_0"]["agreement"]
    p = _plan_json(capsys, "--model", "mixtral-8x7b", "--hardware", "h800-pcie5")
    where = {"measured_on": "smollm2-moe vs float32 (the checkpoint as stored)"}
    assert _by_name(p)["hqq4"]["quality"] == {**table["options"]["hqq4"], **where}
    # the checkpoint's own precision is labelled by its measured quality too, not "reference"
    assert _by_name(p)["bfloat16"]["quality"] == {**table["options"]["bfloat16"], **where}


class _Plan:
    def __init__(self, tps):
        self.predicted_tokens_per_s = tps


def _weighed(exact_tps, other_tps):
    exact = Weighed(Precision("bfloat16", exact=True), plan=_Plan(exact_tps) if exact_tps else None,
                    refusal="" if exact_tps else "device budget too small")
    other = Weighed(Precision("hqq4", quantize="hqq4", quant_bits=4), plan=_Plan(other_tps) if other_tps else None)
    return [exact, other]


@pytest.mark.parametrize("exact, four, mode, chosen", [
    (10.0, 13.0, "auto", "hqq4"),        # exactly 1.3x: pays
    (10.0, 12.9, "auto", "bfloat16"),    # just under
    (10.0, 50.0, "none", "bfloat16"),    # none stays exact whatever 4-bit predicts
    (10.0, 5.0, "hqq4", "hqq4"),         # set by hand
    (None, 5.0, "auto", "hqq4"),         # the exact plan does not fit: the fastest that does
    (None, None, "auto", "bfloat16"),    # nothing fits: the exact option, whose refusal is raised
])
def test_choose(exact, four, mode, chosen):
    picked, why = choose(_weighed(exact, four), mode)
    assert picked.option.name == chosen and why


def test_generate_under_auto_runs_the_precision_it_took_and_says_why(checkpoints, tmp_path):
    """A tight device budget and a slow emulated link: whichever precision the measured profile
    favours, the run takes what the 1.3x rule says, runs it (tokens equal that precision's own
    run) and its report says which and why."""
    from conftest import engine_tokens
    from klotski.schedule.report import build_report, summary
    model = checkpoints["gqa"]
    _, probe = engine_tokens(model, prompts=["x"], max_new_tokens=1)
    budget = dict(device_memory=sum(probe.cache.full.values()) // 3, emulate_link_gbps=0.2,
                  offload_dir=str(tmp_path / "q"), batch_size=3, num_batches=2)
    auto, engine = engine_tokens(model, quantize="auto", close=False, **budget)
    p = engine.setup.plan.precision
    opts = _by_name(p)
    exact = opts["float32"]["tokens_per_s"]
    pays = exact is None or opts["hqq4"]["tokens_per_s"] >= AUTO_SPEEDUP * exact
    assert engine.setup.quantize == p["quantize"] == ("hqq4" if pays else "none")
    assert engine.config.quantize == p["quantize"]  # the engine runs what was taken
    report = build_report(engine, engine.setup, ok=6, failed=0, skipped=0, wall_s=1.0,
                          config=engine.config.replace(quantize="auto"), model_dir=model)
    assert report["config"]["quantize"] == "auto"
    assert report["plan"]["precision"]["quantize"] == p["quantize"] and report["plan"]["precision"]["why"] == p["why"]
    assert f"precision {p['chosen']}: --quantize auto" in summary(report, tmp_path / "out.jsonl")
    engine.close()
    same, _ = engine_tokens(model, quantize=p["quantize"], **budget)
    assert auto == same


# ---- issue 47: quality weighed (a bound for auto), GGUF files planned ------------------------
GAP4, AGREE4 = 0.30483, 0.7207  # hqq4's row of the committed table


@pytest.mark.parametrize("bound, chosen", [
    ([], "hqq4"),                                  # no bound: today's choice stands
    (["--max-logprob-gap", "0.5"], "hqq4"),        # 4-bit's measured gap is within it
    (["--max-logprob-gap", "0.1"], "bfloat16"),    # ...and not within this one
    (["--min-agreement", "0.7"], "hqq4"),
    (["--min-agreement", "0.9"], "bfloat16"),
])
def test_auto_honours_a_quality_bound_and_says_what_it_costs(capsys, bound, chosen):
    args = ["--model", "mixtral-8x22b", "--hardware", "rtx3090-pcie4", "--host-memory", "256GiB", "--quantize", "auto"]
    p = _plan_json(capsys, *args, *bound)
    assert p["chosen"] == chosen, p["why"]
    if chosen == "hqq4":  # the plan's line: the speed gain, the quality cost, where it was measured
        assert "x bfloat16's" in p["why"] and f"quality cost 72.1% greedy agreement, {GAP4:.3f} nats/token " \
            "(measured on smollm2-moe)" in p["why"], p["why"]
    else:
        assert "ruled out by the quality bound: hqq4: " in p["why"], p["why"]


def test_a_bound_rules_out_an_unmeasured_option_and_a_refusal_names_it():
    exact, four = _weighed(10.0, 50.0)
    assert choose([exact, four], "auto", QualityBound(max_logprob_gap=1.0))[0] is exact  # no quality row
    four.quality = {"agreement": AGREE4, "logprob_gap": GAP4, "measured_on": "m vs r"}
    assert choose([exact, four], "auto", QualityBound(max_logprob_gap=1.0))[0] is four
    exact, four = _weighed(None, 50.0)
    four.quality = {"agreement": AGREE4, "logprob_gap": GAP4, "measured_on": "m vs r"}
    picked, why = choose([exact, four], "auto", QualityBound(min_agreement=0.8))
    assert picked is exact and picked.plan is None and "greedy agreement 72.1% < 80.0%" in why


def test_plan_and_simulate_take_a_gguf_file_or_its_folder(tmp_path, capsys, monkeypatch):
    """As `generate` does: the shapes and block types come from the header, no weight is read;
    the file's precision is labelled by its experts' type and that type's measured quality."""
    pytest.importorskip("gguf")
    import gguf_models as gm
    from klotski import planning
    from klotski.io import gguf as kg
    (tmp_path / "q8").mkdir()
    (tmp_path / "q4k").mkdir()
    q8 = gm.write(tmp_path / "q8" / "model.gguf", "Q8_0", gm.QWEN3)
    q4k = gm.write(tmp_path / "q4k" / "model.gguf", "Q4_K", gm.QWEN3)

    def no_weights(*a, **k):
        raise AssertionError("a weight was read")
    monkeypatch.setattr(kg.GgufStore, "read", no_weights)
    monkeypatch.setattr(kg.GgufStore, "read_raw", no_weights)
    hw = ["--hardware", "rtx3090-pcie4"]
    for model in (q8, q8.parent):
        p = _plan_json(capsys, "--model", str(model), *hw, "--quantize", "auto")
        table = planning.quality_table()
        assert [o["name"] for o in p["options"]] == ["GGUF Q8_0"] and p["chosen"] == "GGUF Q8_0"
        assert p["options"][0]["quality"]["logprob_gap"] == table["options"]["Q8_0"]["logprob_gap"]
    assert cli.main(["plan", "--model", str(q4k), *hw]) == 0
    text = capsys.readouterr().out
    assert "* GGUF Q4_K" in text and "not measured" in text and "schedule klotski: batch size" in text
    assert cli.main(["simulate", "--model", str(q4k.parent), *hw]) == 0
    assert "klotski " in capsys.readouterr().out
