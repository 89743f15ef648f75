"""Mixtral (mistralai/Mixtral-8x7B, 8x22B): grouped-query attention without biases or q/k
norms, 8 SwiGLU experts, top-2 renormalised router whose weights stay fp32."""
from __future__ import annotations

from klotski.models import defaults, fields
from klotski.models import layers as L

MODEL_TYPE = "mixtral"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization


def check_config(cfg: dict) -> None:
    """Mixtral's own fields (the shared ones are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (Mixtral's experts are SwiGLU)")


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": True, "router_weights_fp32": True}


# ---- tensor names (hub layout; the fused expert layout is common to all families: defaults.py)
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
local_shapes = defaults.local_shapes


def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {"input_norm": p + "input_layernorm.weight",
            **{n: p + f"self_attn.{n}_proj.weight" for n in "qkvo"}}


def gate_names(spec, layer: int) -> dict[str, str]:
    # The post-attention norm travels with the router: both are used exactly at the gate.
    part = "mlp" if spec.fused_experts else "block_sparse_moe"
    return {"post_norm": f"model.layers.{layer}.post_attention_layernorm.weight",
            "router": f"model.layers.{layer}.{part}.gate.weight"}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return {w: p + f"{w}.weight" for w in ("w1", "w2", "w3")}


# ---- math ------------------------------------------------------------------------------
def qkv(x, w: dict, spec):
    return (L.split_heads(L.linear(x, w, "q"), spec.shape.num_heads, spec.shape.head_dim),
            L.split_heads(L.linear(x, w, "k"), spec.shape.num_kv_heads, spec.shape.head_dim),
            L.split_heads(L.linear(x, w, "v"), spec.shape.num_kv_heads, spec.shape.head_dim))


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


def route(x, gate: dict, spec):
    return L.route(x, gate["router"], spec.shape.top_k, renormalise=True, cast=False)


expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn
shared_ffn = defaults.shared_ffn


recurrent_block = defaults.recurrent_block  # no linear-attention layers
