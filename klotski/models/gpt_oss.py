"""gpt-oss (openai/gpt-oss-20b, gpt-oss-120b): q/k/v/o biases, a learned per-head sink logit
in every softmax, a sliding window on the layers `layer_types` marks "sliding_attention"
(full attention on the others), yarn RoPE, a router with a bias (top-k on the raw logits,
softmax over the k), and experts with biases and a clamped SwiGLU whose gate and up
columns alternate in one fused tensor.

Experts come in the two layouts published checkpoints use: unquantized (bf16 copies, and
what transformers' save_pretrained writes) as fused tensors `mlp.experts.gate_up_proj`
[E, H, 2I] and `down_proj` [E, I, H], already transposed for `x @ W`; and MXFP4 as
shipped by OpenAI (`*_blocks` [E, rows, cols/32, 16] uint8, `*_scales` [E, rows, cols/32]),
which stays packed until the device decodes it (klotski/compress/mxfp4.py). Either way an expert's
group-local weights are `gate_up` [H, 2I], `down` [I, H] and their biases once decoded.
"""
from __future__ import annotations

import functools

import torch

from klotski.models import defaults, fields
from klotski.models import grouped as G
from klotski.models import layers as L
from klotski.models import mixtral
from klotski.models.refs import TensorRef

MODEL_TYPE = "gpt_oss"
QUANTIZATION = ("mxfp4",)  # a quantization_config this family reads as shipped
check_quantization = defaults.check_quantization
LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # the expert's clamp and sigmoid gain where config.json sets none


