"""Qwen3.5 / Qwen3.6-MoE (Qwen/Qwen3.5-397B-A17B, Qwen/Qwen3.6-35B-A3B; transformers'
Qwen3_5Moe*): Qwen3-Next's hybrid (qwen3_next.py: gated full attention every fourth layer,
Gated DeltaNet in the others, 256/512 experts with a sigmoid-gated shared expert, norms as
1 + w) with the DeltaNet's input projections apart: `in_proj_qkv` (q|k|v as the conv reads
them), `in_proj_z`, `in_proj_b`, `in_proj_a`.

The hub checkpoints are vision-language models (`qwen3_5_moe`, Qwen3_5MoeForConditionalGeneration):
the text model's config is `text_config` and its weights sit under `model.language_model.`
(spec.TEXT_MODELS); the vision tower (`model.visual.*`) and the multi-token-prediction layer
(`mtp.*`) are never read. Their multi-axis RoPE gives every axis a text token's own position, so
it is ordinary 1-D RoPE on the first `partial_rotary_factor` of each head. The text model alone
(`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM) reads as it is.
"""
from __future__ import annotations

import torch.nn.functional as F

from klotski.models import defaults, gated_deltanet, qwen3_next
from klotski.models import layers as L
from klotski.models.gated_deltanet import sizes

MODEL_TYPE = "qwen3_5_moe_text"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
HOST_ATTENTION = qwen3_next.HOST_ATTENTION
LINEAR_WEIGHTS = qwen3_next.LINEAR_WEIGHTS
SHARED_PREFIX = qwen3_next.SHARED_PREFIX
SPARSE_ATTENTION = qwen3_next.SPARSE_ATTENTION
check_quantization = defaults.check_quantization
check_config = qwen3_next.check_config


def options(cfg: dict) -> dict:
    """Qwen3-Next's, but the router always renormalises its top-k (transformers' Qwen3_5Moe
    router does, whatever `norm_topk_prob` says)."""
    return {**qwen3_next.options(cfg), "norm_topk_prob": True}


group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
expert_names = qwen3_next.expert_names
gate_names = qwen3_next.gate_names
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn
attention_block = qwen3_next.attention_block
route = qwen3_next.route
shared_ffn = qwen3_next.shared_ffn

PROJECTIONS = {"qkv": "in_proj_qkv", "z": "in_proj_z", "b": "in_proj_b", "a": "in_proj_a"}


def attention_names(spec, layer: int) -> dict[str, str]:
    return qwen3_next.hybrid_attention_names(spec, layer, PROJECTIONS)


def local_shapes(spec) -> dict[str, tuple[int, ...]]:
    Hk, Hv, Dk, Dv = sizes(spec)
    H = spec.shape.hidden_size
    return qwen3_next.hybrid_shapes(spec, {"qkv": (2 * Hk * Dk + Hv * Dv, H), "z": (Hv * Dv, H), "b": (Hv, H),
                                           "a": (Hv, H)})


def project(x, w: dict, spec):
    """The four input projections: q|k|v as the conv reads them, z per value head, b and a."""
    _, Hv, _, Dv = sizes(spec)
    B, T, _ = x.shape
    return (F.linear(x, w["qkv"]), F.linear(x, w["z"]).view(B, T, Hv, Dv), F.linear(x, w["b"]),
            F.linear(x, w["a"]))


def recurrent_block(h, w, state, valid, spec):
    """A Gated DeltaNet layer over one batch with its recurrent state (gated_deltanet.block)."""
    return gated_deltanet.block(h, w, state, valid, spec, project)
