"""DeepSeek-V3 / R1 (deepseek-ai/DeepSeek-V3): V2's MLA, dense first layers and shared experts
(deepseek_v2.py), with sigmoid routing: each expert scores sigmoid(logit); the choice adds
`e_score_correction_bias`, keeps the `topk_group` of `n_group` groups whose two best biased
scores sum highest, takes the top-k there, and weighs each pick by its unbiased score,
renormalised over the k (`norm_topk_prob`) and times `routed_scaling_factor`. RoPE on
even/odd slices when `rope_interleave` (the default), else rotate-half.

The hub checkpoint is FP8 (`quantization_config` fp8, e4m3 weights with a
`weight_scale_inv` per `weight_block_size` block): the store dequantizes each weight as it
reads it from disk (placement/store.py `read_ref`), so host and device tiers hold the compute
dtype. The multi-token-prediction layer (`model.layers.{num_hidden_layers}`,
`num_nextn_predict_layers`) is never read: generation does not use it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from klotski.models import deepseek_v2 as V2
from klotski.models import fields
from klotski.models import layers as L

MODEL_TYPE = "deepseek_v3"
QUANTIZATION = ("fp8",)  # FP8 blocks as shipped (check_quantization); unquantized otherwise
HOST_ATTENTION = V2.HOST_ATTENTION
LINEAR_WEIGHTS = V2.LINEAR_WEIGHTS
options = V2.options
expert_names = V2.expert_names
expert_refs = V2.expert_refs
group_refs = V2.group_refs  # by this module's gate_names, through spec.family
attention_names = V2.attention_names
local_shapes = V2.local_shapes
expert_ffn = V2.expert_ffn
bind_expert_ffn = V2.bind_expert_ffn
bind_grouped_expert_ffn = V2.bind_grouped_expert_ffn
shared_ffn = V2.shared_ffn
softmax_scale = V2.softmax_scale


def check_config(cfg: dict) -> None:
    routing = dict(cfg, topk_method="greedy")  # V3's own routing is checked below
    V2.check_config(routing)
    fields.choice(cfg, "topk_method", ("noaux_tc",), default="noaux_tc", why=" (DeepSeek-V3 routes by sigmoid scores)")
    V2.check_groups(cfg)
    if cfg["n_routed_experts"] // cfg["n_group"] < 2:
        raise fields.BadField(f"field 'n_group' is {cfg['n_group']}; each group needs at least two experts (a group "
                              "scores as the sum of its two best)")
    fields.boolean(cfg, "norm_topk_prob", default=True)
    fields.boolean(cfg, "rope_interleave", default=True)


def check_quantization(quant) -> None:
    """The FP8 block format DeepSeek-V3 ships (e4m3 weights, fp32 inverse scales per block)."""
    ok = isinstance(quant, dict) and quant.get("quant_method") == "fp8" and quant.get("fmt", "e4m3") == "e4m3"
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if not ok or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise fields.BadField(f"field 'quantization_config' is {quant!r}; DeepSeek-V3 is read as shipped in FP8 "
                              "(quant_method 'fp8', fmt 'e4m3', weight_block_size [rows, columns]) or unquantized")


def gate_names(spec, layer: int) -> dict[str, str]:
    names = V2.gate_names(spec, layer)
    if layer >= spec.shape.dense_layers:
        names["router_bias"] = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return names


def rotate(q, k, cos, sin, spec):
    if not spec.config.get("rope_interleave", True):
        return L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]

    def turn(x):  # pairs (x0, x1), ... rotated; the result keeps evens first, then odds, as transformers
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return turn(q), turn(k)


SHARED_PREFIX = V2.SHARED_PREFIX
SPARSE_ATTENTION = V2.SPARSE_ATTENTION


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    if prefix is not None:
        raise ValueError("MLA attention does not read a shared prefix (SHARED_PREFIX is False)")
    return V2.mla_block(h, w, cos, sin, mask, cache_write, spec, max_scores, attend_at, rotate)


def route(x, gate: dict, spec):
    if "router" not in gate:
        return V2.no_experts(x)
    cfg = spec.config
    scores = F.linear(x.float(), gate["router"].float()).sigmoid()
    choice = scores + gate["router_bias"]
    groups = cfg.get("n_group", 1)
    best_two = choice.view(len(x), groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~L.group_mask(best_two, cfg.get("topk_group", groups), choice.shape[-1]),
                                float("-inf"))
    experts = torch.topk(choice, k=spec.shape.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if cfg.get("norm_topk_prob", True):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.get("routed_scaling_factor", 1.0), experts


recurrent_block = V2.recurrent_block  # no linear-attention layers
