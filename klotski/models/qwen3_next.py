"""Qwen3-Next (Qwen/Qwen3-Next-80B-A3B, transformers' Qwen3Next*): a linear-attention hybrid.
`layer_types` (or every `full_attention_interval`-th layer, 4) says which layers are gated full
attention; the others are Gated DeltaNet (gated_deltanet.py), which keep a fixed-size recurrent
state per sequence instead of keys and values (the pipeline hands `recurrent_block` that state).

Full attention: q_proj is twice as wide, each head's query followed by its output gate
(sigmoid(gate) scales the attention's output before o_proj); per-head q/k RMSNorms; RoPE on
the first `partial_rotary_factor` (0.25) of each head. Every RMSNorm but the DeltaNet's gated one
scales by 1 + w (`norm_offset`). MoE: softmax top-k renormalised (`norm_topk_prob`), weights cast
to the activation dtype, a shared expert behind a sigmoid gate (`shared_expert_gate`), dense
layers by `mlp_only_layers` / `decoder_sparse_step` as Qwen3-MoE's. The DeltaNet's input
projection is fused: `in_proj_qkvz` and `in_proj_ba`, grouped per key head. The hub checkpoints'
multi-token-prediction weights (`mtp.*`) are never read.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from klotski.models import defaults, fields, gated_deltanet, glm4_moe, qwen2_moe, qwen3_moe
from klotski.models import layers as L
from klotski.models.gated_deltanet import sizes
from planner.shapes import LINEAR_DEFAULTS

MODEL_TYPE = "qwen3_next"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn
expert_names = qwen3_moe.expert_names
shared_ffn = qwen2_moe.shared_ffn  # the shared expert times sigmoid(shared_expert_gate x); a dense MLP

HOST_ATTENTION = True  # the full-attention layers' core runs beside a host KV cache (DeltaNet layers: on the device)
LINEAR_WEIGHTS = defaults.LINEAR_WEIGHTS  # the head only
SHARED_PREFIX = True  # full attention reads a shared prefix's keys; DeltaNet starts from its state (the cache's)
# sink/window sparsity thins full attention's keys, but the DeltaNet layers' state holds every token:
# neither the sparse model nor the full one; refused
SPARSE_ATTENTION = False

LAYER_TYPES = ("linear_attention", "full_attention")


def check_config(cfg: dict) -> None:
    """The hybrid's own fields (the shared ones are checked by spec.check_config); defaults are
    transformers' config class's."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (the experts are SwiGLU, the conv's activation silu)")
    fields.boolean(cfg, "norm_topk_prob", default=True)
    if cfg.get("attention_bias"):
        raise fields.BadField("field 'attention_bias' is true; no published Qwen3-Next / Qwen3.5 checkpoint has "
                              "attention biases and the DeltaNet layers have none: set it to false")
    qwen3_moe.check_dense_layers(cfg)
    fields.integer(cfg, "shared_expert_intermediate_size", low=0, default=512)
    types = cfg.get("layer_types")
    layers = cfg["num_hidden_layers"]
    if types is not None and not (isinstance(types, list) and len(types) == layers
                                  and all(t in LAYER_TYPES for t in types)):
        raise fields.BadField(f"field 'layer_types' is {types!r}; must list {layers} (num_hidden_layers) of "
                              f"{' / '.join(LAYER_TYPES)}")
    if types is None:
        fields.integer(cfg, "full_attention_interval", default=4)
    for name, default in LINEAR_DEFAULTS.items():
        fields.integer(cfg, name, default=default)
    fields.divisible("linear_num_value_heads", cfg.get("linear_num_value_heads", LINEAR_DEFAULTS["linear_num_value_heads"]),
                     "linear_num_key_heads", cfg.get("linear_num_key_heads", LINEAR_DEFAULTS["linear_num_key_heads"]))
    glm4_moe.checked_rotary(glm4_moe.rotary_factor(cfg, 0.25), glm4_moe.head_dim(cfg))


def options(cfg: dict) -> dict:
    # `cfg` may be empty (the profile's random layer): RoPE then turns whole heads
    rotary = glm4_moe.checked_rotary(glm4_moe.rotary_factor(cfg, 0.25), glm4_moe.head_dim(cfg)) if cfg else None
    return {"norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "router_weights_fp32": False,
            "rotary_dim": rotary, "norm_offset": 1.0}


