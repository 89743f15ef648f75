"""Model shapes the planner reasons about, without weights and without the engine.

This is the one shape type: the engine's `ModelSpec` holds a `ModelShape` and adds only
what it computes with, so `klotski plan --model qwen3-30b-a3b` answers on a laptop with no
checkpoint and the planner never imports `klotski` (nor torch).

Families name the same sizes differently (Mixtral's `num_local_experts` is Qwen's
`num_experts`; Qwen's experts are `moe_intermediate_size` wide); `FAMILY_FIELDS` is the one
place that knows, and `intermediate_size` here is always one routed expert's width.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    name: str = ""
    model_type: str = "mixtral"
    shared_intermediate_size: int = 0  # a shared expert beside the routed ones (Qwen2-MoE), 0: none
    attention_bias: str = ""           # projections with a bias: "" none, "qkv", "qkvo"
    qk_norm: str = ""                  # RMSNorm of q and k: "" none, "head" (per head), "projection" (whole)
    expert_format: str = ""            # "" experts in `dtype`; "mxfp4": shipped packed (gpt-oss), kept so on every tier
    # Multi-head latent attention (DeepSeek): the cache holds a latent of kv_lora_rank values and
    # one rotary key of head_dim (= qk_rope_head_dim) per token and layer; 0: plain K/V
    kv_lora_rank: int = 0
    q_lora_rank: int = 0               # 0: q_proj straight from the hidden state
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    dense_layers: int = 0              # the first layers have a dense MLP instead of experts (DeepSeek)
    dense_intermediate_size: int = 0
    # Qwen MoE's dense layers anywhere, as transformers decides them: layer j is MoE iff j is
    # not in `mlp_only_layers` and (j + 1) % `sparse_step` == 0 (config `decoder_sparse_step`)
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Linear-attention hybrids (Qwen3-Next, Qwen3.5/3.6-MoE): the Gated DeltaNet layers (config
    # `layer_types`), which keep a fixed-size recurrent state per sequence instead of keys and values:
    # a causal conv's last `linear_conv_kernel - 1` inputs and an fp32 matrix per value head
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0

    @classmethod
    def from_config(cls, cfg: dict, name: str = "") -> "ModelShape":
        """Read a Hugging Face `config.json` dict of a supported family."""
        mt = cfg.get("model_type", "mixtral")
        if mt not in FAMILY_FIELDS:
            raise ValueError(f"model_type {mt!r} is not supported (supported: {', '.join(FAMILY_FIELDS)})")
        names = family_fields(cfg)
        heads = cfg["num_attention_heads"]
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"config dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg[names["intermediate_size"]],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("qk_rope_head_dim") if "kv_lora_rank" in cfg else
            cfg.get("head_dim") or cfg["hidden_size"] // heads,
            num_experts=cfg[names["num_experts"]],
            top_k=cfg[names.get("top_k", "num_experts_per_tok")],
            vocab_size=cfg["vocab_size"],
            dtype=dtype,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding_window(cfg),
            name=name or cfg.get("_name_or_path", ""),
            model_type=mt,
            attention_bias=attention_bias(cfg),
            expert_format=expert_format(cfg),
            **{"shared_intermediate_size": int(cfg.get(names.get("shared", ""), 0) or 0),
               "qk_norm": names.get("qk_norm", ""), **mla_fields(cfg), **qwen_dense_fields(cfg), **glm_fields(cfg),
               **moe_layer_fields(cfg), **linear_fields(cfg)},
        )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def is_dense(self, layer: int) -> bool:
        """Whether `layer` has a dense MLP (in its gate group) instead of routed experts."""
        return layer < self.dense_layers or layer in self.mlp_only_layers or (layer + 1) % self.sparse_step != 0

    def experts_in(self, layer: int) -> int:
        """Routed experts of one layer (0 in a dense layer)."""
        return 0 if self.is_dense(layer) else self.num_experts

    def moe_index(self, layer: int) -> int:
        """`layer`'s index among the MoE layers (predictors count only those)."""
        return self._moe_before[layer]

    @cached_property
    def _moe_before(self) -> tuple[int, ...]:
        # asked per layer and step by the pipeline: counted once
        out, n = [], 0
        for j in range(self.num_layers):
            out.append(n)
            n += not self.is_dense(j)
        return tuple(out)

    @property
    def num_dense_layers(self) -> int:
        return sum(1 for j in range(self.num_layers) if self.is_dense(j))

    @property
    def first_moe_layer(self) -> int:
        """The first layer with experts (the last layer if none has)."""
        return next((j for j in range(self.num_layers) if not self.is_dense(j)), self.num_layers - 1)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is linear attention (a recurrent state, no keys and values)."""
        return layer in self._linear

    @cached_property
    def _linear(self) -> frozenset:
        return frozenset(self.linear_layers)

    @property
    def attention_layers(self) -> int:
        """Layers whose cache holds keys and values (every layer but the linear-attention ones)."""
        return self.num_layers - len(self.linear_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's causal conv: its q, k and v side by side."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def recurrent_bytes_per_sequence(self, dtype_bytes: int | None = None) -> int:
        """One sequence's recurrent state over every linear-attention layer: the conv's last
        kernel - 1 inputs (in the compute dtype) and the fp32 matrix [value heads, key dim, value
        dim]. A constant: it does not grow with the text."""
        conv = self.linear_conv_dim * max(self.linear_conv_kernel - 1, 0) * (dtype_bytes or self.dtype_bytes)
        matrix = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4
        return len(self.linear_layers) * (conv + matrix)

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of what the KV cache stores per token and layer:
        MLA caches one latent (as the "key") and one rotary key (as the "value")."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank, self.head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_width(self) -> int:
        """Values cached per token and layer."""
        heads, k, v = self.kv_cache_dims
        return heads * (k + v)

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(query width, expanded key + value width per key) over all heads, as attention computes."""
        if self.kv_lora_rank:
            return (self.num_heads * (self.qk_nope_head_dim + self.head_dim),
                    self.num_heads * (self.qk_nope_head_dim + self.head_dim + self.v_head_dim))
        return self.num_heads * self.head_dim, 2 * self.num_kv_heads * self.head_dim

    @property
    def expert_bias_params(self) -> int:
        """gpt-oss experts carry biases (gate/up and down); the other families' do not."""
        return 2 * self.intermediate_size + self.hidden_size if self.model_type == "gpt_oss" else 0

    def expert_nbytes(self) -> int:
        """One expert as it sits in a tier and crosses a link: MXFP4 is 4 bits a weight plus one
        8-bit exponent per 32 weights, its biases in `dtype`."""
        if self.expert_format == "mxfp4":
            return self.expert_params // 2 + self.expert_params // 32 + self.expert_bias_params * self.dtype_bytes
        return (self.expert_params + self.expert_bias_params) * self.dtype_bytes

    @property
    def attention_params(self) -> int:
        """q/k/v/o projections, their biases and q/k norms, and the input norm."""
        if self.kv_lora_rank:
            return self._mla_params()
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        bias = {"": 0, "qkv": q + 2 * kv, "qkvo": q + 2 * kv + self.hidden_size}[self.attention_bias]
        norms = {"": 0, "head": 2 * self.head_dim, "projection": q + kv}[self.qk_norm]
        sinks = self.num_heads if self.model_type == "gpt_oss" else 0  # a learned sink logit per head
        return self.hidden_size * (2 * q + 2 * kv) + bias + norms + sinks + self.hidden_size

    @property
    def gate_params(self) -> int:
        """Everything of a MoE layer used by every token: the post-attention norm and the
        router, and a shared expert with its sigmoid gate where the family has one."""
        shared = 3 * self.hidden_size * self.shared_intermediate_size + self.hidden_size \
            if self.shared_intermediate_size else 0
        router_bias = self.num_experts if self.model_type == "gpt_oss" else 0
        return (self.num_experts + 1) * self.hidden_size + router_bias + shared

    def _mla_params(self) -> int:
        H, h, r, rope = self.hidden_size, self.num_heads, self.kv_lora_rank, self.head_dim
        qk = self.qk_nope_head_dim + rope
        ql = self.q_lora_rank
        q = H * ql + ql + ql * h * qk if ql else H * h * qk
        return q + H * (r + rope) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * H + H

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """What the KV cache holds for one token over all layers (K and V, or MLA's latent)."""
        return self.attention_layers * self.kv_width * (dtype_bytes or self.dtype_bytes)

    def key(self) -> str:
        """Stable text identifying the shapes and dtype (for profile cache keys); fields added
        later are left out at their defaults, so keys cached before them still match. Not the
        depth: a profile times one layer's ops, so models that differ only in their number of
        layers (a few-layer build and its full model) share one measurement."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if f.name not in ("name", "num_layers")
                        and _LATER_DEFAULTS.get(f.name, _NONE) != getattr(self, f.name))


_NONE = object()
_LATER_DEFAULTS = {"sparse_step": 1, "mlp_only_layers": (), "linear_layers": (), "linear_key_heads": 0,
                   "linear_value_heads": 0, "linear_key_dim": 0, "linear_value_dim": 0, "linear_conv_kernel": 0}


# Per family: the config field of one routed expert's width and of the expert count, the
# shared expert's width, and the kind of q/k norm (fields checked against transformers 5.23).
FAMILY_FIELDS: dict[str, dict[str, str]] = {
    "mixtral": {"intermediate_size": "intermediate_size", "num_experts": "num_local_experts"},
    "qwen3_moe": {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts", "qk_norm": "head"},
    "qwen2_moe": {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
                  "shared": "shared_expert_intermediate_size"},
    "olmoe": {"intermediate_size": "intermediate_size", "num_experts": "num_experts", "qk_norm": "projection"},
    "gpt_oss": {"intermediate_size": "intermediate_size", "num_experts": "num_local_experts"},
    "deepseek_v2": {"intermediate_size": "moe_intermediate_size", "num_experts": "n_routed_experts"},
    "deepseek_v3": {"intermediate_size": "moe_intermediate_size", "num_experts": "n_routed_experts"},
    # GLM-4.5's q/k norm (per head) is optional: `use_qk_norm` (glm_fields)
    "glm4_moe": {"intermediate_size": "moe_intermediate_size", "num_experts": "n_routed_experts"},
    "minimax_m2": {"intermediate_size": "intermediate_size", "num_experts": "num_local_experts",
                   "qk_norm": "projection"},
    # ERNIE 4.5 counts its top-k as `moe_k`; its and Llama 4's dense layers and shared experts:
    # moe_layer_fields (Llama 4's q/k norm has no weight)
    "ernie4_5_moe": {"intermediate_size": "moe_intermediate_size", "num_experts": "moe_num_experts", "top_k": "moe_k"},
    "llama4_text": {"intermediate_size": "intermediate_size", "num_experts": "num_local_experts"},
    # the linear-attention hybrids: a shared expert beside 256-512 routed ones, per-head q/k norms
    # in the full-attention layers (linear_fields: the Gated DeltaNet layers)
    "qwen3_next": {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts", "qk_norm": "head",
                   "shared": "shared_expert_intermediate_size"},
    "qwen3_5_moe_text": {"intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
                         "qk_norm": "head", "shared": "shared_expert_intermediate_size"},
}
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text")


def layer_types(cfg: dict) -> list[str]:
    """A hybrid's `layer_types`, or transformers' default from `full_attention_interval` (4):
    every interval-th layer full attention, the others linear."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    interval = cfg.get("full_attention_interval", 4)
    return ["linear_attention" if (j + 1) % interval else "full_attention" for j in range(cfg["num_hidden_layers"])]


