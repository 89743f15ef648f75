"""DeepSeek-V2 and V2-Lite (deepseek-ai/DeepSeek-V2, DeepSeek-V2-Lite): multi-head latent
attention (MLA), dense first layers, shared experts beside routed ones, greedy or
group-limited greedy routing scaled by `routed_scaling_factor`.

MLA caches what transformers caches: per token and layer the normalised latent c
(kv_lora_rank values) and the rotated shared key k_rot (qk_rope_head_dim values), 576 in
V2-Lite where full keys and values would take 16 heads x (192 + 128) = 5,120. `BatchKV`
holds c as its "keys" and k_rot as its "values"; attention decodes keys and values of every
head from c with kv_b_proj at use (the naive form, as transformers does, so fp32 stays
token-identical). Queries and keys are nope + rope = 192 wide, values 128.

A dense first layer (`first_k_dense_replace`) has no experts: its gate group holds the
post-attention norm and the dense MLP (`dense_w1/w3/w2`), its router returns no choice, and
the pipeline adds the MLP's output the way it adds a shared expert's. The shared experts of
a MoE layer travel in its gate group (`shared_w1/w3/w2`), like Qwen2-MoE's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from klotski.models import defaults, fields
from klotski.models import layers as L

MODEL_TYPE = "deepseek_v2"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
ROUTINGS = ("greedy", "group_limited_greedy")


def check_config(cfg: dict) -> None:
    """DeepSeek's own fields (the shared ones are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (DeepSeek's experts are SwiGLU)")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        fields.integer(cfg, name)
    if cfg["qk_rope_head_dim"] % 2:
        raise fields.BadField(f"field 'qk_rope_head_dim' is {cfg['qk_rope_head_dim']}; must be even "
                              "(RoPE rotates pairs of dimensions)")
    fields.integer(cfg, "q_lora_rank", default=None, optional=True)
    fields.integer(cfg, "n_shared_experts", low=0, default=0, optional=True)
    dense = fields.integer(cfg, "first_k_dense_replace", low=0, high=cfg["num_hidden_layers"],
                           high_name="num_hidden_layers", default=0, optional=True)
    if dense:
        fields.integer(cfg, "intermediate_size")
    for name in ("attention_bias", "mlp_bias"):
        if fields.boolean(cfg, name, default=False):
            raise fields.BadField(f"field {name!r} is true; DeepSeek checkpoints have no projection biases: set it "
                                  "to false")
    fields.positive_number(cfg, "routed_scaling_factor", default=1.0)
    check_routing(cfg)


def check_routing(cfg: dict) -> None:
    method = fields.choice(cfg, "topk_method", ROUTINGS, default="greedy")
    if method == "group_limited_greedy":
        check_groups(cfg)


def check_groups(cfg: dict) -> None:
    experts = cfg["n_routed_experts"]
    groups = fields.integer(cfg, "n_group", high=experts, high_name="n_routed_experts")
    fields.divisible("n_routed_experts", experts, "n_group", groups)
    fields.integer(cfg, "topk_group", high=groups, high_name="n_group")


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": False, "router_weights_fp32": True}


# ---- tensor groups (hub layout) -------------------------------------------------------
def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    q = {"q_a": a + "q_a_proj.weight", "q_a_norm": a + "q_a_layernorm.weight", "q_b": a + "q_b_proj.weight"} \
        if spec.shape.q_lora_rank else {"q": a + "q_proj.weight"}
    return {"input_norm": p + "input_layernorm.weight", **q, "kv_a": a + "kv_a_proj_with_mqa.weight",
            "kv_a_norm": a + "kv_a_layernorm.weight", "kv_b": a + "kv_b_proj.weight", "o": a + "o_proj.weight"}


def gate_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    if layer < spec.shape.dense_layers:
        mlp = {f"dense_{w}": p + f"mlp.{n}_proj.weight" for w, n in _MLP}
    else:
        mlp = {"router": p + "mlp.gate.weight", **{f"shared_{w}": p + f"mlp.shared_experts.{n}_proj.weight"
                                                   for w, n in _MLP}}
    return {"post_norm": p + "post_attention_layernorm.weight", **mlp}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {w: p + f"{n}_proj.weight" for w, n in _MLP}


