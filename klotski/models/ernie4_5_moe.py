"""ERNIE 4.5 MoE (baidu/ERNIE-4.5-21B-A3B-PT, ERNIE-4.5-300B-A47B-PT): grouped-query attention
without biases, RoPE on interleaved pairs (dimensions 2i and 2i+1 turn together by frequency
i, in fp32, the result cast back), a dense SwiGLU MLP `intermediate_size` wide on the layers
the config gives no experts, and MoE layers from `moe_layer_start_index` to
`moe_layer_end_index` (-1: the last), every `moe_layer_interval`-th (planner/shapes.py
`moe_layers`, as transformers decides them). A MoE layer has `moe_num_experts` SwiGLU experts,
`moe_k` a token, beside shared experts: one SwiGLU `moe_num_shared_experts` x the expert
width, used by every token, added ungated.

The router as transformers' Ernie4_5_MoeTopKRouter: fp32 logits, softmax over every expert;
the choice is the top-k of the probabilities plus `e_score_correction_bias`; each pick is
weighed by its unbiased probability renormalised over the k (the sum clamped below at
`moe_norm_min`), cast to the activation dtype. The checkpoint keeps the router and the bias
in fp32, as transformers does; here every weight is held in the run's dtype: the same in an
fp32 run, and a 16-bit run may route near-ties differently. Likewise RoPE's cos/sin come in
the run's dtype (transformers keeps them in fp32 for this family).

The multi-token-prediction layer (`num_nextn_predict_layers`, tensors under `mtp`) is never
read: generation does not use it."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from klotski.models import defaults, fields
from klotski.models import layers as L
from klotski.models import mixtral, qwen3_moe
from planner.shapes import moe_layers

MODEL_TYPE = "ernie4_5_moe"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
NORM_MIN = 1e-12  # transformers' moe_norm_min default


def check_config(cfg: dict) -> None:
    """ERNIE's own fields (the shared ones, `moe_k` among them, are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (ERNIE's experts are SwiGLU)")
    if fields.boolean(cfg, "use_bias", default=False):
        raise fields.BadField("field 'use_bias' is true; biases on every projection are not supported (no "
                              "published ERNIE 4.5 MoE checkpoint has them): set it to false")
    layers = cfg["num_hidden_layers"]
    fields.integer(cfg, "moe_layer_start_index", low=0, default=1)
    fields.integer(cfg, "moe_layer_interval", default=1)
    if cfg.get("moe_layer_end_index", -1) != -1:
        fields.integer(cfg, "moe_layer_end_index", low=0, high=layers - 1, high_name="num_hidden_layers - 1")
    fields.integer(cfg, "moe_num_shared_experts", low=0, default=2)
    fields.positive_number(cfg, "moe_norm_min", default=NORM_MIN)
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}):
        raise fields.BadField("field 'rope_theta' is missing; transformers takes 500000 for ERNIE 4.5: set "
                              "rope_parameters {\"rope_type\": \"default\", \"rope_theta\": 500000.0}")
    if len(moe_layers(cfg)) < layers:
        fields.integer(cfg, "intermediate_size")  # the dense layers' MLP


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": True, "router_weights_fp32": False}


# ---- tensor names (hub layout; transformers' save_pretrained writes it: one tensor per expert
# matrix, the correction bias under `mlp.moe_statics`; fused experts: defaults.expert_refs)
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
expert_names = qwen3_moe.expert_names
attention_names = mixtral.attention_names


def gate_names(spec, layer: int) -> dict[str, str]:
    """A dense layer's norm and MLP; a MoE layer's norm, router, correction bias and shared experts."""
    p = f"model.layers.{layer}."
    if spec.shape.is_dense(layer):
        return {"post_norm": p + "post_attention_layernorm.weight", **qwen3_moe.dense_names(layer)}
    statics = "mlp.gate.moe_statics." if spec.fused_experts else "mlp.moe_statics."  # transformers' own naming
    names = {"post_norm": p + "post_attention_layernorm.weight", "router": p + "mlp.gate.weight",
             "router_bias": p + statics + "e_score_correction_bias"}
    if spec.shape.shared_intermediate_size:
        q = p + "mlp.shared_experts."
        names.update(shared_w1=q + "gate_proj.weight", shared_w3=q + "up_proj.weight", shared_w2=q + "down_proj.weight")
    return names


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    return {"router_bias": (1, spec.shape.num_experts)}


# ---- math ------------------------------------------------------------------------------
qkv = mixtral.qkv


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs of x [B, heads, T, D]: dimensions 2i and 2i+1 turn by the
    angle of frequency i (cos/sin [B, T, D] hold the D/2 angles twice, as layers.rope_tables
    makes them), in fp32, cast back."""
    half = cos.shape[-1] // 2
    cos = cos[:, None, :, :half].repeat_interleave(2, dim=-1).float()
    sin = sin[:, None, :, :half].repeat_interleave(2, dim=-1).float()
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.LINEAR_WEIGHTS  # the head only


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    """layers.attention_block with ERNIE's RoPE on interleaved pairs."""
    attend, shared = L.attention_core(L.attend, prefix, attend_at)
    x = L.rms_norm(h, w["input_norm"], spec.rms_norm_eps)
    q, k, v = (t.transpose(1, 2) for t in qkv(x, w, spec))
    q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
    keys, values = cache_write(k, v)
    return h + L.linear(L.in_blocks(attend, q, keys, values, mask, max_scores, shared), w, "o")


def route(x, gate: dict, spec):
    """Softmax over every expert in fp32; top-k of it plus the correction bias; the picks'
    probabilities renormalised (the sum at least moe_norm_min), cast to x's dtype."""
    if "router" not in gate:  # a dense layer
        return defaults.no_experts(x)
    probs = torch.softmax(F.linear(x.float(), gate["router"].float()), dim=1, dtype=torch.float32)
    experts = torch.topk(probs + gate["router_bias"].float().reshape(-1), spec.shape.top_k, dim=-1)[1]
    weights = probs.gather(1, experts)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=spec.config.get("moe_norm_min", NORM_MIN))
    return weights.to(x.dtype), experts


expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def shared_ffn(x, gate: dict, spec):
    """The shared experts (one SwiGLU, ungated) of a MoE layer; a dense layer's MLP."""
    if "dense_w1" in gate:
        return L.swiglu(x, gate, "dense_")
    return L.swiglu(x, gate, "shared_") if "shared_w1" in gate else None


recurrent_block = defaults.recurrent_block  # no linear-attention layers