# a hybrid's linear-attention sizes as transformers' config classes default them, by config field
LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def linear_fields(cfg: dict) -> dict:
    """A hybrid's linear-attention layers and their state's sizes (transformers' defaults where
    a field is absent); empty for every other family."""
    if cfg.get("model_type") not in HYBRIDS:
        return {}
    get = {name: cfg.get(name, default) for name, default in LINEAR_DEFAULTS.items()}
    return {"linear_layers": tuple(j for j, t in enumerate(layer_types(cfg)) if t == "linear_attention"),
            "linear_key_heads": get["linear_num_key_heads"], "linear_value_heads": get["linear_num_value_heads"],
            "linear_key_dim": get["linear_key_head_dim"], "linear_value_dim": get["linear_value_head_dim"],
            "linear_conv_kernel": get["linear_conv_kernel_dim"]}


def mla_fields(cfg: dict) -> dict:
    """DeepSeek's attention and dense-layer sizes (empty for every other family)."""
    if "kv_lora_rank" not in cfg:
        return {}
    dense = int(cfg.get("first_k_dense_replace") or 0)
    return {"kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
            "qk_nope_head_dim": cfg["qk_nope_head_dim"], "v_head_dim": cfg["v_head_dim"],
            "dense_layers": dense, "dense_intermediate_size": cfg.get("intermediate_size", 0) if dense else 0,
            "shared_intermediate_size": cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)}