# ---- tensor names (hub layout) -----------------------------------------------------------
PROJECTIONS = {"qkvz": "in_proj_qkvz", "ba": "in_proj_ba"}  # DeltaNet input projections: local name -> module


def attention_names(spec, layer: int) -> dict[str, str]:
    """A DeltaNet layer's weights (linear_attn.*), or a full-attention layer's (self_attn.*)."""
    return hybrid_attention_names(spec, layer, PROJECTIONS)


def hybrid_attention_names(spec, layer: int, projections: dict) -> dict[str, str]:
    p = f"model.layers.{layer}."
    if spec.shape.is_linear(layer):
        return gated_deltanet.names(p, projections)
    return qwen3_moe.attention_names(spec, layer)


def gate_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    if spec.shape.is_dense(layer):
        return {"post_norm": p + "post_attention_layernorm.weight", **qwen3_moe.dense_names(layer)}
    out = {"post_norm": p + "post_attention_layernorm.weight", "router": p + "mlp.gate.weight"}
    if spec.shape.shared_intermediate_size:
        out.update({f"shared_{w}": p + f"mlp.shared_expert.{n}_proj.weight"
                    for w, n in (("w1", "gate"), ("w3", "up"), ("w2", "down"))})
        out["shared_gate"] = p + "mlp.shared_expert_gate.weight"
    return out


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    Hk, Hv, Dk, Dv = sizes(spec)
    H = spec.shape.hidden_size
    return hybrid_shapes(spec, {"qkvz": (2 * Hk * Dk + 2 * Hv * Dv, H), "ba": (2 * Hv, H)})


def hybrid_shapes(spec, projections: dict) -> dict[str, tuple[int, ...]]:
    """The gated q projection (query and gate per head) and the DeltaNet layers' weights."""
    s = spec.shape
    return {"q": (2 * s.num_heads * s.head_dim, s.hidden_size), **gated_deltanet.local_shapes(spec, projections)}


# ---- math ------------------------------------------------------------------------------
def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    """Gated full attention: per-head q/k norms (1 + w), partial RoPE, softmax attention (over a
    shared prefix's keys first where given), the output times sigmoid of the query's gate, o_proj."""
    s, eps, offset = spec.shape, spec.rms_norm_eps, spec.norm_offset
    x = L.rms_norm(h, w["input_norm"], eps, offset)
    B, T, _ = x.shape
    q, gate = L.linear(x, w, "q").view(B, T, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
    q = L.rms_norm(q, w["q_norm"], eps, offset)
    k = L.rms_norm(L.split_heads(L.linear(x, w, "k"), s.num_kv_heads, s.head_dim), w["k_norm"], eps, offset)
    v = L.split_heads(L.linear(x, w, "v"), s.num_kv_heads, s.head_dim)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    keys, values = cache_write(k, v)
    attend, shared = L.attention_core(L.attend, prefix, attend_at)
    out = L.in_blocks(attend, q, keys, values, mask, max_scores, shared)
    return h + L.linear(out * torch.sigmoid(gate.reshape(B, T, -1)), w, "o")


def project(x, w: dict, spec):
    """in_proj_qkvz and in_proj_ba, grouped per key head ([q, k, v..., z...] and [b..., a...]
    each), into q|k|v [B, T, C], z [B, T, Hv, Dv], b and a [B, T, Hv]."""
    Hk, Hv, Dk, Dv = sizes(spec)
    r = Hv // Hk
    B, T, _ = x.shape
    q, k, v, z = torch.split(F.linear(x, w["qkvz"]).view(B, T, Hk, 2 * Dk + 2 * r * Dv), [Dk, Dk, r * Dv, r * Dv], dim=3)
    b, a = torch.split(F.linear(x, w["ba"]).view(B, T, Hk, 2 * r), [r, r], dim=3)
    mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
    return mixed, z.reshape(B, T, Hv, Dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)


def recurrent_block(h, w, state, valid, spec):
    """A Gated DeltaNet layer over one batch with its recurrent state (gated_deltanet.block)."""
    return gated_deltanet.block(h, w, state, valid, spec, project)


def route(x, gate: dict, spec):
    if "router" not in gate:  # a dense layer
        return defaults.no_experts(x)
    return L.route(x, gate["router"], spec.shape.top_k, renormalise=spec.norm_topk_prob, cast=True)
