"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): biases on q/k/v, routed SwiGLU
experts (not renormalised by default, weights cast to the activation dtype) plus a shared
expert scaled by sigmoid(shared_expert_gate x), used by every token. A dense layer (as in
qwen3_moe.py) has a plain MLP and no shared expert."""
from __future__ import annotations

import torch

from klotski.models import defaults, fields
from klotski.models import layers as L
from klotski.models import mixtral, qwen3_moe

MODEL_TYPE = "qwen2_moe"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
options = qwen3_moe.options
route = qwen3_moe.route
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
local_shapes = defaults.local_shapes
expert_names = qwen3_moe.expert_names
attention_names = mixtral.attention_names  # plain projections; their biases are added by the spec
qkv = mixtral.qkv
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def check_config(cfg: dict) -> None:
    qwen3_moe.check_config(cfg)  # the same routing, window and dense-layer fields
    fields.integer(cfg, "shared_expert_intermediate_size")
    fields.boolean(cfg, "qkv_bias", default=True)


# ---- tensor names (hub layout)
def gate_names(spec, layer: int) -> dict[str, str]:
    # The shared expert is used by every token, like the router: it travels with it.
    p = f"model.layers.{layer}.mlp."
    if spec.shape.is_dense(layer):
        return qwen3_moe.gate_names(spec, layer)
    return {**qwen3_moe.gate_names(spec, layer), "shared_gate": p + "shared_expert_gate.weight",
            "shared_w1": p + "shared_expert.gate_proj.weight", "shared_w3": p + "shared_expert.up_proj.weight",
            "shared_w2": p + "shared_expert.down_proj.weight"}


# ---- math ------------------------------------------------------------------------------
HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


def shared_ffn(x, gate: dict, spec):
    """The shared expert over tokens x [N, H], scaled by its sigmoid gate; a dense layer's MLP."""
    if "dense_w1" in gate:
        return L.swiglu(x, gate, "dense_")
    return torch.sigmoid(torch.nn.functional.linear(x, gate["shared_gate"])) * L.swiglu(x, gate, "shared_")


recurrent_block = defaults.recurrent_block  # no linear-attention layers
