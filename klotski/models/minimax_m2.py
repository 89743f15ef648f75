"""MiniMax-M2 / M2.1 (MiniMaxAI/MiniMax-M2, transformers' MiniMaxM2*): full grouped-query
attention in every layer, q and k each RMS-normalised over the whole projection (all heads at
once: the norm weights are num_heads x head_dim and num_kv_heads x head_dim wide) before the
head split, RoPE on the first `rotary_dim` dimensions of each head (the rest pass unturned),
no projection biases; SwiGLU experts (Mixtral's hub layout, `block_sparse_moe.experts.{e}.w1/w2/w3`)
chosen by sigmoid scores plus `e_score_correction_bias` (the choice only) and weighed by their
unbiased scores renormalised over the k; no shared expert, no dense layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from klotski.models import defaults, fields, glm4_moe, mixtral
from klotski.models import layers as L

MODEL_TYPE = "minimax_m2"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs  # per-expert hub tensors, or transformers' fused ones
expert_names = mixtral.expert_names  # block_sparse_moe.experts.{e}.w1/w2/w3
shared_ffn = defaults.shared_ffn
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def check_config(cfg: dict) -> None:
    """MiniMax's own fields (the shared ones are checked by spec.check_config). The hub config
    also describes the model in fields transformers does not read; those that contradict this
    math are refused rather than ignored."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (MiniMax's experts are SwiGLU)")
    fields.choice(cfg, "scoring_func", ("sigmoid",), default="sigmoid", why=" (MiniMax-M2 routes by sigmoid scores)")
    if cfg.get("shared_intermediate_size"):
        raise fields.BadField(f"field 'shared_intermediate_size' is {cfg['shared_intermediate_size']!r}; MiniMax-M2 "
                              "has no shared expert: set it to 0")
    types = cfg.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(t != 1 for t in types)):
        raise fields.BadField(f"field 'attn_type_list' is {types!r}; MiniMax-M2 runs full softmax attention (1) in "
                              "every layer (lightning attention is MiniMax-Text-01's)")
    if fields.boolean(cfg, "attention_bias", default=False):
        raise fields.BadField("field 'attention_bias' is true; MiniMax-M2's projections have no biases: set it to "
                              "false")
    fields.integer(cfg, "head_dim")  # required: transformers' default (128) is not hidden_size / heads
    fields.integer(cfg, "rotary_dim", default=None, optional=True)
    rotary_dim(cfg)


def rotary_dim(cfg: dict) -> int:
    """The dimensions of each head RoPE turns (the first ones), as transformers reads them:
    `partial_rotary_factor` (rope_parameters', else the config's) x head_dim, else `rotary_dim`,
    else the whole head."""
    width, rotary = glm4_moe.head_dim(cfg), cfg.get("rotary_dim")
    factor = glm4_moe.rotary_factor(cfg, None)
    if factor is None and rotary is not None:
        return glm4_moe.checked_rotary(rotary / width, width, ("rotary_dim", rotary))
    return glm4_moe.checked_rotary(1.0 if factor is None else factor, width)


def options(cfg: dict) -> dict:
    # `cfg` may be empty (the profile's random layer): RoPE then turns whole heads
    return {"norm_topk_prob": True, "router_weights_fp32": False, "rotary_dim": rotary_dim(cfg) if cfg else None}


# ---- tensor names (hub layout; transformers' fused experts live under `mlp.`) -------------
def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    return {"router_bias": (spec.shape.num_experts,)}


def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {"input_norm": p + "input_layernorm.weight", **{n: p + f"self_attn.{n}_proj.weight" for n in "qkvo"},
            "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}


def gate_names(spec, layer: int) -> dict[str, str]:
    # the post-attention norm, the router and its correction bias: all used exactly at the gate
    p = f"model.layers.{layer}." + ("mlp." if spec.fused_experts else "block_sparse_moe.")
    return {"post_norm": f"model.layers.{layer}.post_attention_layernorm.weight", "router": p + "gate.weight",
            "router_bias": p + "e_score_correction_bias"}


# ---- math ------------------------------------------------------------------------------
def qkv(x, w: dict, spec):
    s, eps = spec.shape, spec.rms_norm_eps
    q = L.rms_norm(L.linear(x, w, "q"), w["q_norm"], eps)  # over all heads at once, then split
    k = L.rms_norm(L.linear(x, w, "k"), w["k_norm"], eps)
    return (L.split_heads(q, s.num_heads, s.head_dim), L.split_heads(k, s.num_kv_heads, s.head_dim),
            L.split_heads(L.linear(x, w, "v"), s.num_kv_heads, s.head_dim))


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


def route(x, gate: dict, spec):
    """Logits in the activation dtype (transformers keeps the router and its bias in the
    model's dtype), sigmoid in fp32; the bias only chooses; the k unbiased scores renormalised
    (fp32 weights)."""
    scores = F.linear(x, gate["router"].to(x.dtype)).float().sigmoid()
    choice = scores + gate["router_bias"].to(x.dtype)
    experts = torch.topk(choice, k=spec.shape.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts


recurrent_block = defaults.recurrent_block  # no linear-attention layers