def qwen_dense_fields(cfg: dict) -> dict:
    """Qwen MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`) and their MLP width
    (`intermediate_size`); empty for every other family and for an all-MoE Qwen config."""
    if cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        return {}
    only, step = tuple(sorted(set(cfg.get("mlp_only_layers") or ()))), int(cfg.get("decoder_sparse_step") or 1)
    if not only and step == 1:
        return {}
    return {"sparse_step": step, "mlp_only_layers": only, "dense_intermediate_size": cfg.get("intermediate_size", 0)}


def glm_fields(cfg: dict) -> dict:
    """GLM-4.5's dense first layers (`first_k_dense_replace`, 1 unless set, their MLP
    `intermediate_size` wide), its shared experts (`n_shared_experts` x the expert width, one
    unless set) and its optional per-head q/k norm; empty for every other family."""
    if cfg.get("model_type") != "glm4_moe":
        return {}
    dense = int(cfg.get("first_k_dense_replace", 1) or 0)
    return {"dense_layers": dense, "dense_intermediate_size": cfg.get("intermediate_size", 0) if dense else 0,
            "shared_intermediate_size": cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts", 1) or 0),
            "qk_norm": "head" if cfg.get("use_qk_norm") else ""}


def moe_layers(cfg: dict) -> list[int]:
    """The layers with experts, as transformers decides them, of ERNIE 4.5 (from
    `moe_layer_start_index` to `moe_layer_end_index`, -1 the last, every
    `moe_layer_interval`-th counting from 1) and Llama 4 (`moe_layers`, else every
    `interleave_moe_layer_step`-th counting from 1); every layer for other families."""
    layers, mt = cfg["num_hidden_layers"], cfg.get("model_type")
    if mt == "ernie4_5_moe":
        start, step = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_interval", 1)
        end = cfg.get("moe_layer_end_index", -1)
        end = layers - 1 if end == -1 else end
        return [j for j in range(layers) if (j + 1) % step == 0 and start <= j <= end]
    if mt == "llama4_text":
        listed = cfg.get("moe_layers")
        return sorted(set(listed)) if listed is not None else \
            list(range(cfg.get("interleave_moe_layer_step", 1) - 1, layers, cfg.get("interleave_moe_layer_step", 1)))
    return list(range(layers))


