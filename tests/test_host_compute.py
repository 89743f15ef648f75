"""Host compute (klotski/execute/hostcompute.py): attention beside a host KV cache, cold experts where
they live. Greedy fp32 tokens equal transformers' with each on and both, for several families;
bytes over the host->device link fall; the KV cache stays right over many steps; `auto`
follows the cost model, which does not pretend a slow host is free."""
import dataclasses

import pytest

from conftest import PROMPTS, engine_tokens, reference_tokens, requests
from klotski.assemble import build_engine, setup_run
from klotski.io.checkpoint import Checkpoint
from klotski.config import ConfigError, RunConfig
from klotski.schedule.sequences import prepare
from klotski.builtin.families import build_family
from placement.placement import Placement
from planner.costmodel import CostModel
from planner.profile import Profile

MODES = [("on", "off"), ("off", "on"), ("on", "on")]


def _placement(model_dir, kv="host", expert="host"):
    _, probe = engine_tokens(model_dir, prompts=["x"], max_new_tokens=1)
    return Placement.by_kind(probe.spec.group_keys(), kv=kv, expert=expert)


@pytest.fixture(scope="module")
def mixtral(checkpoints):
    d = checkpoints["gqa"]
    return d, _placement(d), reference_tokens(d)


@pytest.fixture(scope="module")
def baseline(mixtral):
    d, placement, ref = mixtral
    out, engine = engine_tokens(d, placement=placement, batch_size=3, num_batches=2)
    assert out == ref
    return dict(engine.trace.bytes)


@pytest.mark.parametrize("attention, experts", MODES)
def test_mixtral_tokens_equal_transformers_and_link_bytes_fall(mixtral, baseline, attention, experts):
    d, placement, ref = mixtral
    out, engine = engine_tokens(d, placement=placement, batch_size=3, num_batches=2,
                                host_attention=attention, host_experts=experts)
    assert out == ref
    host = engine.pipeline.host.report()
    assert (host["attention"]["batches_layers_on_host"] > 0) == (attention == "on")
    assert (host["experts"]["experts_on_host"] > 0) == (experts == "on")
    up, down = engine.trace.bytes["host_to_device"], engine.trace.bytes["device_to_host"]
    assert up < baseline["host_to_device"]
    # what host compute sends down (q, new k/v; expert inputs) is counted, not free
    assert down > baseline["device_to_host"]
    saved = host["attention"]["kv_bytes_not_moved"] + host["experts"]["bytes_not_moved"]
    assert baseline["host_to_device"] - up < saved  # the outputs coming up are charged


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_other_families_exact_with_both_on(tmp_path_factory, family):
    d = build_family(tmp_path_factory.mktemp(family) / family, family)
    out, engine = engine_tokens(d, placement=_placement(d), batch_size=3, num_batches=2,
                                host_attention="on", host_experts="on")
    assert out == reference_tokens(d)
    host = engine.pipeline.host.report()
    assert host["experts"]["experts_on_host"] > 0
    # MLA (DeepSeek) moves its small latent cache instead: its keys are expanded by a projection
    assert (host["attention"]["batches_layers_on_host"] > 0) == (family != "deepseek_v3")


def test_kv_stays_right_over_many_steps_with_window_and_sparsity(checkpoints):
    """A sliding-window model decoding well past its window, with continuous batching's
    realigns, and StreamingLLM sparsity: host attention writes and reads the host cache
    directly, so a misplaced block would change tokens against the moved path."""
    d = checkpoints["window"]
    placement = _placement(d, expert="device")
    prompts = PROMPTS[:4]
    kw = dict(placement=placement, prompts=prompts, max_new_tokens=24, batch_size=2, num_batches=2)
    ref = reference_tokens(d, prompts, max_new_tokens=24)
    on, engine = engine_tokens(d, host_attention="on", **kw)
    assert on == ref
    assert engine.pipeline.host.report()["attention"]["batches_layers_on_host"] > 0
    sparse = dict(kw, attention="sink:2,window:5")
    assert engine_tokens(d, host_attention="on", **sparse)[0] == engine_tokens(d, **sparse)[0]


def test_disk_experts_are_computed_from_the_staged_copy(mixtral):
    d, _, ref = mixtral
    out, engine = engine_tokens(d, placement=_placement(d, kv="device", expert="disk"), batch_size=3,
                                num_batches=2, host_experts="on")
    assert out == ref
    assert engine.pipeline.host.report()["experts"]["experts_on_host"] > 0


