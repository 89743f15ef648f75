"""The measured hardware profile: it times the engine's own ops (planner/profile.py gets them
from klotski/measure/profile_ops.py: EngineOps), its cache key changes with what is timed, and
`--hardware auto` measures the GPU where there is one."""
from __future__ import annotations

import json

import pytest
import torch

from klotski.cli import main as cli
from klotski import planning
from klotski.measure.profile_ops import EngineOps
from klotski.compress import hqq as quant
from klotski.models import layers
from planner import profile as P
from planner import workingset
from planner.profile import load_profile, measure, profile_key
from planner.shapes import ModelShape

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=4, top_k=2, vocab_size=128, dtype="bfloat16")
GRID = dict(batch_sizes=(1, 2), context_lengths=(8,), token_counts=(1, 4), reps=2, io_bytes=4 << 20)


def counting(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def wrapper(*args, **kw):
        calls.append(args)
        return real(*args, **kw)
    monkeypatch.setattr(module, name, wrapper)


def test_profile_times_the_engines_attention_and_dequantization(monkeypatch, tmp_path):
    attends, dequants = [], []
    counting(monkeypatch, layers, "attend", attends)
    counting(monkeypatch, quant, "dequantize_group", dequants)
    # a score budget of one query row per call: the chunked path is what gets timed
    monkeypatch.setattr(workingset, "ATTENTION_SCORE_CHUNK", 1)
    prof = measure(TINY, ops=EngineOps(), io_dir=tmp_path, **GRID)
    rows = prof.samples["attention"]
    # decode, whole prompts and chunks of half the context (CHUNK_SAMPLE caps the chunk)
    assert [r[:3] for r in rows] == [[1, 8, 1], [2, 8, 1], [1, 8, 8], [2, 8, 8], [1, 8, 4], [2, 8, 4]]
    assert all(t > 0 for *_, t in rows)
    # every attention sample ran the engine's `attend` (a warm-up and at least one timed call),
    # prefill one query row at a time, over the grouped-query keys of the whole context
    assert len(attends) >= 2 * (2 + 2 * 8 + 2 * 4)
    assert {q.shape[2] for q, *_ in attends} == {1}
    assert {keys.shape[1:3] for _, keys, *_ in attends} == {(TINY.num_kv_heads, 8)}
    assert len(dequants) >= 2 and prof.samples["dequant"][0][0] == TINY.expert_params


def test_dequant_op_rebuilds_one_expert_as_the_cache_decodes_it():
    ops = EngineOps()(TINY, torch.bfloat16, torch.device("cpu"))
    out = ops.dequant()()
    assert {k: tuple(v.shape) for k, v in out.items()} == \
        {"w1": (128, 64), "w3": (128, 64), "w2": (64, 128)}
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    err = (out["w1"].float() - ops.expert_w[0]["w1"].float()).norm() / ops.expert_w[0]["w1"].float().norm()
    assert err < 0.15  # a real HQQ 4-bit round trip, not random codes


def test_ops_read_their_weights_cold():
    """Each timed call reads another copy of its weights (a step never finds a weight in the
    caches, so the profile must not either): distinct copies, visited in turn."""
    ops = EngineOps()(TINY, torch.float32, torch.device("cpu"))
    copies = ops.expert_w
    assert len(copies) == ops.MAX_COPIES  # a tiny expert: the copy cap, not the byte target, binds
    assert len({c["w1"].data_ptr() for c in copies}) == len(copies)
    assert not torch.equal(copies[0]["w1"], copies[1]["w1"])
    seen = []
    run = ops._cycle([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(4):
        run()
    assert seen == [0, 1, 2, 0]
    # a weight as large as the byte target is timed from one copy: it cannot stay cached
    assert ops._count(ops.COLD_BYTES) == 1 and ops._count(ops.COLD_BYTES // 4) == 4


def test_cache_key_changes_with_what_is_timed(monkeypatch, tmp_path):
    grid = {"bs": [1]}
    base = profile_key(TINY, "cpu", grid, "ops-a")
    assert profile_key(TINY, "cpu", grid, "ops-b") != base
    monkeypatch.setattr(P, "PROFILE_VERSION", P.PROFILE_VERSION + 1)
    assert profile_key(TINY, "cpu", grid, "ops-a") != base
    monkeypatch.undo()

    key = EngineOps().key
    assert key.startswith(f"klotski-engine-ops/{EngineOps.VERSION}/")

    class Recomposed(EngineOps):
        VERSION = EngineOps.VERSION + 1
    assert Recomposed().key != key
    cache = tmp_path / "profiles"
    measure(TINY, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    measure(TINY, ops=Recomposed(), cache_dir=cache, io_dir=tmp_path, **GRID)
    assert len(list(cache.glob("*.json"))) == 2  # the old ops' profile is not served


def test_every_emulated_link_shares_one_measurement(monkeypatch, tmp_path):
    """`--emulate-link` only replaces the link's rate: one measurement of a shape serves every
    rate (each of the suite's link settings used to measure the same layers again)."""
    timed = []
    counting(monkeypatch, P, "_measure", timed)
    cache = tmp_path / "profiles"
    real = measure(TINY, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    slow = measure(TINY, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, link_gbps=2.5, **GRID)
    again = measure(TINY, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    assert len(timed) == 1 and len(list(cache.glob("*.json"))) == 1
    assert slow.links["host_to_device"] == slow.links["device_to_host"] == 2.5e9
    assert slow.machine["measured_host_to_device"] == real.links["host_to_device"] == again.links["host_to_device"]
    assert "emulated_link_gbps" not in again.machine and slow.samples == real.samples


def test_models_differing_only_in_depth_share_one_measurement(monkeypatch, tmp_path):
    """A profile times one layer's ops: a few-layer build and its full-depth model (the GPU bench's
    4-layer Mixtral and `klotski plan --model mixtral-8x7b`) share one measurement, and the cost
    model uses its samples for both; another width is measured apart."""
    import dataclasses
    from planner.costmodel import CostModel
    timed = []
    counting(monkeypatch, P, "_measure", timed)
    cache = tmp_path / "profiles"
    deep = dataclasses.replace(TINY, num_layers=32)
    few = measure(TINY, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    full = measure(deep, ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    assert len(timed) == 1 and full.samples == few.samples
    assert CostModel(full, deep)._samples == few.samples
    measure(dataclasses.replace(TINY, intermediate_size=256), ops=EngineOps(), cache_dir=cache, io_dir=tmp_path, **GRID)
    assert len(timed) == 2


def test_the_key_hashes_the_engine_code_the_ops_run():
    """Every module named imports (the key reads its source), and among them are every family
    and the shared hooks and expert helpers the ops call."""
    import importlib

    from klotski.models.spec import FAMILIES
    from klotski.measure import profile_ops
    modules = [importlib.import_module(name) for name in profile_ops.TIMED_MODULES]
    assert {m.__name__ for m in FAMILIES.values()} | {"klotski.models.defaults", "klotski.execute.experts",
                                                     "klotski.models.layers"} <= {m.__name__ for m in modules}


@pytest.fixture
def measured(monkeypatch):
    """`planning.measure` replaced by a recorder: which device and ops `--hardware auto` asks for."""
    calls = []

    def fake(shape, *, ops, device, **kw):
        calls.append({"device": device, "ops": ops})
        return load_profile("rtx3090-pcie4")
    monkeypatch.setattr(planning, "measure", fake)
    monkeypatch.setattr("klotski.measure.overhead.pipeline_overhead", lambda device, open_engine, **kw: {})
    return calls


@pytest.mark.parametrize("command", [["plan"], ["simulate"], ["profile"]])
def test_hardware_auto_measures_the_gpu_where_there_is_one(monkeypatch, measured, command, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(command + ["--model", "mixtral-8x7b"]) == 0
    assert [c["device"] for c in measured] == ["cuda"]
    assert isinstance(measured[0]["ops"], EngineOps)
    if command == ["profile"]:
        assert json.loads(capsys.readouterr().out)["device"] == "cuda"
    assert cli.main(command + ["--model", "mixtral-8x7b", "--device", "cpu"]) == 0
    assert measured[-1]["device"] == "cpu"


def test_hardware_auto_measures_the_cpu_without_a_gpu(monkeypatch, measured, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["plan", "--model", "mixtral-8x7b"]) == 0
    assert [c["device"] for c in measured] == ["cpu"]
    assert cli.main(["plan", "--model", "mixtral-8x7b", "--device", "cuda"]) == cli.EXIT_USAGE
    assert "--device cuda" in capsys.readouterr().err and len(measured) == 1


def test_a_builtin_profile_measures_nothing(measured, capsys):
    assert cli.main(["plan", "--model", "mixtral-8x7b", "--hardware", "rtx3090-pcie4", "--device", "cuda"]) == 0
    assert measured == []


def test_pipeline_overhead_is_measured_once_and_priced_per_call(tmp_path, monkeypatch):
    """The pipeline's own cost around the ops (klotski/measure/overhead.py): the engine's pipeline with
    the math stubbed out, cached per machine and pipeline source; the cost model adds it per
    batch-layer, expert call, transfer, step, batch-layer with its KV cache on the host and
    token beyond one a row."""
    from klotski.measure import overhead
    from klotski.assemble import open_engine
    from planner.costmodel import CostModel
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    found = overhead.pipeline_overhead("cpu", open_engine, steps=3)
    launches = {k: found[overhead.LAUNCHES + k] for k in overhead.LAUNCH_KINDS}
    assert set(found) == set(overhead.KINDS) | {overhead.LAUNCHES + k for k in overhead.LAUNCH_KINDS}
    assert all(v >= 0 for v in found.values()) and sum(found[k] for k in overhead.KINDS) > 0
    # counted, not timed: each batch-layer, layer, transfer (its copies: inline on a CPU) and
    # step issues ops of its own; an expert call none (a wave's ops do not grow with its experts)
    assert launches["batch_layer"] >= 1 and launches["layer"] >= 1 and launches["step"] >= 1
    assert launches["transfer"] >= 1 and launches["expert_call"] == 0
    monkeypatch.setattr(overhead, "_measure", lambda *a: pytest.fail("measured twice"))
    assert overhead.pipeline_overhead("cpu", open_engine, steps=3) == found
    profile = load_profile("rtx3090-pcie4")
    profile.overhead_s.update({"batch_layer": 1e-3, "expert_call": 1e-4, "transfer": 1e-5, "step": 1e-2,
                               "kv_layer": 1e-6, "token": 1e-7})
    cost = CostModel(profile, TINY)
    assert cost.t_pipeline(batch_layers=2, expert_calls=3, transfers=4, steps=1, kv_layers=5, tokens=6) == \
        pytest.approx(2e-3 + 3e-4 + 4e-5 + 1e-2 + 5e-6 + 6e-7)
    # a term is never priced below its launches: 10 ops an expert call at 20 µs a launch
    profile.launches, profile.launch_s = {"expert_call": 10.0, "step": 1.0}, 20e-6
    assert cost.t_pipeline(expert_calls=3, steps=1) == pytest.approx(3 * 2e-4 + 1e-2)
    assert cost.launches(expert_calls=3, steps=1) == 31


def test_pipeline_overhead_stubs_reach_every_expert():
    """The measure divides by every expert of a layer: its batch routes a token to each."""
    from klotski.measure import overhead
    for experts, top_k in ((8, 2), (128, 8), (4, 4), (64, 6)):
        rows = overhead._rows(experts, top_k)
        _, idx = overhead._Stubs(experts, top_k).route(torch.zeros(rows, 4), None, None)
        assert set(idx.flatten().tolist()) == set(range(experts))
        assert all(len(set(r)) == top_k for r in idx.tolist())  # k distinct experts a token


def test_pipeline_cost_is_measured_in_the_runs_channel_mode(monkeypatch, tmp_path):
    """A run with an emulated link copies on the channels' threads, one without copies
    inline: each is priced by its own measure, cached apart."""
    from klotski.measure import overhead
    from klotski.assemble import open_engine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    links = []

    def fake(device, steps, rounds, open_engine, link_gbps):
        links.append(link_gbps)
        return {k: 1e-3 if link_gbps else 1e-4 for k in overhead.KINDS}
    monkeypatch.setattr(overhead, "_measure", fake)
    threaded = overhead.pipeline_overhead("cpu", open_engine, emulated_link=True)
    inline = overhead.pipeline_overhead("cpu", open_engine)
    assert links == [overhead.FAST_LINK, None] and threaded != inline
    assert overhead.pipeline_overhead("cpu", open_engine, emulated_link=True) == threaded  # cached, apart
    assert links == [overhead.FAST_LINK, None]


def test_cpu_channels_copy_on_one_thread_and_leave_compute_its_threads():
    """A CPU channel's worker would otherwise start an OpenMP team as wide as the machine
    beside the compute's own. With no link to emulate, a copy runs on the thread that
    submits it (the disk channel keeps its worker)."""
    import threading

    from klotski.execute.channels import make_channels
    from klotski.execute.trace import Trace
    before, me = torch.get_num_threads(), threading.get_ident()
    for link in (2.0, None):
        channels = make_channels(torch.device("cpu"), Trace(False), link)
        try:
            for name, c in channels.items():
                threads, thread = c.submit(lambda: (torch.get_num_threads(), threading.get_ident()),
                                           name="threads").wait()
                if link is None and name != "disk":
                    assert thread == me and threads == before
                else:
                    assert thread != me and threads == 1
            assert torch.get_num_threads() == before
        finally:
            for c in channels.values():
                c.close()


def test_an_inline_copy_never_overtakes_queued_work():
    """A channel is first in, first out: work waiting on another channel goes to the worker,
    and whatever follows it queues behind it instead of running at once."""
    import threading

    from klotski.execute.channels import make_channels
    from klotski.execute.trace import Trace
    channels = make_channels(torch.device("cpu"), Trace(False), None)
    release, order = threading.Event(), []
    try:
        disk = channels["disk"].submit(release.wait, name="read")
        first = channels["experts"].submit(lambda: order.append(1), name="a", after=[disk])
        second = channels["experts"].submit(lambda: order.append(2), name="b")
        assert order == []  # neither ran on this thread
        release.set()
        first.wait(), second.wait()
        assert order == [1, 2]
        third = channels["experts"].submit(lambda: order.append(3), name="c")
        assert third.done() and order == [1, 2, 3]  # nothing queued: it ran at once
    finally:
        for c in channels.values():
            c.close()
