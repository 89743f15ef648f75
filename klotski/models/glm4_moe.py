"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (zai-org/GLM-4.5, transformers' Glm4Moe*): grouped-query
attention with biases on q/k/v only (`attention_bias`; o_proj never has one), an optional
RMSNorm of q and k per head (`use_qk_norm`), RoPE on the first `partial_rotary_factor` of
each head's dimensions (half when the config says nothing, as transformers; the rest pass
unturned), dense first layers (`first_k_dense_replace`, 1 by default), shared experts beside
the routed ones, and DeepSeek-V3's router: sigmoid scores; the choice adds
`e_score_correction_bias`, keeps the `topk_group` of `n_group` groups whose two best biased
scores sum highest and takes the top-k there; each pick is weighed by its unbiased score,
renormalised over the k (`norm_topk_prob`) and times `routed_scaling_factor`.

A dense layer's MLP travels in its gate group (`dense_w1/w3/w2`), a MoE layer's shared experts
too (`shared_w1/w3/w2`), as DeepSeek's. The hub checkpoints carry a multi-token-prediction
layer (`model.layers.{num_hidden_layers}`, `num_nextn_predict_layers`): it is never read,
generation does not use it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from klotski.models import defaults, fields
from klotski.models import layers as L

MODEL_TYPE = "glm4_moe"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs  # per-expert hub tensors, or transformers' fused ones
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def check_config(cfg: dict) -> None:
    """GLM's own fields (the shared ones are checked by spec.check_config); defaults are
    transformers' Glm4MoeConfig's."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (GLM's experts are SwiGLU)")
    layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    fields.integer(cfg, "n_shared_experts", low=0, default=1)
    if fields.integer(cfg, "first_k_dense_replace", low=0, high=layers, high_name="num_hidden_layers", default=1):
        fields.integer(cfg, "intermediate_size")  # the dense MLP's width
    groups = fields.integer(cfg, "n_group", high=experts, high_name="n_routed_experts", default=1)
    fields.divisible("n_routed_experts", experts, "n_group", groups)
    if experts // groups < 2:
        raise fields.BadField(f"field 'n_group' is {groups}; each group needs at least two experts (a group scores "
                              "as the sum of its two best)")
    kept = fields.integer(cfg, "topk_group", high=groups, high_name="n_group", default=1)
    if cfg["num_experts_per_tok"] > kept * (experts // groups):
        raise fields.BadField(f"field 'num_experts_per_tok' is {cfg['num_experts_per_tok']}; must be at most the "
                              f"experts of the topk_group groups kept ({kept} x {experts // groups})")
    fields.boolean(cfg, "norm_topk_prob", default=True)
    fields.positive_number(cfg, "routed_scaling_factor", default=1.0)
    fields.boolean(cfg, "use_qk_norm", default=False)
    fields.boolean(cfg, "attention_bias", default=False)
    rotary_dim(cfg)


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rotary_factor(cfg: dict, default: float):
    """`partial_rotary_factor` where transformers looks for it: in rope_parameters, else at the
    config's top level, else `default`."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))


def rotary_dim(cfg: dict) -> int:
    """The dimensions of each head RoPE turns (the first ones): head_dim x partial_rotary_factor,
    even, from 2 to head_dim."""
    return checked_rotary(rotary_factor(cfg, 0.5), head_dim(cfg))


def checked_rotary(factor, width: int, source: tuple | None = None) -> int:
    """int(width x factor), as transformers truncates it, where that is a rotary width RoPE can
    turn (pairs of dimensions, at least one, at most the head); a refusal names `source`
    (field, value) where the factor was derived from another field."""
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
    dim = int(width * factor) if ok else 0
    if not (2 <= dim <= width and dim % 2 == 0):
        name, value = source or ("partial_rotary_factor", factor)
        raise fields.BadField(f"field {name!r} is {value!r}; RoPE must turn an even number of each head's "
                              f"{width} dimensions (head_dim), at least 2, not {dim}")
    return dim


def options(cfg: dict) -> dict:
    # `cfg` may be empty (the profile's random layer): RoPE then turns whole heads
    rotary = rotary_dim(cfg) if cfg else None
    return {"norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "router_weights_fp32": True,
            "rotary_dim": rotary}


# ---- tensor names (hub layout) -----------------------------------------------------------
_MLP = (("w1", "gate"), ("w3", "up"), ("w2", "down"))


def attention_names(spec, layer: int) -> dict[str, str]:
    """q/k/v/o (their biases are added by the spec) and, with `use_qk_norm`, q/k norms."""
    p = f"model.layers.{layer}."
    names = {"input_norm": p + "input_layernorm.weight", **{n: p + f"self_attn.{n}_proj.weight" for n in "qkvo"}}
    if spec.shape.qk_norm:
        names.update({"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"})
    return names


def gate_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    if spec.shape.is_dense(layer):
        mlp = {f"dense_{w}": p + f"mlp.{n}_proj.weight" for w, n in _MLP}
    else:
        mlp = {"router": p + "mlp.gate.weight", "router_bias": p + "mlp.gate.e_score_correction_bias"}
        if spec.shape.shared_intermediate_size:
            mlp.update({f"shared_{w}": p + f"mlp.shared_experts.{n}_proj.weight" for w, n in _MLP})
    return {"post_norm": p + "post_attention_layernorm.weight", **mlp}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {w: p + f"{n}_proj.weight" for w, n in _MLP}


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    return {"router_bias": (spec.shape.num_experts,)}


# ---- math ------------------------------------------------------------------------------
def qkv(x, w: dict, spec):
    s = spec.shape
    q = L.split_heads(L.linear(x, w, "q"), s.num_heads, s.head_dim)
    k = L.split_heads(L.linear(x, w, "k"), s.num_kv_heads, s.head_dim)
    if "q_norm" in w:  # per head, before RoPE
        q, k = L.rms_norm(q, w["q_norm"], spec.rms_norm_eps), L.rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    return q, k, L.split_heads(L.linear(x, w, "v"), s.num_kv_heads, s.head_dim)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


def route(x, gate: dict, spec):
    """Sigmoid scores in fp32; the correction bias only chooses; groups as DeepSeek-V3's."""
    if "router" not in gate:  # a dense layer
        return defaults.no_experts(x)
    cfg = spec.config
    scores = F.linear(x.float(), gate["router"].float()).sigmoid()
    choice = scores + gate["router_bias"]
    groups = cfg.get("n_group", 1)
    if groups > 1:
        best_two = choice.view(len(x), groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        keep = L.group_mask(best_two, cfg.get("topk_group", 1), choice.shape[-1])
        choice = choice.masked_fill(~keep, float("-inf"))
    experts = torch.topk(choice, k=spec.shape.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if cfg.get("norm_topk_prob", True):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.get("routed_scaling_factor", 1.0), experts


def shared_ffn(x, gate: dict, spec):
    """A dense layer's MLP, or a MoE layer's shared experts (always added)."""
    if "dense_w1" in gate:
        return L.swiglu(x, gate, "dense_")
    return L.swiglu(x, gate, "shared_") if "shared_w1" in gate else None


recurrent_block = defaults.recurrent_block  # no linear-attention layers