def _profile(host_flops: float, host_bw: float) -> Profile:
    """A GPU machine's profile (fast device, 2 GB/s link) with the given host rates."""
    return Profile(name="test", device="cuda", flops=1e14, mem_bw=1e12, host_flops=host_flops, host_mem_bw=host_bw,
                   links={"host_to_device": 2e9, "device_to_host": 2e9, "disk_to_host": 1e9})


@pytest.mark.parametrize("host, chosen", [((1e6, 1e6), False), ((1e14, 1e13), True)])
def test_auto_follows_the_cost_model(mixtral, baseline, host, chosen):
    """A very slow host is never chosen (host compute is not free); a fast one is, for both."""
    d, placement, ref = mixtral
    off = RunConfig(model=str(d), progress=False, dtype="float32", batch_size=3, num_batches=2)
    ckpt = Checkpoint.open(off.model)
    seqs, _ = prepare(requests(), ckpt.tokenizer, ckpt.spec, off)
    setup = setup_run(off, ckpt, seqs, placement=placement)
    cost = CostModel(_profile(*host), ckpt.spec, sizes=ckpt.group_bytes(setup.dtype))
    engine = build_engine(off.replace(host_attention="auto", host_experts="auto"), ckpt,
                          dataclasses.replace(setup, cost=cost, host_modes=("auto", "auto")))
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == ref
    host_report, asked = engine.pipeline.host.report(), engine.pipeline.host
    assert asked.attention.decided > 0 and asked.experts.decided > 0
    assert (host_report["attention"]["batches_layers_on_host"] > 0) == chosen
    assert (host_report["experts"]["experts_on_host"] > 0) == chosen
    # with nothing on the host the bytes are the baseline's up to prefetch timing (which
    # transfers land first decides a few evictions), so only a fall is asserted, where chosen
    if chosen:
        assert engine.trace.bytes["host_to_device"] < 0.9 * baseline["host_to_device"]


def test_auto_resolves_off_on_a_cpu_only_machine_and_to_the_plan_on_a_gpu():
    """CPU-only: the host is the device, so `auto` never picks host compute (`on` still runs,
    for measuring). GPU: attention does what the plan chose; experts stay per call."""
    import torch
    from types import SimpleNamespace
    from klotski.planning import host_modes
    both = RunConfig(host_attention="auto", host_experts="auto")
    assert host_modes(both, torch.device("cpu"), None) == ("off", "off")
    assert host_modes(both.replace(host_experts="on"), torch.device("cpu"), None) == ("off", "on")
    for chose in (True, False):
        plan = SimpleNamespace(host_attention=chose)
        assert host_modes(both, torch.device("cuda"), plan) == ("on" if chose else "off", "auto")
    assert host_modes(both, torch.device("cuda"), None) == ("auto", "auto")  # nothing planned: per call


def test_modes_are_checked():
    with pytest.raises(ConfigError, match=r"--host-experts 'yes': choose one of auto, on, off"):
        RunConfig(host_experts="yes")


def test_host_rates_are_measured_with_the_engines_ops():
    """What a GPU machine's profile records for its host: the engine's expert and attention
    core timed on the CPU (here the CPU is all there is, so the path is run directly)."""
    from klotski.builtin import tiny
    from klotski.measure.profile_ops import EngineOps
    from planner.profile import host_rates
    from planner.shapes import ModelShape
    shape = ModelShape.from_config(tiny.PRESETS["tiny"])
    samples = {}
    flops, bw = host_rates(shape, EngineOps(), {"tokens": [1, 8], "ctx": [16], "bs": [1, 2]}, 1, samples)
    assert flops > 1e6 and bw > 1e6
    assert len(samples["host_expert"]) == 2 and len(samples["host_attend"]) == 2


def test_flags_fill_the_config_and_the_summary_says_what_host_compute_did():
    from klotski.cli.parser import build_parser, config_from_args
    from klotski.execute.hostcompute import HostCompute
    from klotski.schedule.report import host_line
    a = build_parser().parse_args(["generate", "jobs.jsonl", "--host-attention", "auto", "--host-experts", "on"])
    config = config_from_args(a)
    assert (config.host_attention, config.host_experts) == ("auto", "on")
    assert config.to_json()["host_experts"] == "on"  # the report echoes the config
    host = HostCompute.from_config(config)
    host.experts.on_host, host.experts.bytes_not_moved = 3, 3 << 20
    (line,) = host_line(host.report())
    assert "3 experts on the host (3.0 MiB not moved" in line and "; auto)" in line
    assert host_line(HostCompute().report()) == []
