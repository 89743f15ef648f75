"""ModelSpec: everything the engine, placement and planner need to know about a checkpoint's
shapes and tensor names, read from its `config.json` (no weights touched).

Experts come in two on-disk layouts. Hub checkpoints store one tensor per expert matrix
(`block_sparse_moe.experts.{e}.w1.weight`); transformers v5 may save fused 3-D tensors
(`mlp.experts.gate_up_proj` = cat(w1, w3), `mlp.experts.down_proj` = w2). `TensorRef`
hides the difference: a name plus, for fused tensors, the index along dim 0 and the row
range within it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from klotski.models import fields as F
from placement.store import CheckpointError
from planner.shapes import ModelShape

_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "num_experts", "top_k", "vocab_size", "tie_word_embeddings", "sliding_window")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorRef:
    """Where one logical weight lives: tensor `name`, optionally `index` along dim 0
    (fused experts) and a row range `rows` = (start, stop) along the next dim."""
    name: str
    index: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    vocab_size: int
    rms_norm_eps: float
    sliding_window: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fused_experts: bool = False
    model_type: str = "mixtral"
    config: dict = field(default_factory=dict, compare=False, repr=False)
    # RoPE inverse frequencies [head_dim / 2] (fp32) and the factor cos/sin are scaled by
    rope_inv_freq: torch.Tensor | None = field(default=None, compare=False, repr=False)
    rope_attention_scaling: float = 1.0

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, *, fused_experts: bool = False) -> "ModelSpec":
        mt = cfg.get("model_type", "mixtral")
        if mt != "mixtral":
            raise ValueError(f"model_type {mt!r} is not supported (Klotski runs the Mixtral family)")
        check_config(cfg)
        # shapes are read once, by the planner's ModelShape; the engine adds what it computes with
        shape = ModelShape.from_config(cfg)
        inv_freq, scaling = rope_frequencies(cfg, shape.head_dim)
        return cls(
            **{f: getattr(shape, f) for f in _SHAPE_FIELDS},
            rope_inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            dtype=DTYPES[shape.dtype],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=F.token_ids(cfg, "eos_token_id", shape.vocab_size),
            fused_experts=fused_experts,
            model_type=mt,
            config=cfg,
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
        fused = tensor_names is not None and "model.layers.0.mlp.experts.gate_up_proj" in tensor_names
        try:
            return cls.from_config(cfg, fused_experts=fused)
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None

    # ---- sizes --------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def attention_params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv) + self.hidden_size  # + input norm

    @property
    def gate_params(self) -> int:
        return (self.num_experts + 1) * self.hidden_size  # router + post-attention norm

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """K and V of one token over all layers."""
        b = dtype_bytes or self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * b

    # ---- tensor names -------------------------------------------------------------------
    def attention_refs(self, layer: int) -> dict[str, TensorRef]:
        p = f"model.layers.{layer}."
        return {
            "input_norm": TensorRef(p + "input_layernorm.weight"),
            "q": TensorRef(p + "self_attn.q_proj.weight"),
            "k": TensorRef(p + "self_attn.k_proj.weight"),
            "v": TensorRef(p + "self_attn.v_proj.weight"),
            "o": TensorRef(p + "self_attn.o_proj.weight"),
        }

    def gate_refs(self, layer: int) -> dict[str, TensorRef]:
        # The post-attention norm travels with the router: both are used exactly at the gate.
        part = "mlp" if self.fused_experts else "block_sparse_moe"
        return {"post_norm": TensorRef(f"model.layers.{layer}.post_attention_layernorm.weight"),
                "router": TensorRef(f"model.layers.{layer}.{part}.gate.weight")}

    def expert_refs(self, layer: int, expert: int) -> dict[str, TensorRef]:
        if self.fused_experts:
            p, inter = f"model.layers.{layer}.mlp.experts.", self.intermediate_size
            return {
                "w1": TensorRef(p + "gate_up_proj", expert, (0, inter)),
                "w3": TensorRef(p + "gate_up_proj", expert, (inter, 2 * inter)),
                "w2": TensorRef(p + "down_proj", expert),
            }
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return {w: TensorRef(p + f"{w}.weight") for w in ("w1", "w2", "w3")}

    def embed_refs(self) -> dict[str, TensorRef]:
        return {"embed": TensorRef("model.embed_tokens.weight")}

    def head_refs(self) -> dict[str, TensorRef]:
        # A tied head reads the embedding tensor: on the device it is a copy of its own.
        head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        return {"norm": TensorRef("model.norm.weight"), "lm_head": TensorRef(head)}

    # ---- tensor groups: the unit that placement assigns to a tier and channels move -----
    def group_keys(self) -> list[tuple]:
        """('embed',), ('head',), then per layer ('attn', j), ('gate', j), ('expert', j, e)."""
        keys: list[tuple] = [("embed",), ("head",)]
        for j in range(self.num_layers):
            keys += [("attn", j), ("gate", j)] + [("expert", j, e) for e in range(self.num_experts)]
        return keys

    def group_refs(self, key: tuple) -> dict[str, TensorRef]:
        kind = key[0]
        if kind == "attn":
            return self.attention_refs(key[1])
        if kind == "gate":
            return self.gate_refs(key[1])
        if kind == "expert":
            return self.expert_refs(key[1], key[2])
        if kind == "embed":
            return self.embed_refs()
        if kind == "head":
            return self.head_refs()
        raise KeyError(key)

    def expected_shapes(self) -> dict[TensorRef, tuple[int, ...]]:
        """Shape of every logical weight, for validating a checkpoint before generation."""
        H, I, E = self.hidden_size, self.intermediate_size, self.num_experts
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[TensorRef, tuple[int, ...]] = {}
        o = {**self.embed_refs(), **self.head_refs()}
        shapes[o["embed"]] = (self.vocab_size, H)
        shapes[o["norm"]] = (H,)
        shapes[o["lm_head"]] = (self.vocab_size, H)
        for i in range(self.num_layers):
            a = self.attention_refs(i)
            shapes.update({a["input_norm"]: (H,), a["q"]: (q, H), a["k"]: (kv, H), a["v"]: (kv, H), a["o"]: (H, q)})
            g = self.gate_refs(i)
            shapes.update({g["post_norm"]: (H,), g["router"]: (E, H)})
            for e in range(E):
                x = self.expert_refs(i, e)
                shapes.update({x["w1"]: (I, H), x["w3"]: (I, H), x["w2"]: (H, I)})
        return shapes


def check_config(cfg: dict) -> None:
    """Every config field the Mixtral math reads, checked before anything is loaded; raises
    fields.BadField naming the field, its value and what is allowed."""
    if not isinstance(cfg, dict):
        raise F.BadField("config.json must hold a JSON object")
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_local_experts", "vocab_size"):
        F.integer(cfg, name)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = F.integer(cfg, "num_key_value_heads", default=None, optional=True) or heads
    F.divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    head_dim = F.integer(cfg, "head_dim", default=None, optional=True)
    if head_dim is None:
        F.divisible("hidden_size", hidden, "num_attention_heads", heads)
        head_dim = hidden // heads
    if head_dim % 2:
        raise F.BadField(f"field 'head_dim' is {head_dim}; must be even (RoPE rotates pairs of dimensions)")
    F.integer(cfg, "num_experts_per_tok", high=cfg["num_local_experts"], high_name="num_local_experts")
    F.integer(cfg, "sliding_window", default=None, optional=True)
    F.integer(cfg, "max_position_embeddings", default=32768)
    F.positive_number(cfg, "rms_norm_eps", default=1e-5)
    F.boolean(cfg, "tie_word_embeddings", default=False)
    F.choice(cfg, "hidden_act", ("silu",), default="silu", why=" (Mixtral's experts are SwiGLU)")
    dtype_field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    F.choice(cfg, dtype_field, tuple(DTYPES), default="bfloat16")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        F.token_ids(cfg, name, cfg["vocab_size"])
    rope = _rope_parameters(cfg)
    F.choice(rope, "rope_type", ROPE_TYPES, default="default", where="rope_parameters.",
             why=" (types whose frequencies change with the sequence length are not supported)")
    if "rope_theta" in cfg:
        F.positive_number(cfg, "rope_theta")
    if "rope_theta" in rope:
        F.positive_number(rope, "rope_theta", where="rope_parameters.")
    if "factor" in rope:
        F.positive_number(rope, "factor", where="rope_parameters.")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise F.BadField(f"field 'quantization_config' is present (quant_method {method!r}); Klotski reads "
                         "unquantized bf16/fp16/fp32 weights: use the original checkpoint (and --quantize hqq4)")


# RoPE types whose frequencies are fixed once (transformers computes them, see rope_frequencies)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(cfg: dict) -> dict:
    """`rope_parameters` (transformers 5), else the legacy `rope_scaling`; rope_type named as such."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise F.BadField(f"field 'rope_parameters' is {rope!r}; must be an object such as "
                         "{\"rope_type\": \"default\", \"rope_theta\": 1000000.0}")
    if "rope_type" not in rope and "type" in rope:
        rope = {**rope, "rope_type": rope["type"]}
    return rope


def rope_frequencies(cfg: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention scaling) of a checked config. The
    unscaled kind is computed here as transformers' Mixtral does; scaled kinds by transformers'
    own RoPE utilities on its own config object, which also checks their required fields."""
    rope = _rope_parameters(cfg)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e6)))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers import MixtralConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    try:
        config = MixtralConfig.from_dict(cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise F.BadField(f"field 'rope_parameters' ({kind}): {str(e).strip(chr(34))}") from None
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config)
    return inv_freq.float(), float(scaling)
