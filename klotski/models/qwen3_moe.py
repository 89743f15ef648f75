"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, 235B-A22B and their variants): RMSNorm of q and k per
head before RoPE, an explicit head_dim, 128 SwiGLU experts top-8 renormalised when
`norm_topk_prob`, router weights cast to the activation dtype."""
from __future__ import annotations

from klotski.models import defaults, fields
from klotski.models import layers as L

MODEL_TYPE = "qwen3_moe"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization


def check_config(cfg: dict) -> None:
    """Qwen's own fields (the shared ones are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (Qwen's experts are SwiGLU)")
    fields.boolean(cfg, "norm_topk_prob", default=False)
    fields.boolean(cfg, "use_sliding_window", default=False)
    if cfg.get("use_sliding_window"):
        raise fields.BadField("field 'use_sliding_window' is true; windows that differ per layer are not supported "
                              "(no published Qwen MoE checkpoint uses them): set it to false")
    dense = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    if dense or step != 1:
        raise fields.BadField(f"fields 'mlp_only_layers' {dense!r} / 'decoder_sparse_step' {step!r} ask for dense "
                              "layers, which are not supported yet; supported: [] and 1 (every layer MoE, as "
                              "every published Qwen MoE checkpoint)")


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "router_weights_fp32": False}


# ---- tensor names (hub layout)
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
local_shapes = defaults.local_shapes


def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    out = {"input_norm": p + "input_layernorm.weight", **{n: p + f"self_attn.{n}_proj.weight" for n in "qkvo"},
           "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return out


def gate_names(spec, layer: int) -> dict[str, str]:
    return {"post_norm": f"model.layers.{layer}.post_attention_layernorm.weight",
            "router": f"model.layers.{layer}.mlp.gate.weight"}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {"w1": p + "gate_proj.weight", "w3": p + "up_proj.weight", "w2": p + "down_proj.weight"}


# ---- math ------------------------------------------------------------------------------
def qkv(x, w: dict, spec):
    eps = spec.rms_norm_eps
    q = L.rms_norm(L.split_heads(L.linear(x, w, "q"), spec.num_heads, spec.head_dim), w["q_norm"], eps)
    k = L.rms_norm(L.split_heads(L.linear(x, w, "k"), spec.num_kv_heads, spec.head_dim), w["k_norm"], eps)
    return q, k, L.split_heads(L.linear(x, w, "v"), spec.num_kv_heads, spec.head_dim)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None):
    return L.attention_block(h, w, cos, sin, mask, cache_write, spec, qkv, max_scores, attend_at=attend_at)


def route(x, gate: dict, spec):
    return L.route(x, gate["router"], spec.top_k, renormalise=spec.norm_topk_prob, cast=True)


expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
shared_ffn = defaults.shared_ffn
