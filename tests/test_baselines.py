"""The accelerate baseline really offloads, agrees with transformers, and compare.py catches drift."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROMPTS, reference_tokens
from klotski.builtin import tiny

BASELINES = Path(__file__).resolve().parents[1] / "benchmarks" / "baselines"
MAX_NEW = 10


def _module(name):
    spec = importlib.util.spec_from_file_location(f"baselines_{name}", BASELINES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


compare = _module("compare")
max_batch = _module("max_batch")
accelerate_run = _module("accelerate_run")


def _write_jobs(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def _read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def accel_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("accel")
    model = tiny.build_checkpoint(root / "m", "tiny")
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    # Half the weights: accelerate must keep some layers and send the rest to disk.
    device = model_bytes // 2
    cmd = [sys.executable, str(BASELINES / "accelerate_run.py"), "--model", str(model),
           "--jobs", str(_write_jobs(root / "jobs.jsonl")), "--out", str(root / "out.jsonl"),
           "--report", str(root / "report.json"), "--batch-size", "4", "--max-new-tokens", str(MAX_NEW),
           "--max-memory-device", str(device), "--max-memory-cpu", "64MB",
           "--offload-folder", str(root / "offload"), "--dtype", "float32", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"root": root, "model": model, "device": device, "out": root / "out.jsonl",
            "report": json.loads((root / "report.json").read_text())}


def test_part_of_the_model_is_offloaded_to_disk(accel_run):
    r = accel_run["report"]
    placed = r["device_map_summary"]["param_bytes"]
    assert placed.get("disk", 0) > 0 and placed.get("cpu", 0) > 0, placed
    assert placed["cpu"] <= accel_run["device"] == r["max_memory"]["device"]
    assert r["accelerate_max_memory"] == {"cpu": accel_run["device"]}
    # Offloaded experts are re-saved by transformers' weight converter into the folder.
    files = list((accel_run["root"] / "offload").glob("*.safetensors"))
    assert files and r["offload_folder"]["files"] == len(files)
    assert any(".experts." in f.name for f in files)


def test_greedy_tokens_equal_plain_transformers(accel_run):
    records = {rec["id"]: rec for rec in _read_jsonl(accel_run["out"])}
    assert sorted(records) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    got = [records[f"r{i}"]["token_ids"] for i in range(len(PROMPTS))]
    assert got == reference_tokens(accel_run["model"], PROMPTS, MAX_NEW)
    for rec in records.values():
        assert rec["completion_tokens"] == len(rec["token_ids"]) <= MAX_NEW
        assert rec["finish_reason"] == ("length" if len(rec["token_ids"]) == MAX_NEW else "stop")


def test_report_accounts_tokens_and_time(accel_run):
    r = accel_run["report"]
    records = _read_jsonl(accel_run["out"])
    stopped = sum(rec["finish_reason"] == "stop" for rec in records)
    assert r["system"] == "accelerate" and r["batch_size"] == 4 and r["num_batches"] == 2
    assert r["generated_tokens"] == sum(rec["completion_tokens"] for rec in records) + stopped
    assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["generate_s"], rel=1e-2)
    assert 0 < r["time_to_first_token_s"] <= r["prefill_s"] <= r["generate_s"] < r["wall_s"]
    assert r["peak_rss_bytes"] >= r["rss_after_load_bytes"] > 0
    assert r["budget_used_bytes"] >= r["resident_weight_bytes"]


def test_rows_stop_at_eos_and_at_their_own_limit(accel_run):
    """The tiny model never emits EOS on these prompts, so the cut is checked on a scripted generate."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(accel_run["model"], padding_side="left")
    eos, pad = tok.eos_token_id, tok.pad_token_id

    class Scripted:
        def generate(self, input_ids, attention_mask, max_new_tokens, logits_processor, **kw):
            assert max_new_tokens == 5 and attention_mask[1].tolist() == [0, 1, 1]
            logits_processor[0](input_ids, None)
            new = torch.tensor([[7, 8, eos, pad, pad], [7, 8, 9, 10, 11]])
            return torch.cat([input_ids, new], dim=1)

    batch = [{"id": "a", "ids": [1, 5, 6], "max_new": 5}, {"id": "b", "ids": [1, 5], "max_new": 3}]
    records, generated, prefill, total = accelerate_run.generate_batch(Scripted(), tok, batch, pad, {eos})
    assert [r["token_ids"] for r in records] == [[7, 8], [7, 8, 9]]
    assert [r["finish_reason"] for r in records] == ["stop", "length"]
    assert generated == 3 + 3  # EOS counts as generated, like Klotski; padding after it does not
    assert 0 <= prefill <= total


def test_compare_detects_an_altered_token(accel_run, tmp_path):
    out = accel_run["out"]
    same = compare.compare_outputs({"accelerate": out, "copy": out})
    assert same["all_identical"] and same["pairs"]["copy"]["compared"] == len(PROMPTS)

    records = _read_jsonl(out)
    victim = records[2]
    pos = len(victim["token_ids"]) // 2
    victim["token_ids"][pos] = (victim["token_ids"][pos] + 1) % 512
    dropped = records.pop(4)
    altered = tmp_path / "altered.jsonl"
    altered.write_text("".join(json.dumps(rec) + "\n" for rec in records))

    result = compare.compare_outputs({"accelerate": out, "altered": altered})
    pair = result["pairs"]["altered"]
    assert not result["all_identical"]
    assert pair["differing"] == 1 and pair["differing_ids"] == [victim["id"]]
    assert pair["first_difference"]["id"] == victim["id"]
    assert pair["first_difference"]["position"] == pos
    assert pair["missing_ids"] == [dropped["id"]]
    assert compare.main([f"a={out}", f"b={altered}"]) == 1


def test_first_difference_handles_prefixes():
    assert compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare.first_difference([1, 2, 3], [1, 2]) == 2
    assert compare.first_difference([1, 2], [1, 5, 3]) == 1


def test_max_batch_search_stops_at_first_overflow_and_at_job_count(monkeypatch, tmp_path):
    used = {1: 10, 2: 20, 4: 40, 8: 80, 16: 160}
    monkeypatch.setattr(max_batch, "try_batch", lambda a, b, budget, tmp: {
        "batch_size": b, "fits": used[b] <= budget, "reason": "over"})
    args = type("A", (), dict(max_memory_device="20B", max_memory_cpu="30B", batch_cap=64,
                              batch_candidates=None, max_new_tokens=4))()
    args.jobs = _write_jobs(tmp_path / "many.jsonl", PROMPTS * 4)  # 24 prompts
    r = max_batch.find_max_batch(args)
    assert r["best_batch_size"] == 4 and [c["batch_size"] for c in r["candidates"]] == [1, 2, 4, 8]
    assert not r["candidates"][-1]["fits"] and r["stopped_by"] == "over"

    args.jobs, args.max_memory_cpu = _write_jobs(tmp_path / "six.jsonl"), "1000B"
    r = max_batch.find_max_batch(args)
    assert r["best_batch_size"] == 4 and "only 6 prompts" in r["stopped_by"]
    assert max_batch.candidates(64, "12,4,8") == [4, 8, 12]