expert_refs = defaults.expert_refs
_MLP = (("w1", "gate"), ("w3", "up"), ("w2", "down"))
# weights an FP8 checkpoint stores as float8 with block scales (V3); norms, router, embedding
# and head stay as they are
_FP8 = {"q", "q_a", "q_b", "kv_a", "kv_b", "o", "w1", "w2", "w3"} | {f"{p}_{w}" for p in ("shared", "dense")
                                                                  for w in ("w1", "w2", "w3")}


def group_refs(spec, key: tuple) -> dict:
    """The spec's tensor refs of a group, by this family's names; with FP8 block scales where
    the checkpoint has them (`quantization_config`, DeepSeek-V3)."""
    return {n: _scaled(spec, n, r) for n, r in defaults.group_refs(spec, key).items()}


def fp8_block(spec) -> tuple[int, int] | None:
    quant = spec.config.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    return tuple(block) if quant.get("quant_method") == "fp8" and block else None


def _scaled(spec, local: str, ref):
    block = fp8_block(spec)
    if block is None or local not in _FP8 or ref.index is not None:
        return ref
    import dataclasses
    return dataclasses.replace(ref, scale=ref.name.removesuffix("weight") + "weight_scale_inv", block=block)


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    s = spec.shape
    H, h, r, rope = s.hidden_size, s.num_heads, s.kv_lora_rank, s.head_dim
    qk, ql, D, Is = s.qk_nope_head_dim + rope, s.q_lora_rank, s.dense_intermediate_size, s.shared_intermediate_size
    return {"q": (h * qk, H), "q_a": (ql, H), "q_a_norm": (ql,), "q_b": (h * qk, ql), "kv_a": (r + rope, H),
            "kv_a_norm": (r,), "kv_b": (h * (s.qk_nope_head_dim + s.v_head_dim), r), "o": (H, h * s.v_head_dim),
            "router_bias": (s.num_experts,), "shared_w1": (Is, H), "shared_w3": (Is, H), "shared_w2": (H, Is),
            "dense_w1": (D, H), "dense_w3": (D, H), "dense_w2": (H, D)}


# ---- math ------------------------------------------------------------------------------
def softmax_scale(spec) -> float:
    """(nope + rope)^-1/2, times yarn's mscale(factor, mscale_all_dim)^2 where the config
    scales its RoPE (as transformers' `yarn_apply_mscale`)."""
    scale = (spec.shape.qk_nope_head_dim + spec.shape.head_dim) ** -0.5
    rope = spec.config.get("rope_parameters") or spec.config.get("rope_scaling") or {}  # checked by spec
    all_dim = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and all_dim and rope["factor"] > 1:
        m = 0.1 * all_dim * math.log(rope["factor"]) + 1.0
        scale = scale * m * m
    return scale


def rotate(q, k, cos, sin, spec):
    """V2's rotary embedding: interleaved pairs (x0, x1), (x2, x3), ... rotated as complex
    numbers, on the rope part only. cos/sin [B, T, rope] are the pipeline's tables (halves
    repeated, attention scaling applied)."""
    half = cos.shape[-1] // 2
    freqs = torch.complex(cos[..., :half].float(), sin[..., :half].float())[:, None]

    def turn(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)
    return turn(q), turn(k)


# Its attention core stays beside the latent cache: keys and values are expanded from the
# latent by a projection, and the latent cache is small to move anyway.
HOST_ATTENTION = False
LINEAR_WEIGHTS = defaults.LINEAR_WEIGHTS  # the head only


# Not shared: MLA expands every head's keys and values from the cached latent per batch;
# a shared latent prefix would need the absorbed form (attention over the latent itself).
SHARED_PREFIX = False
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    if prefix is not None:
        raise ValueError("MLA attention does not read a shared prefix (SHARED_PREFIX is False)")
    return mla_block(h, w, cos, sin, mask, cache_write, spec, max_scores, attend_at, rotate)


