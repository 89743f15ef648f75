"""Every path on the GPU (issue 37, item 5), each against transformers' fp32 greedy tokens:
continuous batching with refills, adoption and realignment; attention and experts computed on
the host; gpt-oss experts kept MXFP4-packed to the device; DeepSeek's latent (MLA) KV cache;
an FP8 checkpoint; tight budgets held by the real allocator's peak; and a run under
TORCH_CUDA_SANITIZER. The checkpoints, references and CPU drivers are the CPU suite's own
(tests/test_batching.py, test_host_compute.py, test_gpt_oss.py, test_deepseek.py); here
they run with the device made explicit.

Skipped without CUDA. KLOTSKI_TEST_DEVICE=cpu runs the same assertions on the CPU (no
allocator peak, no sanitizer), to check the tests themselves on a machine without a GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import test_batching as batching
import test_deepseek as deepseek
from conftest import engine_tokens, reference_tokens
from klotski.compress.mxfp4 import Mxfp4Codec
from klotski.execute import kvcache
from placement.placement import Placement
# the CPU suite's fixtures, reused as they are (pytest finds fixtures by name in this module)
from test_batching import reference  # noqa: F401
from test_deepseek import v2_lora, v3_fp8  # noqa: F401
from test_gpt_oss import models, quarter, refs  # noqa: F401
from test_gpu import model  # noqa: F401  (the "small" preset, fp32)
from test_host_compute import MODES, mixtral  # noqa: F401

DEVICE = os.environ.get("KLOTSKI_TEST_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
pytestmark = pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                                reason="needs a CUDA device: run tests/gpu on a GPU machine (../shared/gpu/README.md); "
                                       "KLOTSKI_TEST_DEVICE=cpu runs these checks on the CPU")


def by_kind(model_dir, **tiers):
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(model_dir))
    try:
        return Placement.by_kind(ckpt.spec.group_keys(), **tiers)
    finally:
        ckpt.close()


@pytest.mark.parametrize("kv", ["device", "host"])
def test_continuous_batching_refills_adopts_and_realigns(checkpoints, reference, kv):
    """More prompts than rows, heavy-tailed limits, a 6-slot window: newcomers are prefilled
    ahead, adopted into finished rows (on the device, or host rows), slots realigned, live rows
    moved together; tokens unchanged."""
    placement = by_kind(checkpoints["window"], kv=kv, attn="host", expert="host")
    tokens, engine = batching._run(checkpoints["window"], placement=placement, device=DEVICE)
    assert tokens == reference["window"]
    s = engine.stats
    assert s.refills > 0 and s.kv_realigns > 0 and s.rows_moved > 0, s


@pytest.mark.parametrize("attention, experts", MODES)
def test_host_attention_and_host_experts(mixtral, attention, experts):
    d, placement, ref = mixtral
    out, engine = engine_tokens(d, placement=placement, batch_size=3, num_batches=2, device=DEVICE,
                                host_attention=attention, host_experts=experts)
    assert out == ref
    host = engine.pipeline.host.report()
    assert (host["attention"]["batches_layers_on_host"] > 0) == (attention == "on")
    assert (host["experts"]["experts_on_host"] > 0) == (experts == "on")


@pytest.fixture
def decodes(monkeypatch):
    """(device type of the packed blocks, their dtype, device type of the weight) per decode."""
    seen = []
    decode = Mxfp4Codec.decode

    def spy(self, parts):
        out = decode(self, parts)
        seen.append((parts["gate_up_blocks"].device.type, parts["gate_up_blocks"].dtype, out["gate_up"].device.type))
        return out
    monkeypatch.setattr(Mxfp4Codec, "decode", spy)
    return seen


def test_gpt_oss_mxfp4_experts_cross_packed_and_decode_on_the_device(models, refs, quarter, decodes):
    """A quarter of the model: experts come and go as blocks and scales and are decoded on the
    device, where they are computed."""
    ours, engine = engine_tokens(models["mxfp4"], device_memory=quarter, batch_size=2, num_batches=3, device=DEVICE,
                                 host_experts="off", host_attention="off")
    assert ours == refs["mxfp4"]
    assert engine.memory.peak <= quarter and engine.pipeline.experts_loaded > 0
    assert decodes and set(decodes) == {(DEVICE, torch.uint8, DEVICE)}


def test_gpt_oss_mxfp4_experts_computed_on_the_host(models, refs, decodes):
    """Experts on the host tier computed there: decoded on the host from the packed copy."""
    placement = by_kind(models["mxfp4"], kv="host", expert="host")
    ours, engine = engine_tokens(models["mxfp4"], placement=placement, batch_size=2, num_batches=3, device=DEVICE,
                                 host_experts="on")
    assert ours == refs["mxfp4"]
    assert engine.pipeline.host.report()["experts"]["experts_on_host"] > 0
    assert ("cpu", torch.uint8, "cpu") in set(decodes)


@pytest.mark.parametrize("kv", ["device", "host"])
def test_deepseek_latent_kv_cache(v2_lora, monkeypatch, kv):
    """The cache holds (normalised latent, rotary key) per token, on the device or the host."""
    path, ref = v2_lora
    seen = []
    init = kvcache.BatchKV.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append((self.keys[0].shape[-2:], self.values[0].shape[-2:], self.keys[0].device.type, self.on_host))
    monkeypatch.setattr(kvcache.BatchKV, "__init__", spy)
    placement = by_kind(path, kv=kv, attn=kv, expert="disk" if kv == "host" else "device")
    ours, engine = engine_tokens(path, placement=placement, batch_size=2, num_batches=3, device=DEVICE)
    assert ours == ref
    s = engine.spec.shape
    where = "cpu" if kv == "host" else DEVICE
    assert seen and set(seen) == {((1, s.kv_lora_rank), (1, s.head_dim), where, kv == "host")}


@pytest.mark.parametrize("budget", ["default", "quarter"])
def test_fp8_checkpoint(v3_fp8, budget):
    fp8, ref = v3_fp8
    memory = deepseek._quarter(fp8) if budget == "quarter" else None
    ours, engine = engine_tokens(fp8, batch_size=2, num_batches=3, device=DEVICE, device_memory=memory)
    assert ours == ref
    if memory:
        assert engine.memory.peak <= memory and engine.pipeline.experts_loaded > 0


def small_reference(model_dir):
    full = reference_tokens(model_dir, batching.PROMPTS, max_new_tokens=max(batching.MAX_NEW))
    return [t[:m] for t, m in zip(full, batching.MAX_NEW)]


@pytest.mark.parametrize("which", ["small-mixtral", "gpt-oss-mxfp4"])
def test_tight_budget_holds_on_the_real_allocator(model, models, refs, quarter, which):
    """A quarter of the model, continuous batching with refills: the caching allocator's peak
    above the engine's baseline (cuBLAS's workspace made before it) stays within the budget."""
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if which == "small-mixtral":
        budget = sum(p.stat().st_size for p in Path(model).glob("*.safetensors")) // 4
        tokens, engine = batching._run(model, device_memory=budget, device=DEVICE)
        ref = small_reference(model)
    else:
        budget, ref = quarter, refs["mxfp4"]
        tokens, engine = engine_tokens(models["mxfp4"], device_memory=budget, batch_size=2, num_batches=2,
                                       device=DEVICE)
    assert tokens == ref
    assert engine.stats.refills > 0 and engine.pipeline.experts_loaded > 0
    assert engine.memory.peak <= budget
    if CUDA:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - engine.memory.allocator_baseline
        assert peak <= budget, f"allocator peak {peak} over the {budget}-byte budget (accounted {engine.memory.peak})"


SANITIZED = """
import json, sys
sys.path[:0] = {paths!r}
from conftest import engine_tokens
from placement.placement import Placement
from klotski.io.checkpoint import Checkpoint
job = json.loads(sys.argv[1])