def moe_layer_fields(cfg: dict) -> dict:
    """ERNIE 4.5's and Llama 4's dense layers (those without experts: `moe_layers`), their MLP
    width (ERNIE's `intermediate_size`, Llama's `intermediate_size_mlp`) and the shared
    experts' width (ERNIE: `moe_num_shared_experts` x the expert width; Llama: one of
    `intermediate_size`, the experts' own); empty for every other family."""
    mt = cfg.get("model_type")
    if mt not in ("ernie4_5_moe", "llama4_text"):
        return {}
    moe = set(moe_layers(cfg))
    dense = tuple(j for j in range(cfg["num_hidden_layers"]) if j not in moe)
    if mt == "ernie4_5_moe":
        width, shared = cfg.get("intermediate_size", 0), \
            cfg["moe_intermediate_size"] * int(cfg.get("moe_num_shared_experts", 2) or 0)
    else:
        width, shared = cfg.get("intermediate_size_mlp", 16384), cfg["intermediate_size"]
    return {"mlp_only_layers": dense, "dense_intermediate_size": width if dense else 0,
            "shared_intermediate_size": shared}


def family_fields(cfg: dict) -> dict[str, str]:
    """FAMILY_FIELDS of the config's family, with the expert count under the spelling this
    file uses: transformers 5 saves Qwen's `num_experts` as `num_local_experts`."""
    names = dict(FAMILY_FIELDS[cfg.get("model_type", "mixtral")])
    if names["num_experts"] not in cfg and "num_local_experts" in cfg:
        names["num_experts"] = "num_local_experts"
    return names