def mla_block(h, w, cos, sin, mask, cache_write, spec, max_scores, attend_at, rotate):
    """Residual MLA sub-layer for one batch; `cache_write(c, k_rot)` stores this step's latent
    [B, 1, T, r] and rotary key [B, 1, T, rope] and returns every one the batch has so far.
    `rotate` is the version's RoPE."""
    if attend_at is not None:
        raise ValueError("MLA attention runs beside its latent cache only (HOST_ATTENTION is False)")
    s, eps = spec.shape, spec.rms_norm_eps
    B, T, _ = h.shape
    heads, nope, rope, r = s.num_heads, s.qk_nope_head_dim, s.head_dim, s.kv_lora_rank
    x = L.rms_norm(h, w["input_norm"], eps)
    q = L.linear(x, w, "q") if "q" in w else \
        F.linear(L.rms_norm(F.linear(x, w["q_a"]), w["q_a_norm"], eps), w["q_b"])
    q_pass, q_rot = torch.split(q.view(B, T, heads, nope + rope).transpose(1, 2), [nope, rope], dim=-1)
    c, k_rot = torch.split(F.linear(x, w["kv_a"]), [r, rope], dim=-1)
    c = L.rms_norm(c, w["kv_a_norm"], eps).view(B, 1, T, r)
    q_rot, k_rot = rotate(q_rot, k_rot.view(B, 1, T, rope), cos, sin, spec)
    latent, k_rot = cache_write(c, k_rot)
    query = torch.cat((q_pass, q_rot), dim=-1)
    keys, values = expand(latent, k_rot, w["kv_b"], spec)
    scale = softmax_scale(spec)
    out = L.in_blocks(lambda q_, k_, v_, m_: _attend(q_, k_, v_, m_, scale), query, keys, values, mask, max_scores)
    return h + L.linear(out, w, "o")  # (as F.linear; or over HQQ's int4 codes on a CPU: models/int4.py)


def expand(latent, k_rot, kv_b, spec):
    """Keys [B, h, S, nope + rope] and values [B, h, S, v] of every head from the cached latent
    [B, 1, S, r] and rotary key [B, 1, S, rope]."""
    s = spec.shape
    B, _, S, _ = latent.shape
    kv = F.linear(latent, kv_b).view(B, S, s.num_heads, s.qk_nope_head_dim + s.v_head_dim).transpose(1, 2)
    k_nope, values = torch.split(kv, [s.qk_nope_head_dim, s.v_head_dim], dim=-1)
    keys = kv.new_empty(*kv.shape[:-1], s.qk_nope_head_dim + s.head_dim)
    keys[..., :s.qk_nope_head_dim].copy_(k_nope)
    keys[..., s.qk_nope_head_dim:].copy_(k_rot.expand(-1, s.num_heads, -1, -1))
    return keys, values


def _attend(q, keys, values, mask, scale):
    """Attention with keys and values of different widths -> [B, T, heads * v]."""
    B, heads, T, _ = q.shape
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # finite: see layers.attend
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).transpose(1, 2).reshape(B, T, heads * values.shape[-1])


no_experts = defaults.no_experts


def route(x, gate: dict, spec):
    """Softmax over every expert in fp32, then the top-k (greedy), or the top-k of the
    `topk_group` groups with the best single expert (group-limited); unsorted, as
    transformers takes them (the slot order sets the sum's order); x routed_scaling_factor."""
    if "router" not in gate:
        return no_experts(x)
    cfg = spec.config
    scores = F.linear(x.float(), gate["router"].float()).softmax(dim=-1, dtype=torch.float32)
    if cfg.get("topk_method") == "group_limited_greedy":
        groups = cfg["n_group"]
        best = scores.view(len(x), groups, -1).max(dim=-1).values
        scores = scores.masked_fill(~L.group_mask(best, cfg["topk_group"], scores.shape[-1]), 0.0)
    weights, experts = torch.topk(scores, k=spec.shape.top_k, dim=-1, sorted=False)
    return weights * cfg.get("routed_scaling_factor", 1.0), experts


expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def shared_ffn(x, gate: dict, spec):
    """The shared experts (always added), or a dense layer's MLP."""
    return L.swiglu(x, gate, "dense_" if "dense_w1" in gate else "shared_")


recurrent_block = defaults.recurrent_block  # no linear-attention layers
