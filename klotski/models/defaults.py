"""The family hooks (family.py) most families share, each written once: a family module
assigns the ones it does not change (`group_refs = defaults.group_refs`). Each reaches the
family's own hooks through `spec.family`."""
from __future__ import annotations

import torch

from klotski.models import layers as L
from klotski.models.refs import TensorRef

# LINEAR_WEIGHTS (family.py) of a family whose attention is plain_attention over layers.linear
# projections, and of every other (its head only)
LINEAR_WEIGHTS = {"head": ("lm_head",)}
PLAIN_ATTENTION_LINEAR_WEIGHTS = {"attn": ("q", "k", "v", "o"), **LINEAR_WEIGHTS}


def check_quantization(quant: dict) -> None:
    """Nothing beyond the quant_method (QUANTIZATION): no format of the family's own to check."""


def group_refs(spec, key: tuple) -> dict[str, TensorRef]:
    """Mixtral-like groups: attention, gate (post-attention norm and router), one expert, the
    embedding or the head, by the spec's refs of each."""
    kind = key[0]
    if kind == "attn":
        return spec.attention_refs(key[1])
    if kind == "gate":
        return spec.gate_refs(key[1])
    if kind == "expert":
        return spec.expert_refs(key[1], key[2])
    if kind == "embed":
        return spec.embed_refs()
    if kind == "head":
        return spec.head_refs()
    raise KeyError(key)


def expert_refs(spec, layer: int, expert: int) -> dict[str, TensorRef]:
    """One SwiGLU expert's matrices: the family's per-expert hub tensors, or the fused 3-D ones
    transformers v5 may save (`mlp.experts.gate_up_proj` = cat(gate, up), `mlp.experts.down_proj`,
    named alike in every family)."""
    if spec.fused_experts:
        p, inter = f"model.layers.{layer}.mlp.experts.", spec.shape.intermediate_size
        return {
            "w1": TensorRef(p + "gate_up_proj", expert, (0, inter)),
            "w3": TensorRef(p + "gate_up_proj", expert, (inter, 2 * inter)),
            "w2": TensorRef(p + "down_proj", expert),
        }
    return {k: TensorRef(v) for k, v in spec.family.expert_names(spec, layer, expert).items()}


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    """No group-local weight names beyond those every family shares (ModelSpec.local_shapes)."""
    return {}


def bind_expert_ffn(spec):
    """The family's `expert_ffn` as it is: its math reads no constant from config.json."""
    return spec.family.expert_ffn


def bind_grouped_expert_ffn(spec):
    """SwiGLU experts stacked, over their groups of rows (grouped.grouped_swiglu)."""
    from klotski.models.grouped import grouped_swiglu
    return grouped_swiglu


def shared_ffn(x, gate: dict, spec):
    """No shared expert."""
    return None


def recurrent_block(h, w, state, valid, spec):
    """No linear-attention layers: every layer attends over keys and values."""
    raise ValueError(f"{spec.shape.model_type} has no linear-attention layers")


def no_experts(x):
    """A dense layer's router: no token picks an expert."""
    return (torch.zeros(len(x), 0, dtype=torch.float32, device=x.device),
            torch.zeros(len(x), 0, dtype=torch.long, device=x.device))


def plain_attention(qkv):
    """The attention_block hook of a family whose attention is layers.attention_block over its
    own projection `qkv(x, w, spec)` (RoPE over cos/sin's width: partial rotary where they are
    narrower than a head)."""
    def attention_block(h, w, cos, sin, mask, cache_write, spec, max_scores=None, attend_at=None, prefix=None):
        return L.attention_block(h, w, cos, sin, mask, cache_write, spec, qkv, max_scores, attend_at=attend_at,
                                 prefix=prefix)
    return attention_block