def window_applies(cfg: dict) -> bool:
    """Whether the config's `sliding_window` means anything: Qwen configs carry one that
    applies only with `use_sliding_window` (Qwen1.5-MoE ships 32768 with it false); GLM-4.5
    and MiniMax-M2 attend over every position whatever it says (transformers' mask has no window),
    as ERNIE 4.5 and Llama 4 do (Llama 4's chunked layers are its own: llama4.py)."""
    if cfg.get("model_type") in ("glm4_moe", "minimax_m2", "ernie4_5_moe", "llama4_text", *HYBRIDS):
        return False
    return cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe") or bool(cfg.get("use_sliding_window"))


def sliding_window(cfg: dict) -> int | None:
    """The attention window, or None: of every layer, or of those `layer_types` marks
    "sliding_attention" where the config has them (gpt-oss: every other layer)."""
    return (cfg.get("sliding_window") or None) if window_applies(cfg) else None


def expert_format(cfg: dict) -> str:
    """"mxfp4" for a checkpoint whose experts ship MXFP4-packed (gpt-oss), else ""."""
    quant = cfg.get("quantization_config")
    return "mxfp4" if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" else ""


def attention_bias(cfg: dict) -> str:
    """Which attention projections carry a bias, per family: Qwen2-MoE's q/k/v by `qkv_bias`
    (default true, absent from the hub configs); GLM-4.5's q/k/v by `attention_bias` (its o_proj
    never has one); elsewhere all four by `attention_bias`."""
    if cfg.get("model_type") == "qwen2_moe":
        return "qkv" if cfg.get("qkv_bias", True) else ""
    if cfg.get("model_type") == "glm4_moe":
        return "qkv" if cfg.get("attention_bias", False) else ""
    return "qkvo" if cfg.get("attention_bias", False) else ""