def check_config(cfg: dict) -> None:
    """gpt-oss's own fields (the shared ones are checked by spec.check_config)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise fields.BadField(f"field 'layer_types' is {types!r}; must be a list of {layers} (num_hidden_layers) "
                                  f"entries, each {' or '.join(repr(t) for t in LAYER_TYPES)}")
    if types is None or "sliding_attention" in types:
        fields.integer(cfg, "sliding_window")
    fields.positive_number(cfg, "swiglu_limit", default=SWIGLU_LIMIT)
    fields.positive_number(cfg, "swiglu_alpha", default=SWIGLU_ALPHA)
    fields.boolean(cfg, "attention_bias", default=True)


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": False, "router_weights_fp32": False}


# ---- tensor names (the published layouts)
group_refs = defaults.group_refs


def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {**mixtral.attention_names(spec, layer), "sinks": p + "self_attn.sinks"}


def gate_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {"post_norm": p + "post_attention_layernorm.weight", "router": p + "mlp.router.weight",
            "router_bias": p + "mlp.router.bias"}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    """The fused per-layer tensors (every expert's, along dim 0) that hold one expert's weights;
    a GGUF file's own per-expert gate, up and down (klotski/io/gguf.py names them)."""
    p = f"model.layers.{layer}.mlp.experts."
    if spec.config.get("gguf_experts"):
        q = f"{p}{expert}."
        return {**{m: f"{q}{m}_proj.weight" for m in GGUF_PARTS}, **{f"{m}_bias": f"{q}{m}_proj.bias" for m in GGUF_PARTS}}
    parts = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales") if spec.shape.expert_format == "mxfp4" \
        else ("gate_up", "down")
    names = {n: p + n.replace("gate_up", "gate_up_proj").replace("down", "down_proj") for n in parts}
    names.update(gate_up_bias=p + "gate_up_proj_bias", down_bias=p + "down_proj_bias")
    return names


def expert_refs(spec, layer: int, expert: int) -> dict[str, TensorRef]:
    """An expert's slices of the fused per-layer tensors (GGUF's per-expert entries: whole)."""
    index = None if spec.config.get("gguf_experts") else expert
    return {n: TensorRef(name, index) for n, name in expert_names(spec, layer, expert).items()}


GGUF_PARTS = ("gate", "up", "down")  # a GGUF expert's matrices, [out, in] as llama.cpp stores them


def join_gguf_expert(w: dict) -> dict:
    """A GGUF expert decoded (gate, up [I, H], down [H, I] and their biases; experts decoded
    together stacked on leading dimensions) -> this family's layout: gate and up rows
    interleaved and transposed into `gate_up` [H, 2I], down [I, H] (contiguous, as transformers
    holds them, so the products sum in its order)."""
    *lead, I, H = w["gate"].shape
    gate_up = torch.stack((w["gate"], w["up"]), dim=-2).view(*lead, 2 * I, H).transpose(-1, -2).contiguous()
    return {"gate_up": gate_up,
            "gate_up_bias": torch.stack((w["gate_bias"], w["up_bias"]), dim=-1).view(*lead, 2 * I),
            "down": w["down"].transpose(-1, -2).contiguous(), "down_bias": w["down_bias"]}


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    H, I = spec.shape.hidden_size, spec.shape.intermediate_size
    gguf = spec.config.get("gguf_experts")  # GGUF's down is [out, in]
    return {"sinks": (spec.shape.num_heads,), "router_bias": (spec.shape.num_experts,),
            "gate_up": (H, 2 * I), "down": (H, I) if gguf else (I, H), "gate_up_bias": (2 * I,), "down_bias": (H,),
            "gate_up_blocks": (2 * I, H // 32, 16), "gate_up_scales": (2 * I, H // 32),
            "down_blocks": (H, I // 32, 16), "down_scales": (H, I // 32),
            "gate": (I, H), "up": (I, H), "gate_bias": (I,), "up_bias": (I,)}


# ---- math ------------------------------------------------------------------------------
qkv = mixtral.qkv  # biases are added by L.linear where the checkpoint has them


def attend_with_sinks(q, keys, values, mask, sinks):
    """Attention whose softmax also sees one learned logit per head (the sink), dropped after:
    eager attention of transformers' GptOssAttention, step for step."""
    B, heads, T, D = q.shape
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    # a kv head's queries side by side against it (as layers.attend), not the KV copied rep-fold
    scores = L.grouped_scores(q.reshape(B, kv_heads, rep * T, D), keys).reshape(B, heads, T, -1)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1).to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(values.dtype)
    out = torch.matmul(probs.reshape(B, kv_heads, rep * T, -1), values).view(B, heads, T, D)
    return out.transpose(1, 2).reshape(B, T, heads * D)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.LINEAR_WEIGHTS  # the head only


# Not shared: the sinks and the sliding-window layers (a window may cut into the prefix, and
# differently for each line) are not plain attention over a prefix every row sees whole.
SHARED_PREFIX = False
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    if prefix is not None:
        raise ValueError("gpt-oss attention does not read a shared prefix (SHARED_PREFIX is False)")
    # the sinks (one logit per head) travel with q where the attention runs
    core = attend_at(attend_with_sinks) if attend_at else attend_with_sinks
    return L.attention_block(h, w, cos, sin, mask, cache_write, spec, qkv, max_scores,
                             attend=functools.partial(core, sinks=w["sinks"]))


def route(x, gate: dict, spec):
    """Top-k of the raw logits (bias included), softmax over those k, in the activation dtype."""
    logits = torch.nn.functional.linear(x, gate["router"], gate["router_bias"])
    top, experts = torch.topk(logits, spec.shape.top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), experts


def clamped_swiglu(x, w: dict, *, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """One expert over tokens x [N, H]: gate and up alternate in x @ gate_up; the gate is
    clamped above, up on both sides, and (up + 1) * gate * sigmoid(alpha * gate) goes down."""
    gate_up = torch.mm(x, w["gate_up"])
    gate_up.add_(w["gate_up_bias"])  # added after the product, as transformers' grouped experts do
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    out = torch.mm((up + 1) * (gate * torch.sigmoid(gate * alpha)), w["down"])
    return out.add_(w["down_bias"])


expert_ffn = clamped_swiglu


def bind_expert_ffn(spec):
    """expert_ffn(x, w) with this checkpoint's clamp and sigmoid gain."""
    cfg = spec.config
    return functools.partial(clamped_swiglu, alpha=float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
                             limit=float(cfg.get("swiglu_limit", SWIGLU_LIMIT)))


def grouped_clamped_swiglu(x, w: dict, groups: G.Groups, *, alpha: float = SWIGLU_ALPHA,
                           limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """clamped_swiglu for stacked experts over their groups of rows; each row's biases are its
    expert's, added after the product as the per-expert path adds them."""
    rows = groups.row_group(len(x))
    gate_up = G.grouped_mm(x, w["gate_up"], groups)
    gate_up.add_(w["gate_up_bias"].index_select(0, rows))
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    out = G.grouped_mm((up + 1) * (gate * torch.sigmoid(gate * alpha)), w["down"], groups)
    return out.add_(w["down_bias"].index_select(0, rows))


def bind_grouped_expert_ffn(spec):
    """grouped_clamped_swiglu with this checkpoint's clamp and sigmoid gain."""
    cfg = spec.config
    return functools.partial(grouped_clamped_swiglu, alpha=float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
                             limit=float(cfg.get("swiglu_limit", SWIGLU_LIMIT)))


shared_ffn = defaults.shared_ffn


recurrent_block = defaults.recurrent_block  # no linear-attention layers
