"""Llama 4 text (meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E; transformers'
Llama4ForCausalLM, config `llama4_text`, which is what its save_pretrained writes). The hub's
vision-language checkpoints (config `llama4`, the text model's weights under `language_model.`)
are read as their text model: spec.TEXT_MODELS.

Attention alternates two kinds of layer (`no_rope_layers`: 1 a RoPE layer, 0 a NoPE one; else
every `no_rope_layer_interval`-th layer is NoPE):
* RoPE layers turn q and k by interleaved pairs (dimensions 2i and 2i+1 by frequency i, in
  fp32, as transformers' complex product), then, with `use_qk_norm`, normalise each head of q
  and k by its RMS (no weight); they attend in chunks (`attention_chunk_size`): a query sees
  the keys of its own chunk of positions only (positions c·C .. c·C + C - 1 of its own
  sequence, as transformers counts them past the left padding).
* NoPE layers use no position in q or k and attend over every earlier key; with
  `attn_temperature_tuning` q is scaled by 1 + attn_scale · log(1 + floor((p + 1) / floor_scale))
  at position p.

The attention block is told neither the layer nor the positions: a NoPE layer's input norm
is named `nope_input_norm` in its group (a RoPE layer's `input_norm`), and each query's and
key's position in its own sequence is counted from the mask (the keys a query sees, less
itself). That count is exact with the engine's masks (causal over each row's own tokens,
left padding and shared-prefix columns included); under `--attention` sink/recent sparsity,
which drops keys from the mask, chunks and temperatures would be counted over the kept keys,
and that is not Llama 4 (the runtime passes no positions to the block).

Transformers counts the temperature's position by cache slot, left padding included: padded
rows of a batched generate past `floor_scale` (8192) positions see a different scale from
the same prompt alone. Klotski takes each row's own position (as the prompt alone, vLLM and
Meta's reference do).

MoE layers (`moe_layers`, else every `interleave_moe_layer_step`-th) route each token to
`num_experts_per_tok` (1 in published models) of `num_local_experts` experts by the top
logits, each expert's input scaled by sigmoid(its logit) (ModelSpec.weigh_expert_inputs),
plus a shared expert every token uses; the other layers have a dense SwiGLU MLP
`intermediate_size_mlp` wide. Experts are stored fused as save_pretrained writes them:
`feed_forward.experts.gate_up_proj` [E, H, 2I] (gate columns first, then up) and `down_proj`
[E, I, H], already transposed for `x @ W`; an expert's group-local weights are its `gate_up`
[H, 2I] and `down` [I, H]."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from klotski.models import defaults, fields
from klotski.models import grouped as G
from klotski.models import layers as L
from klotski.models import mixtral
from klotski.models.ernie4_5_moe import rotate_pairs
from klotski.models.refs import TensorRef
from planner.shapes import moe_layers

MODEL_TYPE = "llama4_text"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
CHUNK, FLOOR_SCALE, ATTN_SCALE, NOPE_INTERVAL = 8192, 8192, 0.1, 4  # transformers' defaults


def check_config(cfg: dict) -> None:
    """Llama 4's own fields (the shared ones are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (Llama 4's experts are SwiGLU)")
    layers = cfg["num_hidden_layers"]
    fields.boolean(cfg, "use_qk_norm", default=True)
    fields.boolean(cfg, "attn_temperature_tuning", default=True)
    fields.positive_number(cfg, "floor_scale", default=FLOOR_SCALE)
    fields.positive_number(cfg, "attn_scale", default=ATTN_SCALE)
    chunk = fields.integer(cfg, "attention_chunk_size", default=CHUNK, optional=True)
    listed = cfg.get("no_rope_layers")
    if listed:
        if not (isinstance(listed, list) and len(listed) >= layers and all(r in (0, 1) for r in listed)):
            raise fields.BadField(f"field 'no_rope_layers' is {listed!r}; must be a list of at least {layers} "
                                  "(num_hidden_layers) entries, each 1 (RoPE) or 0 (NoPE)")
    else:
        fields.integer(cfg, "no_rope_layer_interval", default=NOPE_INTERVAL)
    types = cfg.get("layer_types")
    kinds = ["chunked_attention" if uses_rope(cfg, j) and chunk is not None else "full_attention"
             for j in range(layers)]
    if types is not None and types != kinds:
        raise fields.BadField(f"field 'layer_types' is {types!r}; Llama 4 chunks exactly its RoPE layers "
                              f"(no_rope_layers, attention_chunk_size): {kinds!r}")
    moe = cfg.get("moe_layers")
    if moe is not None:
        if not (isinstance(moe, list) and all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < layers
                                               for j in moe)):
            raise fields.BadField(f"field 'moe_layers' is {moe!r}; must be a list of layer indices from 0 to "
                                  f"num_hidden_layers - 1 ({layers - 1})")
    else:
        fields.integer(cfg, "interleave_moe_layer_step", default=1)
    if len(moe_layers(cfg)) < layers:
        fields.integer(cfg, "intermediate_size_mlp", default=16384)  # the dense layers' MLP
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}):
        raise fields.BadField("field 'rope_theta' is missing; transformers takes 500000 for Llama 4: set "
                              "rope_parameters {\"rope_type\": \"default\", \"rope_theta\": 500000.0}")