def on_host(path, **tiers):
    ckpt = Checkpoint.open(path)
    keys = ckpt.spec.group_keys()
    ckpt.close()
    return Placement.by_kind(keys, **tiers)


def run(path, ref, **knobs):
    tokens, engine = engine_tokens(path, device=job["device"], max_new_tokens=NEW, **knobs)
    return tokens == [t[:NEW] for t in ref], engine


NEW = 4
ok = []
# MXFP4 experts moved packed and decoded on the device, a tight budget, rows refilled
same, e = run(job["mxfp4"], job["mxfp4_ref"], device_memory=job["quarter"], batch_size=2, num_batches=2,
              host_experts="off")
ok.append(same and e.pipeline.experts_loaded > 0 and e.stats.refills > 0)
# attention beside a host KV cache and experts decoded and computed on the host
same, e = run(job["mxfp4"], job["mxfp4_ref"], placement=on_host(job["mxfp4"], kv="host", expert="host"),
              batch_size=2, num_batches=3, host_attention="on", host_experts="on")
host = e.pipeline.host.report()
ok.append(same and host["attention"]["batches_layers_on_host"] > 0 and host["experts"]["experts_on_host"] > 0)
# MLA's latent cache on the host, moved up per layer (its attention runs on the device only)
same, e = run(job["mla"], job["mla_ref"], placement=on_host(job["mla"], kv="host", attn="host", expert="disk"),
              batch_size=2, num_batches=3)
