"""ModelSpec: everything the engine, placement and planner need to know about a checkpoint,
read from its `config.json` (no weights touched): its shape (the planner's `ModelShape`,
the one shape type), the family whose math runs it, the options that math reads, and the
tensor behind every weight.

A family is a module under klotski/models/ (mixtral.py, qwen3_moe.py, ...): config checks,
tensor names in the published layout, and its layer functions, the hooks family.Family
lists. Nothing outside klotski/models names one; the pipeline calls `spec.family`. A
vision-language checkpoint (TEXT_MODELS: Llama 4's) is read as its text model: the family
reads its `text_config` and every tensor name takes the prefix its text weights are under.

Experts come in two on-disk layouts. Hub checkpoints store one tensor per expert matrix
(`...experts.{e}.w1.weight` or `...experts.{e}.gate_proj.weight`); transformers v5 may save
fused 3-D tensors (`mlp.experts.gate_up_proj` = cat(gate, up), `mlp.experts.down_proj`),
named alike in every family (defaults.expert_refs). `TensorRef` hides the difference: a
name plus, for fused tensors, the index along dim 0 and the row range within it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from klotski.models import fields
from klotski.models import deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from klotski.models import glm4_moe, minimax_m2
from klotski.models import ernie4_5_moe, llama4
from klotski.models import qwen3_5_moe, qwen3_next
from klotski.models.family import Family
from klotski.models.refs import TensorRef
from klotski.util import dtypes
from placement.store import CheckpointError
from planner.shapes import FAMILY_FIELDS, ModelShape, family_fields, window_applies

DTYPES = dtypes.torch_dtypes()
FAMILIES: dict[str, Family] = {m.MODEL_TYPE: m for m in (mixtral, qwen3_moe, qwen2_moe, olmoe, gpt_oss,
                                                           deepseek_v2, deepseek_v3, glm4_moe, minimax_m2,
                                                           ernie4_5_moe, llama4, qwen3_next, qwen3_5_moe)}
assert set(FAMILIES) == set(FAMILY_FIELDS)


@dataclass(frozen=True)
class ModelSpec:
    """The shape (`spec.shape`: sizes, layers, experts; the planner's one shape type) plus what
    the engine computes with: dtype, options, the family, tensor names and groups."""
    shape: ModelShape
    dtype: torch.dtype
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fused_experts: bool = False
    norm_topk_prob: bool = True        # renormalise the top-k router weights
    router_weights_fp32: bool = True   # keep router weights in fp32 (Mixtral) or cast them (the rest)
    clip_qkv: float | None = None      # clamp q/k/v to ±clip_qkv (OLMoE)
    weigh_expert_inputs: bool = False  # the router weight scales an expert's input, not its output (Llama 4)
    weights_prefix: str = ""           # a vision-language checkpoint's text weights are under it (TEXT_MODELS)
    rotary_dim: int | None = None      # RoPE turns each head's first rotary_dim dims (GLM-4.5, MiniMax-M2); None: all
    norm_offset: float = 0.0           # RMSNorms scale by norm_offset + w (Qwen3-Next, Qwen3.5: 1)
    config: dict = field(default_factory=dict, compare=False, repr=False)
    # RoPE inverse frequencies [head_dim / 2] (fp32) and the factor cos/sin are scaled by
    rope_inv_freq: torch.Tensor | None = field(default=None, compare=False, repr=False)
    rope_attention_scaling: float = 1.0

    @property
    def family(self) -> Family:
        """The module with this checkpoint's layer functions and tensor names."""
        return FAMILIES[self.shape.model_type]

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, *, fused_experts: bool = False) -> "ModelSpec":
        cfg, prefix = text_model(cfg)
        check_config(cfg)
        family = FAMILIES[cfg.get("model_type", "mixtral")]
        shape = ModelShape.from_config(cfg)
        options = family.options(cfg)
        inv_freq, scaling = rope_frequencies(cfg, options.get("rotary_dim") or shape.head_dim)
        return cls(
            shape=shape,
            rope_inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            dtype=DTYPES[shape.dtype],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=fields.token_ids(cfg, "eos_token_id", shape.vocab_size),
            fused_experts=fused_experts,
            clip_qkv=cfg.get("clip_qkv"),
            config=cfg,
            weights_prefix=prefix,
            **options,
        )

    @classmethod
    def from_dir(cls, path: str | Path, tensor_names=None) -> "ModelSpec":
        """Read `config.json`; `tensor_names` (from the store) decides the expert layout."""
        path = Path(path)
        cfg_file = path / "config.json"
        try:
            cfg = json.loads(cfg_file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{cfg_file}: no config.json; is {path} a Hugging Face checkpoint?") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}:{e.lineno}: config.json is not valid JSON ({e.msg})") from None
        # (any layer: DeepSeek's first layers may be dense)
        fused = tensor_names is not None and any(n.endswith(".mlp.experts.gate_up_proj") for n in tensor_names)
        try:
            return cls.from_config(cfg, fused_experts=fused)
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None


    # ---- tensor names -------------------------------------------------------------------
    def attention_refs(self, layer: int) -> dict[str, TensorRef]:
        names = self.family.attention_names(self, layer)
        # every family names its projections self_attn.{q,k,v,o}_proj; biases where configured
        names.update({f"{n}_bias": f"model.layers.{layer}.self_attn.{n}_proj.bias" for n in self.shape.attention_bias})
        return {k: TensorRef(v) for k, v in names.items()}

    def gate_refs(self, layer: int) -> dict[str, TensorRef]:
        return {k: TensorRef(v) for k, v in self.family.gate_names(self, layer).items()}

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`: the config's on every layer, or on those its
        `layer_types` marks "sliding_attention" (gpt-oss alternates)."""
        window, types = self.shape.sliding_window, self.config.get("layer_types")
        if window is None or not types:
            return window
        return window if types[layer] == "sliding_attention" else None

    def expert_refs(self, layer: int, expert: int) -> dict[str, TensorRef]:
        return self.family.expert_refs(self, layer, expert)

    def embed_refs(self) -> dict[str, TensorRef]:
        return {"embed": TensorRef("model.embed_tokens.weight")}

    def head_refs(self) -> dict[str, TensorRef]:
        # A tied head reads the embedding tensor: on the device it is a copy of its own.
        head = "model.embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
        return {"norm": TensorRef("model.norm.weight"), "lm_head": TensorRef(head)}

    # ---- tensor groups: the unit that placement assigns to a tier and channels move -----
    def group_keys(self) -> list[tuple]:
        """('embed',), ('head',), then per layer ('attn', j), ('gate', j), ('expert', j, e)."""
        keys: list[tuple] = [("embed",), ("head",)]
        for j in range(self.shape.num_layers):
            keys += [("attn", j), ("gate", j)] + [("expert", j, e) for e in range(self.shape.experts_in(j))]
        return keys

    def group_refs(self, key: tuple) -> dict[str, TensorRef]:
        refs = self.family.group_refs(self, key)
        if self.weights_prefix:  # a vision-language checkpoint's text model
            p = self.weights_prefix
            refs = {n: replace(r, name=text_weight(r.name, p), scale=r.scale and text_weight(r.scale, p))
                    for n, r in refs.items()}
        return refs

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every group-local weight name any family uses."""
        s = self.shape
        H, I, Is, D = s.hidden_size, s.intermediate_size, s.shared_intermediate_size, s.head_dim
        Dn = s.dense_intermediate_size
        q, kv = s.num_heads * D, s.num_kv_heads * D
        per_head = s.qk_norm == "head"
        return {"input_norm": (H,), "q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q),
                "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "o_bias": (H,),
                "q_norm": (D,) if per_head else (q,), "k_norm": (D,) if per_head else (kv,),
                "post_norm": (H,), "router": (s.num_experts, H),
                "shared_w1": (Is, H), "shared_w3": (Is, H), "shared_w2": (H, Is), "shared_gate": (1, H),
                "w1": (I, H), "w3": (I, H), "w2": (H, I),
                "dense_w1": (Dn, H), "dense_w3": (Dn, H), "dense_w2": (H, Dn),  # a dense layer's MLP
                "embed": (s.vocab_size, H), "norm": (H,), "lm_head": (s.vocab_size, H),
                **self.family.local_shapes(self)}

    def expected_shapes(self) -> dict[TensorRef, tuple[int, ...]]:
        """Shape of every logical weight, for validating a checkpoint before generation."""
        local = self.local_shapes()
        return {ref: local[name] for key in self.group_keys() for name, ref in self.group_refs(key).items()}


# Vision-language checkpoints whose text model a family runs, by config.json's `model_type`:
# the text model's own model_type (its config is `text_config`) and the prefix its weights are
# saved under (Llama4ForConditionalGeneration, as meta-llama/Llama-4-Scout-17B-16E-Instruct ships
# and save_pretrained writes it). The vision tower's tensors are never read.
TEXT_MODELS = {"llama4": ("llama4_text", "language_model."),
               # Qwen3_5MoeForConditionalGeneration: the text model inside the `model` (text_weight)
               "qwen3_5_moe": ("qwen3_5_moe_text", "model.language_model.")}


def text_weight(name: str, prefix: str) -> str:
    """A text model's weight `name` in its vision-language checkpoint: under `prefix`; where the
    prefix is inside the model's `model.` (Qwen3.5), what was under `model.` moves under it and
    the head (`lm_head.weight`) stays where it is."""
    if prefix.startswith("model."):
        return prefix + name[len("model."):] if name.startswith("model.") else name
    return prefix + name


def text_model(cfg: dict) -> tuple[dict, str]:
    """(the config the family reads, the prefix of its weights): a vision-language checkpoint's
    `text_config` (with the checkpoint's dtype where it names none) and its TEXT_MODELS prefix;
    any other config as it is, with no prefix."""
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in TEXT_MODELS:
        return cfg, ""
    text_type, prefix = TEXT_MODELS[kind]
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise fields.BadField(f"field 'text_config' is {text!r}; a {kind!r} checkpoint's text model must be an object")
    inherited = {k: cfg[k] for k in ("dtype", "torch_dtype") if cfg.get(k) is not None and text.get(k) is None}
    return {"model_type": text_type, **text, **inherited}, prefix


def check_config(cfg: dict) -> None:
    """Every config field the math reads, checked before anything is loaded: the fields all
    families share here, the family's own in its module; raises fields.BadField naming the
    field, its value and what is allowed."""
    if not isinstance(cfg, dict):
        raise fields.BadField("config.json must hold a JSON object")
    mt = cfg.get("model_type", "mixtral")
    if mt not in FAMILIES:
        raise fields.BadField(f"field 'model_type' is {mt!r}; supported: {', '.join(FAMILIES)}")
    names = family_fields(cfg)
    experts = names["num_experts"]
    for name in ("hidden_size", names["intermediate_size"], "num_hidden_layers", "num_attention_heads",
                 experts, "vocab_size"):
        fields.integer(cfg, name)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = fields.integer(cfg, "num_key_value_heads", default=None, optional=True) or heads
    fields.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    head_dim = fields.integer(cfg, "head_dim", default=None, optional=True)
    if head_dim is None:
        fields.divisible("hidden_size", hidden, "num_attention_heads", heads)
        head_dim = hidden // heads
    if head_dim % 2:
        raise fields.BadField(f"field 'head_dim' is {head_dim}; must be even (RoPE rotates pairs of dimensions)")
    fields.integer(cfg, names.get("top_k", "num_experts_per_tok"), high=cfg[experts], high_name=experts)
    if window_applies(cfg):
        fields.integer(cfg, "sliding_window", default=None, optional=True)
    fields.integer(cfg, "max_position_embeddings", default=32768)
    fields.positive_number(cfg, "rms_norm_eps", default=1e-5)
    fields.boolean(cfg, "tie_word_embeddings", default=False)
    dtype_field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    fields.choice(cfg, dtype_field, tuple(DTYPES), default="bfloat16")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields.token_ids(cfg, name, cfg["vocab_size"])
    rope = _rope_parameters(cfg)
    fields.choice(rope, "rope_type", ROPE_TYPES, default="default", where="rope_parameters.",
                  why=" (types whose frequencies change with the sequence length are not supported)")
    if "rope_theta" in cfg:
        fields.positive_number(cfg, "rope_theta")
    if "rope_theta" in rope:
        fields.positive_number(rope, "rope_theta", where="rope_parameters.")
    if "factor" in rope:
        fields.positive_number(rope, "factor", where="rope_parameters.")
    quant = cfg.get("quantization_config")
    method = (quant.get("quant_method", "?") if isinstance(quant, dict) else quant) if quant else None
    if quant:
        FAMILIES[mt].check_quantization(quant)  # the details of a format read as published
    shipped = FAMILIES[mt].QUANTIZATION
    if quant and method not in shipped:
        also = f" or {'/'.join(shipped)} as published" if shipped else ""
        raise fields.BadField(f"field 'quantization_config' is present (quant_method {method!r}); Klotski reads "
                              f"unquantized bf16/fp16/fp32 weights{also}: use the original checkpoint "
                              "(and --quantize hqq4)")
    FAMILIES[mt].check_config(cfg)


# RoPE types whose frequencies are fixed once (transformers computes them, see rope_frequencies)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(cfg: dict) -> dict:
    """`rope_parameters` (transformers 5), else the legacy `rope_scaling`; rope_type named as such."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise fields.BadField(f"field 'rope_parameters' is {rope!r}; must be an object such as "
                              "{\"rope_type\": \"default\", \"rope_theta\": 1000000.0}")
    if "rope_type" not in rope and "type" in rope:
        rope = {**rope, "rope_type": rope["type"]}
    return rope


def rope_frequencies(cfg: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention scaling) of a checked config;
    `head_dim`: the dimensions RoPE turns (fewer than a head's with partial rotary). The
    unscaled kind is computed here as transformers does; scaled kinds by transformers'
    own RoPE utilities on its own config object, which also checks their required fields."""
    rope = _rope_parameters(cfg)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e6)))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    try:
        config = CONFIG_MAPPING[cfg.get("model_type", "mixtral")].from_dict(cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise fields.BadField(f"field 'rope_parameters' ({kind}): {str(e).strip(chr(34))}") from None
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config)
    return inv_freq.float(), float(scaling)
