"""`klotski bench` end to end on the tiny preset: every system measured, outputs agree, plots, report."""
import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from klotski.bench import driver as bench

ROOT = Path(__file__).resolve().parents[1]
for _d in (ROOT / "benchmarks", ROOT / "benchmarks" / "baselines"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import bench_driver  # noqa: E402
import report  # noqa: E402

EXPECTED = ["accelerate-same-bs", "accelerate-best-bs", "multibatch", "klotski", "multibatch-link", "klotski-link",
            "klotski-n1-link", "klotski-n2-link", "multibatch-n1-link", "multibatch-n2-link"]


def _args(*argv):
    parser = argparse.ArgumentParser(prog="klotski")
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    args = _args("--preset", "tiny", "--reps", "1", "--prompts", "8", "--max-new-tokens", "3",
                 "--systems", "klotski,multibatch,accelerate", "--ns", "1,2", "--accelerate-batch", "8",
                 "--out", str(root / "bench.json"), "--img-dir", str(root / "img"), "--work-dir", str(root / "work"))
    rc = bench.main(args)
    return {"rc": rc, "root": root, "results": json.loads((root / "bench.json").read_text())}


def test_exits_cleanly_with_every_system_measured(run):
    r = run["results"]
    assert run["rc"] == 0, r["failures"]
    assert not r["failures"]
    assert set(EXPECTED) <= set(r["systems"]), sorted(r["systems"])
    for key in EXPECTED:
        d = r["systems"][key]
        assert len(d["runs"]) == 1, key
        tps = d["median"]["tokens_per_s"]
        assert 0 < d["min"]["tokens_per_s"] <= tps <= d["max"]["tokens_per_s"], key
        # 8 prompts x 3 tokens, or n x bs prompts for a sweep point
        assert d["median"]["generated_tokens"] == 3 * d["prompts"], key
        assert d["median"]["peak_rss_bytes"] > 50 * 2**20, key
    assert r["settings"]["threads"] == 1 and r["settings"]["reps"] == 1
    assert r["systems"]["klotski-link"]["median"]["bubble_share"] is not None
    assert r["systems"]["accelerate-same-bs"]["batch_size"] == r["plans"]["plain"]["batch_size"]
    # accelerate's best batch given, not searched (the search: tests/test_baselines.py)
    assert r["systems"]["accelerate-best-bs"]["batch_size"] == r["accelerate_max_batch"]["best_batch_size"] == 8
    assert r["accelerate_max_batch"]["searched"] is False
    sweep = {(p["schedule"], p["n"]): p["key"] for p in r["sweep"]}
    assert sweep[("klotski", 2)] == "klotski-n2-link" and len(sweep) == 4
    assert r["systems"]["klotski-n2-link"]["prompts"] == 8 and r["systems"]["klotski-n1-link"]["prompts"] == 4
    assert [x for x in r["skipped"] if x["system"] == "llama.cpp"]


def test_outputs_agree_token_for_token(run):
    ag = run["results"]["agreement"]
    assert ag["all_identical"], ag["disagreements"]
    assert set(EXPECTED) <= set(ag["per_config"])
    # Independently of compare.py: every output file gives the same ids for every prompt it served.
    seen = {}
    outs = sorted((run["root"] / "work").glob("*.out.jsonl"))
    assert len(outs) >= len(EXPECTED)
    for path in outs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert rec["token_ids"], (path.name, rec)
            assert seen.setdefault(rec["id"], rec["token_ids"]) == rec["token_ids"], (path.name, rec["id"])
    assert len(seen) == 8


def test_a_changed_token_is_reported(run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(run["root"] / "work", work)
    victim = work / "klotski.rep1.out.jsonl"
    recs = [json.loads(line) for line in victim.read_text().splitlines()]
    recs[0]["token_ids"][-1] += 1
    victim.write_text("".join(json.dumps(x) + "\n" for x in recs))
    outputs = {"klotski": [("rep1", victim, work / "jobs.jsonl")],
               "multibatch": [("rep1", work / "multibatch.rep1.out.jsonl", work / "jobs.jsonl")]}
    ag = bench_driver.agreement(outputs, ("plan-plain", "reference", work / "plan-plain.warmup.out.jsonl"))
    assert not ag["all_identical"]
    assert [d["config"] for d in ag["disagreements"]] == ["klotski"]
    first = ag["disagreements"][0]["first_difference"]
    assert first["id"] == recs[0]["id"] and first["position"] == len(recs[0]["token_ids"]) - 1


def test_a_sweep_point_equal_to_a_ladder_configuration_is_not_run_twice(tmp_path):
    settings = {"work_dir": str(tmp_path), "threads": 1, "link_gbps": 2.0, "systems": ["klotski", "multibatch"],
                "sweep_schedules": ["klotski"], "ns": [1, 2], "sweep_batch_size": 4, "prompts": 8,
                "max_new_tokens": 2, "prompt_pool": [{"id": str(i), "prompt": f"p{i}"} for i in range(8)]}
    plan = {"batch_size": 4, "num_batches": 2}
    configs, index = bench_driver.Bench(settings).configs(tmp_path / "jobs.jsonl", {"plain": plan, "link": plan}, None)
    keys = [c.key for c in configs]
    assert {p["n"]: p["key"] for p in index} == {1: "klotski-n1-link", 2: "klotski-link"}
    assert "klotski-n2-link" not in keys and keys.count("klotski-link") == 1
    assert sorted(keys) == sorted(["klotski", "multibatch", "klotski-link", "multibatch-link", "klotski-n1-link"])


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_plots_are_real_pngs(run):
    plots = run["results"]["plots"]
    assert set(plots) == {"throughput", "tradeoff", "bubbles", "timeline"}
    for name, p in plots.items():
        path = Path(p)
        assert path.parent == run["root"] / "img"
        assert path.stat().st_size > 15_000, (name, path.stat().st_size)
        w, h = _png_size(path)
        assert w >= 600 and h >= 300, (name, w, h)
    tl = run["results"]["timeline"]
    lanes = {e["lane"] for e in tl["events"]}
    assert "compute" in lanes and tl["duration_ms"] > 0
    assert all(0 <= e["start_ms"] <= tl["duration_ms"] + 1e-6 for e in tl["events"])


def test_report_has_a_row_for_every_system(run):
    text = report.render(run["results"])
    systems_part, rest = text.split("### Sweep over n", 1)
    sweep_part = rest.split("### Ratios", 1)[0]
    for key, d in run["results"]["systems"].items():
        tps = f"{d['median']['tokens_per_s']:.2f}"
        if d["role"] == "sweep":  # sweep table: the config is the last column
            row = [line for line in sweep_part.splitlines() if line.endswith(f"| {key} |")]
        else:
            row = [line for line in systems_part.splitlines() if line.startswith(f"| {key} |")]
        assert len(row) == 1 and tps in row[0], (key, row)
    for ratio in run["results"]["ratios"]:
        assert f"| {ratio['name']} |" in text
    assert "llama.cpp" in text and "klotski bench --preset tiny" in text
    for p in run["results"]["plots"].values():
        assert f"]({p})" in text  # outside docs/: linked by absolute path


def test_xl_defaults_fill_only_unset_flags():
    s = bench.settings_from_args(_args("--preset", "xl"))
    assert (s["prompts"], s["max_new_tokens"], s["reps"], s["ns"], s["link_gbps"]) == (64, 4, 1, [], None)
    assert s["direct_io"] and s["dtype"] == "bfloat16" and (s["single_batch_prompts"], s["accelerate_batch"]) == (8, 64)
    assert (s["device_memory"], s["host_memory"]) == ("4GiB", "8GiB")
    s = bench.settings_from_args(_args("--preset", "xl", "--prompts", "32", "--no-direct-io", "--reps", "2"))
    assert (s["prompts"], s["direct_io"], s["reps"], s["max_new_tokens"]) == (32, False, 2, 4)
    s = bench.settings_from_args(_args("--preset", "medium"))
    assert (s["prompts"], s["direct_io"], s["single_batch_prompts"], s["ns"]) == (16, False, None, [1, 2, 4])
    assert "--no-direct-io" in bench.command_line(s, _args("--preset", "medium"))


def test_single_batch_systems_run_whole_batches_of_the_first_prompts(tmp_path):
    settings = {"work_dir": str(tmp_path), "threads": 1, "link_gbps": None, "prompts": 16, "max_new_tokens": 2,
                "systems": ["accelerate", "simple", "klotski"], "sweep_schedules": [], "ns": [],
                "sweep_batch_size": 4, "single_batch_prompts": 6,
                "prompt_pool": [{"id": str(i), "prompt": f"p{i}"} for i in range(16)]}
    jobs = bench_driver.write_jobs(settings["prompt_pool"], 16, 2, tmp_path / "jobs.jsonl")
    configs, _ = bench_driver.Bench(settings).configs(jobs, {"plain": {"batch_size": 4, "num_batches": 4}}, 16)
    lines = {c.key: Path(c.jobs).read_text().splitlines() for c in configs}
    assert len(lines["accelerate-same-bs"]) == len(lines["simple"]) == 4  # 6 rounded down to whole batches
    assert [json.loads(x)["id"] for x in lines["simple"]] == ["0", "1", "2", "3"]
    assert len(lines["klotski"]) == len(lines["accelerate-best-bs"]) == 16


def test_disk_and_accelerate_targets_apply_only_bigger_than_ram():
    systems = {"klotski": {"median": {"tokens_per_s": 20.0, "decode_disk_gb_per_s": 0.99}},
               "accelerate-same-bs": {"median": {"tokens_per_s": 1.0}}}
    fits = {r["name"]: r for r in bench_driver.ratios(systems, {"disk_read_gbps": 1.1})}
    big = {r["name"]: r for r in bench_driver.ratios(systems, {"disk_read_gbps": 1.1, "bigger_than_ram": True})}
    disk = "klotski disk read during decode / dd O_DIRECT bandwidth"
    assert fits[disk]["value"] == 0.9 and fits[disk]["met"] is None
    assert big[disk]["met"] is True and big["klotski / accelerate-same-bs"]["met"] is True
    assert fits["klotski / accelerate-same-bs"]["met"] is None
    systems["klotski"]["median"]["decode_disk_gb_per_s"] = 0.5
    big = {r["name"]: r for r in bench_driver.ratios(systems, {"disk_read_gbps": 1.1, "bigger_than_ram": True})}
    assert big[disk]["met"] is False


def test_building_xl_checks_free_disk_first(monkeypatch):
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda p: type("U", (), {"free": 10e9})())
    with pytest.raises(ValueError, match="needs about 65 GB"):
        bench.ensure_model("xl", "skewed", "bfloat16")


def test_settings_are_validated():
    with pytest.raises(ValueError):
        bench.settings_from_args(_args("--systems", "klotski,vllm"))
    assert bench.default_budgets("medium", "float32") == ("1800MB", "8GiB")
    assert bench.default_budgets("medium", "bfloat16") == ("900MB", "8GiB")


def test_memory_group_limits_a_child_including_what_it_allocates(tmp_path):
    import sys

    import bench_runner
    try:
        bench_runner.MemoryGroup(1 << 30).remove()
    except OSError:
        pytest.skip("no writable memory cgroup here")
    small = bench_runner.run_process([sys.executable, "-c", "x = bytearray(100_000_000)"], env=None,
                                     log=tmp_path / "small.log", memory_limit=1 << 30)
    big = bench_runner.run_process([sys.executable, "-c", "x = bytearray(1_500_000_000)"], env=None,
                                   log=tmp_path / "big.log", memory_limit=1 << 30)
    assert small["returncode"] == 0 and 100_000_000 <= small["peak_cgroup_bytes"] <= 1 << 30
    assert big["returncode"] != 0  # killed at the limit, not allowed to spill past it


def test_disk_bandwidth_is_read_with_dd_and_summarised_by_median(tmp_path):
    import bench_runner
    f = tmp_path / "shard.bin"
    f.write_bytes(b"\0" * (8 << 20))
    (sample,) = bench_runner.disk_read_samples([f], count=3)
    if sample["gb_per_s"] is None:
        pytest.skip(f"dd with O_DIRECT is refused here: {sample['error']}")
    assert sample["bytes"] == 8 << 20 and "iflag=direct" in sample["command"]
    rates = [{"gb_per_s": x} for x in (1.7, 1.1, 1.2, None)]
    assert bench_runner.median_gbps(rates) == 1.2 and bench_runner.median_gbps([]) is None


def test_device_cuda_runs_the_gpu_benchmark_with_this_commands_settings(monkeypatch, tmp_path):
    import subprocess
    seen = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["bench", "--device", "cuda", "--preset", "medium", "--prompts", "64",
                           "--out", str(tmp_path / "r.json")])
    assert bench.main(a) == 0
    cmd = seen[0]
    assert cmd[1].endswith("benchmarks/gpu.py") and cmd[cmd.index("--preset") + 1] == "medium"
    assert cmd[cmd.index("--prompts") + 1] == "64" and cmd[cmd.index("--out") + 1] == str(tmp_path / "r.json")
    assert "--max-new-tokens" not in cmd  # unset: the GPU benchmark's own default
