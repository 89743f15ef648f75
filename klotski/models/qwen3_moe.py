"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, 235B-A22B and their variants): RMSNorm of q and k per
head before RoPE, an explicit head_dim, 128 SwiGLU experts top-8 renormalised when
`norm_topk_prob`, router weights cast to the activation dtype.

Dense layers (`mlp_only_layers`, `decoder_sparse_step`; the shape's `is_dense` decides as
transformers does): a plain SwiGLU MLP `intermediate_size` wide under `mlp.`, no router and
no experts. It travels in the layer's gate group (`dense_w1/w3/w2`), its router picks no
expert and the pipeline adds its output the way it adds a shared expert's, as DeepSeek's."""
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
    check_dense_layers(cfg)


def check_dense_layers(cfg: dict) -> None:
    """`decoder_sparse_step` a positive integer, `mlp_only_layers` a list of layer indices and,
    where any layer is dense, its MLP's `intermediate_size`."""
    step = fields.integer(cfg, "decoder_sparse_step", default=1, optional=True) or 1
    only = cfg.get("mlp_only_layers")
    layers = cfg["num_hidden_layers"]
    if only is not None and not (isinstance(only, list) and all(
            isinstance(j, int) and not isinstance(j, bool) and 0 <= j < layers for j in only)):
        raise fields.BadField(f"field 'mlp_only_layers' is {only!r}; must be a list of layer indices from 0 to "
                              f"num_hidden_layers - 1 ({layers - 1})")
    if only or step != 1:
        fields.integer(cfg, "intermediate_size")  # the dense MLP's width


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
    p = f"model.layers.{layer}."
    if spec.shape.is_dense(layer):
        return {"post_norm": p + "post_attention_layernorm.weight", **dense_names(layer)}
    return {"post_norm": p + "post_attention_layernorm.weight", "router": p + "mlp.gate.weight"}


def dense_names(layer: int) -> dict[str, str]:
    """A dense layer's MLP (Qwen2-MoE's too)."""
    p = f"model.layers.{layer}.mlp."
    return {"dense_w1": p + "gate_proj.weight", "dense_w3": p + "up_proj.weight", "dense_w2": p + "down_proj.weight"}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {"w1": p + "gate_proj.weight", "w3": p + "up_proj.weight", "w2": p + "down_proj.weight"}


# ---- math ------------------------------------------------------------------------------
def qkv(x, w: dict, spec):
    eps = spec.rms_norm_eps
    q = L.rms_norm(L.split_heads(L.linear(x, w, "q"), spec.shape.num_heads, spec.shape.head_dim), w["q_norm"], eps)
    k = L.rms_norm(L.split_heads(L.linear(x, w, "k"), spec.shape.num_kv_heads, spec.shape.head_dim), w["k_norm"], eps)
    return q, k, L.split_heads(L.linear(x, w, "v"), spec.shape.num_kv_heads, spec.shape.head_dim)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


def route(x, gate: dict, spec):
    if "router" not in gate:  # a dense layer
        return defaults.no_experts(x)
    return L.route(x, gate["router"], spec.shape.top_k, renormalise=spec.norm_topk_prob, cast=True)


expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def shared_ffn(x, gate: dict, spec):
    """A dense layer's MLP; nothing beside the routed experts of a MoE layer."""
    return L.swiglu(x, gate, "dense_") if "dense_w1" in gate else None


recurrent_block = defaults.recurrent_block  # no linear-attention layers
