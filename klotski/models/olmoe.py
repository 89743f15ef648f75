"""OLMoE (allenai/OLMoE-1B-7B): RMSNorm of q and k over the whole projection before the
head split, optional clamping of q/k/v to ±clip_qkv, 64 SwiGLU experts top-8 (not
renormalised by default), router weights cast to the activation dtype."""
from __future__ import annotations

from klotski.models import defaults, fields
from klotski.models import layers as L
from klotski.models import qwen3_moe

MODEL_TYPE = "olmoe"
QUANTIZATION: tuple[str, ...] = ()  # unquantized weights only
check_quantization = defaults.check_quantization
options = qwen3_moe.options
route = qwen3_moe.route
group_refs = defaults.group_refs
expert_refs = defaults.expert_refs
local_shapes = defaults.local_shapes
expert_names = qwen3_moe.expert_names
gate_names = qwen3_moe.gate_names
attention_names = qwen3_moe.attention_names
shared_ffn = defaults.shared_ffn
expert_ffn = L.swiglu
bind_expert_ffn = defaults.bind_expert_ffn
bind_grouped_expert_ffn = defaults.bind_grouped_expert_ffn


def check_config(cfg: dict) -> None:
    """OLMoE's own fields (the shared ones are checked by spec.check_config)."""
    fields.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (OLMoE's experts are SwiGLU)")
    fields.boolean(cfg, "norm_topk_prob", default=False)
    if cfg.get("clip_qkv") is not None:
        fields.positive_number(cfg, "clip_qkv")
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
        raise fields.BadField(f"field 'head_dim' is {cfg['head_dim']!r}; OLMoE normalises q over hidden_size, so "
                              "head_dim must be hidden_size / num_attention_heads (or absent)")


def qkv(x, w: dict, spec):
    eps, clip = spec.rms_norm_eps, spec.clip_qkv
    q, k, v = L.rms_norm(L.linear(x, w, "q"), w["q_norm"], eps), L.rms_norm(L.linear(x, w, "k"), w["k_norm"], eps), \
        L.linear(x, w, "v")
    if clip is not None:
        q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
    s = spec.shape
    return (L.split_heads(q, s.num_heads, s.head_dim), L.split_heads(k, s.num_kv_heads, s.head_dim),
            L.split_heads(v, s.num_kv_heads, s.head_dim))


HOST_ATTENTION = True  # attention_block takes `attend_at` (attention beside a host KV cache)
LINEAR_WEIGHTS = defaults.PLAIN_ATTENTION_LINEAR_WEIGHTS  # q, k, v, o through layers.linear


SHARED_PREFIX = True  # plain softmax attention: a shared prefix's keys are read once for every row
SPARSE_ATTENTION = True  # the mask alone says which keys a query sees


attention_block = defaults.plain_attention(qkv)


recurrent_block = defaults.recurrent_block  # no linear-attention layers