def as_shape(model) -> ModelShape:
    """A ModelShape from a ModelShape, an engine ModelSpec (its `shape`), a config dict or a
    known alias."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(getattr(model, "shape", None), ModelShape):
        return model.shape
    if isinstance(model, str):
        try:
            return KNOWN_MODELS[model.lower()]
        except KeyError:
            raise KeyError(f"unknown model alias {model!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None
    if isinstance(model, dict):
        return ModelShape.from_config(model)
    raise TypeError(f"not a model shape: {model!r}")


# Published configs (config.json of mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1).
# sliding_window is null in both (full attention over 32k/64k positions).
KNOWN_MODELS: dict[str, ModelShape] = {
    "mixtral-8x7b": ModelShape(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, vocab_size=32000, dtype="bfloat16", name="mixtral-8x7b"),
    "mixtral-8x22b": ModelShape(
        hidden_size=6144, intermediate_size=16384, num_layers=56, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, vocab_size=32768, dtype="bfloat16", name="mixtral-8x22b"),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts top-8, q/k norm per head
    "qwen3-30b-a3b": ModelShape(
        hidden_size=2048, intermediate_size=768, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, vocab_size=151936, dtype="bfloat16", name="qwen3-30b-a3b",
        model_type="qwen3_moe", qk_norm="head"),
    "qwen3-235b-a22b": ModelShape(
        hidden_size=4096, intermediate_size=1536, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, vocab_size=151936, dtype="bfloat16", name="qwen3-235b-a22b",
        model_type="qwen3_moe", qk_norm="head"),
    # Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen2-57B-A14B: a shared expert, q/k/v bias
    "qwen1.5-moe-a2.7b": ModelShape(
        hidden_size=2048, intermediate_size=1408, num_layers=24, num_heads=16, num_kv_heads=16,
        head_dim=128, num_experts=60, top_k=4, vocab_size=151936, dtype="bfloat16", name="qwen1.5-moe-a2.7b",
        model_type="qwen2_moe", shared_intermediate_size=5632, attention_bias="qkv"),
    "qwen2-57b-a14b": ModelShape(
        hidden_size=3584, intermediate_size=2560, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, num_experts=64, top_k=8, vocab_size=151936, dtype="bfloat16", name="qwen2-57b-a14b",
        model_type="qwen2_moe", shared_intermediate_size=20480, attention_bias="qkv"),
    # allenai/OLMoE-1B-7B-0924: 64 experts top-8, q/k norm over the whole projection
    "olmoe-1b-7b": ModelShape(
        hidden_size=2048, intermediate_size=1024, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, num_experts=64, top_k=8, vocab_size=50304, dtype="bfloat16", name="olmoe-1b-7b",
        model_type="olmoe", qk_norm="projection"),
    # openai/gpt-oss-120b and gpt-oss-20b as published: experts MXFP4 (the rest bf16), q/k/v/o
    # biases, a 128-token window on every other layer (full attention on the others)
    "gpt-oss-120b": ModelShape(
        hidden_size=2880, intermediate_size=2880, num_layers=36, num_heads=64, num_kv_heads=8,
        head_dim=64, num_experts=128, top_k=4, vocab_size=201088, dtype="bfloat16", sliding_window=128,
        name="gpt-oss-120b", model_type="gpt_oss", attention_bias="qkvo", expert_format="mxfp4"),
    "gpt-oss-20b": ModelShape(
        hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
        head_dim=64, num_experts=32, top_k=4, vocab_size=201088, dtype="bfloat16", sliding_window=128,
        name="gpt-oss-20b", model_type="gpt_oss", attention_bias="qkvo", expert_format="mxfp4"),
    # deepseek-ai/DeepSeek-V2-Lite: MLA (kv_lora_rank 512 + rope 64 cached, q_proj), 1 dense layer,
    # 64 experts top-6 + 2 shared (num_kv_heads is the config's; MLA caches one latent)
    "deepseek-v2-lite": ModelShape(
        hidden_size=2048, intermediate_size=1408, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=64, num_experts=64, top_k=6, vocab_size=102400, dtype="bfloat16", name="deepseek-v2-lite",
        model_type="deepseek_v2", shared_intermediate_size=2 * 1408, kv_lora_rank=512, q_lora_rank=0,
        qk_nope_head_dim=128, v_head_dim=128, dense_layers=1, dense_intermediate_size=10944),
    # deepseek-ai/DeepSeek-V3: shipped FP8, dequantized on load, so planned in bf16; 3 dense
    # layers, 256 experts top-8 + 1 shared; the MTP layer is not counted (never read)
    "deepseek-v3": ModelShape(
        hidden_size=7168, intermediate_size=2048, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=64, num_experts=256, top_k=8, vocab_size=129280, dtype="bfloat16", name="deepseek-v3",
        model_type="deepseek_v3", shared_intermediate_size=2048, kv_lora_rank=512, q_lora_rank=1536,
        qk_nope_head_dim=128, v_head_dim=128, dense_layers=3, dense_intermediate_size=18432),
}

# The published configs of the newer families (config.json as their hub repos ship it, the text
# model's for Llama 4's vision-language checkpoint; MiniMax-M2's FP8 planned in bf16, as
# DeepSeek-V3's): `klotski plan --model glm-4.5-air` with no network and no download.
CONFIGS_DIR = Path(__file__).parent / "configs"
KNOWN_MODELS.update({f.stem: ModelShape.from_config(json.loads(f.read_text()), name=f.stem)
                     for f in sorted(CONFIGS_DIR.glob("*.json"))})


def total_params(shape) -> int:
    """All weights: per-layer attention, gate, experts, plus embeddings, final norm and head."""
    per_layer = shape.attention_params + shape.gate_params + shape.num_experts * (
        shape.expert_params + shape.expert_bias_params)
    outer = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2) + shape.hidden_size
    dense = getattr(shape, "num_dense_layers", 0)  # its MLP and norm instead of router, shared and routed experts
    dense_layer = shape.attention_params + 3 * shape.hidden_size * getattr(shape, "dense_intermediate_size", 0) \
        + shape.hidden_size
    return (shape.num_layers - dense) * per_layer + dense * dense_layer + outer
