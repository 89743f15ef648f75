"""DeepSeek-V2 / V3 against transformers' own classes, beyond what test_families runs on the
presets (V2: q_proj, greedy; V3: q LoRA, sigmoid groups, yarn): V2 with the q LoRA,
group-limited routing, yarn + mscale and routed_scaling_factor 16; the latent KV cache
(its widths, exact on the host tier too); and an FP8 block-quantized V3 checkpoint with its
multi-token-prediction layer, against transformers run on the weights the FP8 ones stand for."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPTS, engine_tokens, reference_tokens
from klotski.builtin.families import build_family
from placement.placement import Placement

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
V2_LORA_GROUPED = dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                       routed_scaling_factor=16.0, rope_parameters=YARN, first_k_dense_replace=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def v2_lora(tmp_path_factory):
    path = build_family(tmp_path_factory.mktemp("v2") / "lora", "deepseek_v2", **V2_LORA_GROUPED)
    return path, reference_tokens(path)


def _quarter(path):
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(path)
    try:
        return sum(ckpt.group_nbytes(k, torch.float32)[0] for k in ckpt.spec.group_keys()) // 4
    finally:
        ckpt.close()


def test_v2_q_lora_group_limited_yarn_two_dense_layers_equals_transformers(v2_lora):
    path, ref = v2_lora
    ours, engine = engine_tokens(path, batch_size=len(PROMPTS))
    assert ours == ref
    assert engine.spec.shape.dense_layers == 2 and engine.spec.shape.q_lora_rank == 24
    assert ("expert", 1, 0) not in engine.cache.full and ("expert", 2, 0) in engine.cache.full


# every schedule at n in {1, 4} runs on the presets in test_families; here the two extremes
@pytest.mark.parametrize("schedule, n", [("klotski", 4), ("simple", 1)])
def test_v2_variant_quarter_budget_every_schedule(v2_lora, schedule, n):
    engine = _quarter_budget_run(*v2_lora, schedule, n)
    assert engine.pipeline.experts_loaded > 0


def _quarter_budget_run(path, ref, schedule, n):
    """Tokens equal transformers' at a quarter of the model's bytes, and the peak stays within."""
    quarter = _quarter(path)
    ours, engine = engine_tokens(path, device_memory=quarter, batch_size=1 if n == 1 else 4 // n, num_batches=n,
                                 schedule=schedule)
    assert ours == ref
    assert engine.memory.peak <= quarter
    return engine


def test_latent_kv_cache_holds_576_of_v2_lite_shape_and_is_exact_on_the_host(v2_lora):
    """The cache keeps (normalised latent, rotary key) per token and layer, not full keys and
    values; moved to the host and back every step, tokens are unchanged."""
    path, ref = v2_lora
    seen = []
    from klotski.execute import kvcache
    original = kvcache.BatchKV.__init__

    def spy(self, *a, **kw):
        original(self, *a, **kw)
        seen.append((self.keys[0].shape, self.values[0].shape, self.on_host))
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(path)
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="host", expert="disk")
    ckpt.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcache.BatchKV, "__init__", spy)
        ours, engine = engine_tokens(path, placement=placement, batch_size=2, num_batches=3)
    assert ours == ref
    s = engine.spec.shape
    assert all(k[-2:] == (1, s.kv_lora_rank) and v[-2:] == (1, s.head_dim) and host for k, v, host in seen)
    assert s.kv_width == 32 + 8  # kv_lora_rank + qk_rope_head_dim, against 2 * 4 heads * (24 + 12) full


def _fp8_copy(src, fp8_dir, ref_dir, block=(16, 32)):
    """The checkpoint with every projection block-quantized to float8 e4m3 (scale per block,
    DeepSeek-V3's hub format) plus a junk MTP layer, and a twin holding the fp32 weights the
    FP8 ones stand for (what transformers is run on)."""
    import shutil
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    fp8, ref = {}, {}
    skip = ("norm", "mlp.gate.", "embed_tokens", "lm_head")
    for name, w in tensors.items():
        if w.ndim != 2 or any(s in name for s in skip):
            fp8[name] = ref[name] = w
            continue
        bo, bi = block
        out, inp = w.shape
        pad = torch.zeros(-(-out // bo) * bo, -(-inp // bi) * bi)
        pad[:out, :inp] = w
        blocks = pad.view(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (pad / scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1))[:out, :inp].to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale.contiguous()
        ref[name] = q.float() * scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    cfg = json.loads((src / "config.json").read_text())
    mtp = cfg["num_hidden_layers"]  # the next-token-prediction layer: present, never used
    fp8[f"model.layers.{mtp}.eh_proj.weight"] = torch.full((4, 4), float("nan"))
    save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, ref_dir / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, ref_dir


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3")
    fp8, ref = _fp8_copy(build_family(root / "base", "deepseek_v3"), root / "fp8", root / "ref")
    return fp8, reference_tokens(ref)


def test_v3_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(v3_fp8):
    fp8, ref = v3_fp8
    ours, engine = engine_tokens(fp8, batch_size=len(PROMPTS))
    assert ours == ref
    refs = engine.spec.group_refs(("attn", 0))
    assert refs["kv_b"].scale and refs["kv_b"].block == (16, 32) and refs["input_norm"].scale is None


@pytest.mark.parametrize("schedule, n", [("klotski", 4), ("simple", 1)])
def test_v3_fp8_quarter_budget(v3_fp8, schedule, n):
    _quarter_budget_run(*v3_fp8, schedule, n)


def test_fp8_dequantization_reads_each_block_with_its_own_scale():
    from placement.store import dequantize_blocks
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    out = dequantize_blocks(w, scale, (2, 2))
    assert out.tolist() == [[1, 2, 30], [4, 5, 60], [700, 800, 9000]]


@pytest.mark.parametrize("changes, expected", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     r"field 'quantization_config' is .*DeepSeek-V3 is read as shipped in FP8"),
    ({"topk_method": "greedy"}, r"field 'topk_method' is 'greedy'; must be one of 'noaux_tc'"),
    ({"n_group": 3}, r"field 'n_routed_experts' is 16; must be a multiple of 'n_group' \(3\)"),
    ({"first_k_dense_replace": 9}, r"field 'first_k_dense_replace' is 9; must be an integer from 0 to "
                                   r"num_hidden_layers \(3\)"),
    ({"kv_lora_rank": 16}, r"self_attn\.kv_a_proj_with_mqa\.weight has shape"),
])
def test_a_deepseek_config_that_cannot_work_is_refused_in_one_line(v3_fp8, tmp_path, changes, expected):
    import shutil

    from klotski.io.checkpoint import Checkpoint
    from placement.store import CheckpointError
    base = v3_fp8[0].parent / "base"
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg.update(changes)
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=expected) as e:
        Checkpoint.open(broken)
    assert "\n" not in str(e.value)


def test_host_attention_asked_of_mla_is_planned_on_the_device_and_keeps_the_budget(v2_lora, capsys):
    """MLA attends beside its latent cache on the device only (HOST_ATTENTION is False): asked
    for `--host-attention on`, the run says so and is planned with attention on the device.
    (Planned on the host, its KV and keys were left out of the device's working set and the
    run overran budgets the plan had accepted: 1/8 and 1/4 of the model here.)"""
    path, ref = v2_lora
    for budget in (_quarter(path) // 2, _quarter(path)):
        ours, engine = engine_tokens(path, device_memory=budget, batch_size=2, num_batches=2, host_attention="on")
        assert ours == ref
        assert engine.memory.peak <= budget
    assert "attention stays on the device" in capsys.readouterr().err
