"""Small test checkpoints of every family, built with transformers' own config
and model classes and saved by its `save_pretrained` (the hub layout: per-expert tensors),
with the byte-level tokenizer of klotski.builtin.tokenizer. `klotski make-tiny --family qwen3_moe`.

transformers initialises weights with std `initializer_range`; 0.2 (instead of 0.02)
gives decisive routers and logits, so greedy tokens are not decided by rounding noise, and
varied generations rather than one token repeated."""
from __future__ import annotations

from pathlib import Path

import torch

from klotski.util import dtypes

_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False)

# Mixtral here is built like the others (klotski.builtin.tiny builds the routing-shaped ones). Each
# exercises what sets its family apart: Qwen3 an explicit head_dim (32, not 64 / 4) and
# 32 experts top-8 renormalised; Qwen2 q/k/v biases, a shared expert and no renormalisation;
# OLMoE full-width q/k norms and clip_qkv.
PRESETS: dict[str, dict] = {
    "mixtral": dict(_COMMON, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe": dict(_COMMON, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=8,
                      moe_intermediate_size=128, intermediate_size=128, norm_topk_prob=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2_moe": dict(_COMMON, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
                      moe_intermediate_size=256, shared_expert_intermediate_size=96, intermediate_size=128,
                      norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "olmoe": dict(_COMMON, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, intermediate_size=128,
                  norm_topk_prob=False, clip_qkv=1.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # gpt-oss: a 4-token window on alternate layers (prompts are longer), yarn stretching a
    # 32-position original context, a clamp low enough to bite, 16 experts top-4
    "gpt_oss": dict(_COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=16, num_experts_per_tok=4,
                    intermediate_size=64, sliding_window=4, swiglu_limit=2.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
    # DeepSeek: MLA with q_proj (V2-Lite) or the q LoRA (V3), values narrower than keys, a
    # dense first layer, a shared expert; V2 greedy softmax routing, V3 sigmoid routing over
    # 4 groups of 4 with a random correction bias, top-3 (slot order matters), yarn + mscale
    "deepseek_v2": dict(_COMMON, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=96, intermediate_size=96, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=1.0,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "deepseek_v3": dict(_COMMON, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
                        moe_intermediate_size=96, intermediate_size=96, first_k_dense_replace=1, n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                         "original_max_position_embeddings": 256, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # GLM-4.5: RoPE on a quarter of each 32-wide head (head_dim explicit), per-head q/k norms,
    # q/k/v biases (no o bias), a dense first layer, a shared expert, sigmoid routing over 4
    # groups of 8 (2 kept) with a random correction bias, top-3 scaled by 2.5; one kv head and
    # 32 experts, so that a quarter of the model holds a step's KV and activations
    "glm4_moe": dict(_COMMON, num_key_value_heads=1, head_dim=32, n_routed_experts=32, num_experts_per_tok=3,
                     n_shared_experts=1, moe_intermediate_size=64, intermediate_size=64, first_k_dense_replace=1,
                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True,
                     attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.25}),
    # MiniMax-M2: q/k norms over all heads at once (64 and 32 wide), RoPE on `rotary_dim` 8 of
    # each 16-wide head, 32 experts top-4 by sigmoid scores with a random correction bias
    "minimax_m2": dict(_COMMON, num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=32,
                       num_experts_per_tok=4, intermediate_size=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # ERNIE 4.5: RoPE on interleaved pairs, a dense first layer (MoE from moe_layer_start_index
    # 1), 32 experts top-3 by softmax with a random correction bias, two shared experts, a tied head
    "ernie4_5_moe": dict(_COMMON, num_key_value_heads=2, moe_num_experts=32, moe_k=3, moe_intermediate_size=48,
                         intermediate_size=96, moe_num_shared_experts=2, moe_layer_start_index=1,
                         moe_layer_interval=1, moe_layer_end_index=-1, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Llama 4: 4 layers, MoE every second (16 experts top-1, the sigmoid score scaling the input,
    # a shared expert) and dense MLPs between; RoPE layers with q/k L2 norms attending in chunks
    # of 16 positions (prompts are longer), the last layer NoPE over every position; llama3 RoPE
    "llama4_text": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=16,
                        num_experts_per_tok=1, intermediate_size=96, intermediate_size_mlp=128,
                        interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=16,
                        use_qk_norm=True, attn_temperature_tuning=True,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    # the linear-attention hybrids: 4 layers, three Gated DeltaNet (2 key heads serving 4 value
    # heads, a conv of kernel 4) and one gated full attention (RoPE on a quarter of each 16-wide
    # head); 32 experts top-4 renormalised and a shared expert behind its sigmoid gate
    "qwen3_next": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=32,
                       num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       intermediate_size=64, norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe_text": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=32,
                             num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}),
}
FAMILIES = tuple(PRESETS)


def build_family(out_dir, family: str, *, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random `family` checkpoint (config, weights in the hub layout, tokenizer)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    from klotski.builtin.tokenizer import save_tokenizer

    if family not in PRESETS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {**PRESETS[family], **overrides}
    tok = save_tokenizer(out, kwargs["vocab_size"], kwargs["max_position_embeddings"])
    ids = {name: tok.token_to_id(t) for name, t in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"))}
    config = CONFIG_MAPPING[family](**kwargs, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                                    pad_token_id=ids["pad"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases too: a test that reads the wrong one must fail
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # per-head sink logits large enough to take real weight
                p.copy_(torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):  # a parameter in ERNIE 4.5: zeros by default
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros by default: a router ignoring it would pass
                b.copy_(0.1 * torch.randn_like(b))
    model.to(dtypes.torch_dtypes()[dtype]).save_pretrained(out)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    return out


def pack_mxfp4(src, dst) -> Path:
    """A copy of the unquantized gpt-oss checkpoint `src` in the layout OpenAI publishes: experts
    as MXFP4 `*_blocks`/`*_scales` (klotski.compress.mxfp4.quantize), everything else as it was, and the
    `quantization_config` of the published config.json. Its dequantized experts are exactly
    representable, so transformers (which dequantizes it on CPU) and Klotski see one model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from klotski.compress import mxfp4

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, t in tensors.items():
        matrix = next((m for m in mxfp4.MATRICES if name.endswith(f"mlp.experts.{m}_proj")), None)
        if matrix is None:
            out[name] = t
            continue
        packed = [mxfp4.quantize(w.t()) for w in t]  # stored out-dim major: [rows, cols] per expert
        out[name + "_blocks"] = torch.stack([b for b, _ in packed]).contiguous()
        out[name + "_scales"] = torch.stack([s for _, s in packed]).contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
