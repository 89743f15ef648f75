"""The planner weighs precision (issue 39): `klotski plan` plans every precision the model can
take and prints each; `--quantize auto` takes the fastest option predicting >= 1.3x the exact
one, `none` (the default) stays exact; a run under auto says which it took and why."""
import json

import pytest

from klotski.cli import main as cli
from planner.precision import AUTO_SPEEDUP, Precision, Weighed, choose


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
    assert _by_name(p)["hqq4"]["quality"] == {k: table["options"]["hqq4"][k] for k in table["options"]["hqq4"]}
    assert _by_name(p)["bfloat16"]["quality"] == {"reference": True}


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
    from klotski.runtime.report import build_report, summary
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