def uses_rope(cfg: dict, layer: int) -> bool:
    """Whether `layer` is a RoPE (chunked) layer rather than a NoPE (global) one."""
    listed = cfg.get("no_rope_layers")
    if listed:
        return bool(listed[layer])
    return (layer + 1) % cfg.get("no_rope_layer_interval", NOPE_INTERVAL) != 0


def options(cfg: dict) -> dict:
    return {"norm_topk_prob": False, "router_weights_fp32": False, "weigh_expert_inputs": True}


# ---- tensor names (what save_pretrained writes)
group_refs = defaults.group_refs


def attention_names(spec, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    norm = "input_norm" if uses_rope(spec.config, layer) else "nope_input_norm"  # marks the layer's kind
    return {norm: p + "input_layernorm.weight", **{n: p + f"self_attn.{n}_proj.weight" for n in "qkvo"}}


def gate_names(spec, layer: int) -> dict[str, str]:
    """A dense layer's norm and MLP; a MoE layer's norm, router and shared expert."""
    p = f"model.layers.{layer}."
    out = {"post_norm": p + "post_attention_layernorm.weight"}
    if spec.shape.is_dense(layer):
        q = p + "feed_forward."
        return {**out, "dense_w1": q + "gate_proj.weight", "dense_w3": q + "up_proj.weight",
                "dense_w2": q + "down_proj.weight"}
    q = p + "feed_forward.shared_expert."
    return {**out, "router": p + "feed_forward.router.weight", "shared_w1": q + "gate_proj.weight",
            "shared_w3": q + "up_proj.weight", "shared_w2": q + "down_proj.weight"}


def expert_names(spec, layer: int, expert: int) -> dict[str, str]:
    """The fused per-layer tensors (every expert's, along dim 0) that hold one expert's weights."""
    p = f"model.layers.{layer}.feed_forward.experts."
    return {"gate_up": p + "gate_up_proj", "down": p + "down_proj"}


def expert_refs(spec, layer: int, expert: int) -> dict[str, TensorRef]:
    return {n: TensorRef(name, expert) for n, name in expert_names(spec, layer, expert).items()}


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    H, I = spec.shape.hidden_size, spec.shape.intermediate_size
    return {"nope_input_norm": (H,), "gate_up": (H, 2 * I), "down": (I, H)}


# ---- math ------------------------------------------------------------------------------
def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's vector over its RMS, in fp32, cast back (transformers' weightless RMSNorm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attend(q, keys, values, mask, *, chunk: int | None = None, tuning: tuple[float, float] | None = None,
           prefix_keys=None, prefix_values=None):
    """layers.attend (layers.attend_shared over a shared prefix) with Llama 4's positions: a
    query's position in its own sequence is the number of keys its row of `mask` shows less
    one (itself), a key's the number up to it less one; with `chunk`, a query sees only keys
    of its own chunk of positions; with `tuning` = (floor_scale, attn_scale), q is scaled by
    its position's temperature."""
    P = 0 if prefix_keys is None else prefix_keys.shape[1]
    if P and mask.shape[-1] == keys.shape[2]:  # every row reads the whole prefix: its columns are not in the mask
        mask = torch.cat([mask.new_ones(*mask.shape[:-1], P), mask], dim=-1)
    seen = mask.cumsum(-1)  # [B, 1, T, S]: keys a query sees up to and including each column
    here = seen[..., -1:] - 1  # [B, 1, T, 1]: each query's position
    if chunk is not None:
        mask = mask & ((seen - 1).div(chunk, rounding_mode="floor") == here.div(chunk, rounding_mode="floor"))
    if tuning is not None:
        floor_scale, attn_scale = tuning
        scale = torch.log1p(torch.floor((here.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        q = (q * scale).to(q.dtype)
    if P:
        return L.attend_shared(q, keys, values, mask, prefix_keys, prefix_values)
    return L.attend(q, keys, values, mask)


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.LINEAR_WEIGHTS  # the head only


SHARED_PREFIX = True  # softmax attention over cached keys; the prefix's positions count from 0
SPARSE_ATTENTION = False  # positions are counted from the mask, which sink/window sparsity thins


def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
    cfg, eps = spec.config, spec.rms_norm_eps
    rope = "input_norm" in w  # a NoPE layer's norm is `nope_input_norm`
    x = L.rms_norm(h, w["input_norm" if rope else "nope_input_norm"], eps)
    q, k, v = (t.transpose(1, 2) for t in mixtral.qkv(x, w, spec))
    if rope:
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if cfg.get("use_qk_norm", True):
            q, k = l2_norm(q, eps), l2_norm(k, eps)
    keys, values = cache_write(k, v)
    tuning = None
    if not rope and cfg.get("attn_temperature_tuning", True):
        tuning = (float(cfg.get("floor_scale", FLOOR_SCALE)), float(cfg.get("attn_scale", ATTN_SCALE)))
    core = functools.partial(attend, chunk=cfg.get("attention_chunk_size", CHUNK) if rope else None, tuning=tuning)
    shared = 0
    if prefix is not None:
        core = functools.partial(core, prefix_keys=prefix[0], prefix_values=prefix[1])
        shared = prefix[0].shape[1]
    if attend_at is not None:
        core = attend_at(core)
    return h + L.linear(L.in_blocks(core, q, keys, values, mask, max_scores, shared), w, "o")


def route(x, gate: dict, spec):
    """The top-k logits, each expert's weight sigmoid(logit) in x's dtype (it scales the
    expert's input: weigh_expert_inputs); the picks in expert order, the order transformers
    sums the experts' outputs in (the same sum for top-1 and top-2; past two, the rounding of a
    sum over every expert, zeros included, may differ in the last bit)."""
    if "router" not in gate:  # a dense layer
        return defaults.no_experts(x)
    logits = F.linear(x, gate["router"])
    top, experts = torch.topk(logits, spec.shape.top_k, dim=1)
    if spec.shape.top_k > 1:
        experts, order = experts.sort(dim=1)
        top = top.gather(1, order)
    return torch.sigmoid(top.float()).to(logits.dtype), experts


def expert_ffn(x, w: dict) -> torch.Tensor:
    """One expert over its tokens x [N, H] (already scaled by their router weights):
    (up * silu(gate)) @ down, gate and up the two halves of x @ gate_up."""
    gate, up = torch.mm(x, w["gate_up"]).chunk(2, dim=-1)
    return torch.mm(up * F.silu(gate), w["down"])


bind_expert_ffn = defaults.bind_expert_ffn


def grouped_expert_ffn(x, w: dict, groups: G.Groups) -> torch.Tensor:
    """expert_ffn for stacked experts over their groups of rows."""
    gate, up = G.grouped_mm(x, w["gate_up"], groups).chunk(2, dim=-1)
    return G.grouped_mm(up * F.silu(gate), w["down"], groups)


def bind_grouped_expert_ffn(spec):
    return grouped_expert_ffn


def shared_ffn(x, gate: dict, spec):
    """The shared expert (every token, unweighted) of a MoE layer; a dense layer's MLP."""
    return L.swiglu(x, gate, "dense_" if "dense_w1" in gate else "shared_")


recurrent_block = defaults.recurrent_block  # no linear-attention layers
