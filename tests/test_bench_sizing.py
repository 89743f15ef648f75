"""`klotski bench --preset disk`: the run sized to the machine (benchmarks/common.py), its budgets
checked with the engine's own planning entry, its refusals, and the decode-phase disk reads."""
import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from klotski.bench import driver as bench

ROOT = Path(__file__).resolve().parents[1]
for _d in (ROOT / "benchmarks", ROOT / "benchmarks" / "baselines"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import bench_driver  # noqa: E402
import bench_runner  # noqa: E402
import common  # noqa: E402

GiB = 2**30
SHARED_BOX = dict(ram_bytes=24 * GiB, disk_gbps=1.2, core_gflops=50.0)


def machine(free_gb: float = 40, cores: int = 2, **kw) -> common.Machine:
    return common.Machine(free_disk_bytes=int(free_gb * 1e9), cores=cores, **{**SHARED_BOX, **kw})


def test_forty_gb_free_fits_with_the_model_between_twice_the_limit_and_half_the_disk():
    m = machine(40)
    s = common.size_disk_run(m)
    assert s["memory_limit"] == s["device_memory"] + s["host_memory"] + common.RUNTIME_ALLOWANCE
    assert 2 * s["memory_limit"] <= s["model_bytes"] <= m.free_disk_bytes / 2
    assert s["memory_limit"] <= common.RAM_SHARE * m.ram_bytes
    assert max(s["estimate_s"].values()) <= 30 * 60 and s["threads"] == m.cores
    assert s == common.size_disk_run(m)  # pure: the same machine, the same sizing


def test_one_layer_fewer_is_refused_as_under_twice_the_limit():
    s = common.size_disk_run(machine(40))
    with pytest.raises(common.DiskRegimeRefused, match="under twice its memory limit"):
        common.size_disk_run(machine(40), shape=s["shape"], layers=s["layers"] - 1)


@pytest.mark.parametrize("gflops", [50.0, 1.0])  # a fast CPU's full group, a slow one's single batch
def test_sized_budgets_are_accepted_by_the_engines_planning_and_are_near_its_minimum(gflops):
    from klotski.config import RunConfig
    from klotski.planning import BudgetRefused, make_plan
    from planner.profile import Profile
    s = common.size_disk_run(machine(40, core_gflops=gflops), shape="medium")
    shape, _ = common.disk_shape(s["shape"], s["layers"])
    profile = Profile(name="cpu", flops=5e10, mem_bw=2e10, device="cpu",
                      links={"disk_to_host": 1.2e9, "host_to_device": 2e10, "device_to_host": 2e10})
    job = dict(prompt_len=s["prompt_tokens"], longest_prompt=s["prompt_tokens"] + common.PROMPT_SLACK,
               gen_len=s["max_new_tokens"], config=RunConfig(batch_size=s["batch_size"]), sequences=s["prompts"])
    plan = make_plan(shape, profile, device_memory=s["device_memory"], host_memory=s["host_memory"], **job)
    assert plan.batch_size == s["batch_size"]
    assert plan.prefill_chunk >= s["prompt_tokens"] + common.PROMPT_SLACK  # one prefill pass over the weights
    assert plan.buffers == "overlap"  # at "minimum" a decode step reads experts from disk more than once
    # the host budget is the planner's minimum plus a margin for exact sizes (5% + 64 MiB)
    with pytest.raises(BudgetRefused, match="--host-memory"):
        make_plan(shape, profile, device_memory=s["device_memory"], host_memory=int(0.75 * s["host_memory"]), **job)


def test_too_little_disk_is_refused_in_one_line_naming_what_is_needed():
    with pytest.raises(common.DiskRegimeRefused) as e:
        common.size_disk_run(machine(10))
    msg = str(e.value)
    assert "\n" not in msg and "10 GB is free" in msg
    m = re.search(r"needs (\d+) GB of free disk \(a ([\d.]+) GB model, twice the smallest workable memory "
                  r"limit of ([\d.]+) GiB", msg)
    need, model, limit = float(m.group(1)), float(m.group(2)), float(m.group(3))
    assert abs(need - 2 * model) <= 1 and model * 1e9 >= 2 * limit * GiB * 0.99 and need > 10


def test_fewer_cores_give_fewer_prompt_tokens_and_prompts():
    many = common.size_disk_run(machine(40, cores=8, core_gflops=5.0), shape="medium")
    few = common.size_disk_run(machine(40, cores=2, core_gflops=5.0), shape="medium")
    assert (few["threads"], many["threads"]) == (2, 8)
    assert few["prompt_tokens"] < many["prompt_tokens"] and few["prompts"] < many["prompts"]


def test_the_disk_preset_is_refused_before_anything_is_built(monkeypatch, capsys):
    monkeypatch.setattr(common, "regime_controls", lambda: None)
    monkeypatch.setattr(common, "probe_machine", lambda where, reclaimable=0: (machine(10), {}))
    monkeypatch.setattr(bench, "ensure_disk_model", lambda *a: pytest.fail("built before the refusal"))
    parser = argparse.ArgumentParser(prog="klotski")
    bench.add_parser(parser.add_subparsers(dest="command"))
    assert bench.main(parser.parse_args(["bench", "--preset", "disk"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("klotski: error: the disk regime does not fit this machine")


def test_decode_reads_come_from_proc_self_io_during_decode_calls_only(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(8 << 20))
    try:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("O_DIRECT is not supported here")
    os.close(fd)
    before = bench_runner.read_bytes()

    class Engine:
        def step(self, *, decode):  # reads every weight from disk, as a disk-bound step does
            import mmap
            buf, fd = mmap.mmap(-1, 1 << 20), os.open(data, os.O_RDONLY | os.O_DIRECT)
            try:
                for off in range(0, 8 << 20, 1 << 20):
                    os.preadv(fd, [buf], off)
            finally:
                os.close(fd)

    acc = {"bytes": 0, "s": 0.0, "calls": 0}
    bench_runner.count_reads(Engine, "step", acc, counts=lambda kw: kw.get("decode") is not None)
    e = Engine()
    e.step(decode=None)  # prefill
    e.step(decode=True)
    e.step(decode=True)
    if bench_runner.read_bytes() - before < 3 * (8 << 20):
        pytest.skip("/proc/self/io does not count O_DIRECT reads here")
    assert acc["calls"] == 2 and 2 * (8 << 20) <= acc["bytes"] < 2 * (8 << 20) + (1 << 20)


def test_decode_rates_and_their_share_of_the_disk_bandwidth():
    row = bench_runner.decode_rates(40, 8, 4.0, {"decode_read_bytes": 4_000_000_000})
    assert row == {"decode_tokens_per_s": 8.0, "decode_read_gb_per_s": 1.0}
    systems = {"klotski": {"median": {"tokens_per_s": 3.0, **row}},
               "accelerate-same-bs": {"median": {"tokens_per_s": 1.0, "decode_tokens_per_s": 2.0,
                                                 "decode_read_gb_per_s": 0.5}}}
    got = {r["name"]: r for r in bench_driver.ratios(systems, {"disk_read_gbps": 1.25, "bigger_than_ram": True})}
    share = got["klotski disk read during decode (/proc/self/io) / dd O_DIRECT bandwidth"]
    assert share["value"] == 0.8 and share["met"] is False and share["target"] == bench_driver.DISK_TARGET
    assert got["accelerate-same-bs disk read during decode (/proc/self/io) / dd O_DIRECT bandwidth"]["value"] == 0.4
    assert got["klotski / accelerate-same-bs (decode tokens/s)"]["value"] == 4.0


def test_busy_cores_are_left_to_their_work_and_a_slower_engine_gets_a_smaller_job():
    assert common.size_disk_run(machine(40, cores=2, load=1.6), shape="medium")["threads"] == 1
    assert common.size_disk_run(machine(40, cores=8, load=3.0), shape="medium")["threads"] == 5
    fast = common.size_disk_run(machine(40), shape="medium")
    slow = common.size_disk_run(machine(40), shape="medium",
                                compute=lambda rung, t: lambda *a: 8 * common.gemm_compute(machine(40), t)(*a))
    assert slow["prompts"] < fast["prompts"] and slow["prompt_tokens"] < fast["prompt_tokens"]
    assert slow["decode_step_compute_s"] <= common.COMPUTE_SHARE * slow["read_s"] + 0.01


def test_the_planners_compute_model_grows_with_the_rows_of_a_pass():
    from planner.profile import Profile
    layer, _ = common.disk_shape("medium", 1)
    profile = Profile(name="cpu", flops=5e10, mem_bw=2e10, device="cpu",
                      links={"disk_to_host": 1.2e9, "host_to_device": 2e10, "device_to_host": 2e10},
                      overhead_s={"batch_layer": 1e-3, "expert_call": 1e-4, "step": 1e-3})
    compute_s = common.planner_compute(profile, layer)
    model, _ = common.disk_shape("medium", 24)
    one, four, prefill = (compute_s(model, 4, n, t, 32) for n, t in ((1, 1), (4, 1), (4, 16)))
    assert 0 < one < four < prefill
    assert 1.8 * compute_s(common.disk_shape("medium", 12)[0], 4, 4, 1, 32) < four  # per layer, times the layers