ok.append(same and e.pipeline.experts_loaded > 0)
print("TOKENS", ok)
"""


def test_sanitizer_finds_no_race(models, refs, quarter, v2_lora):
    """MXFP4 experts moved and decoded on the device at a tight budget with rows refilled; host
    attention and host experts; MLA's latent cache on the host: every kernel's reads and writes
    checked against stream order (the checker needs CUDA: on the CPU the same script runs
    unchecked)."""
    tests = Path(__file__).parents[1]
    script = SANITIZED.format(paths=[str(tests), str(tests.parent)])
    job = {"mxfp4": str(models["mxfp4"]), "quarter": quarter, "mxfp4_ref": refs["mxfp4"], "mla": str(v2_lora[0]),
           "mla_ref": v2_lora[1], "device": DEVICE}
    env = {**os.environ, **({"TORCH_CUDA_SANITIZER": "1"} if CUDA else {})}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(job)], capture_output=True, text=True, env=env,
                         timeout=600, cwd=tests)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "CSAN" not in log and "data race" not in log.lower(), log[-3000:]
    assert "TOKENS [True, True, True]" in log, log[-3000:]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from klotski.builtin.families import build_family
    path = build_family(tmp_path_factory.mktemp("hybrid") / "qwen3_next", "qwen3_next")
    return path, reference_tokens(path)


@pytest.mark.parametrize("kv", ["device", "host"])
def test_hybrid_recurrent_state_moves_page_locked_on_the_kv_channels(hybrid, kv):
    """Qwen3-Next (Gated DeltaNet layers beside attention): tokens equal transformers' with the
    KV and recurrent state on either tier, experts on the host; on the host tier every
    host->device copy reads page-locked memory (the state goes up on kv_load and home on
    kv_store, never a pageable copy inside a layer)."""
    from contextlib import nullcontext
    from torch.profiler import ProfilerActivity, profile
    path, ref = hybrid
    placement = by_kind(path, kv=kv, expert="host")
    watch = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if CUDA else nullcontext()
    with watch as prof:
        ours, _ = engine_tokens(path, placement=placement, device=DEVICE, batch_size=2, num_batches=2)
    assert ours == ref
    if CUDA:
        memcpy = sorted({e.name for e in prof.events() if "Memcpy" in e.name})
        assert not [n for n in memcpy if "HtoD" in n and "Pageable" in n], memcpy
