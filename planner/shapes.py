"""Model shapes the planner reasons about, without weights and without the engine.

The engine's `ModelSpec` carries the same attributes; everything in `planner` accepts either
by duck typing (`as_shape` copies what it needs), so `klotski plan --model mixtral-8x22b`
answers on a laptop with no checkpoint and the planner never imports `klotski`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

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

    @classmethod
    def from_config(cls, cfg: dict, name: str = "") -> "ModelShape":
        """Read a Hugging Face Mixtral `config.json` dict."""
        heads = cfg["num_attention_heads"]
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"config dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            num_experts=cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            vocab_size=cfg["vocab_size"],
            dtype=dtype,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=cfg.get("sliding_window"),
            name=name or cfg.get("_name_or_path", ""),
        )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (dtype_bytes or self.dtype_bytes)

    def key(self) -> str:
        """Stable text identifying the shapes and dtype (for profile cache keys)."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "name")


def dtype_name(obj) -> str:
    """'bfloat16' from a string or a torch.dtype (whose str is 'torch.bfloat16'), no torch import."""
    name = str(getattr(obj, "dtype", obj)).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPE_BYTES)}")
    return name


def as_shape(model) -> ModelShape:
    """A ModelShape from a ModelShape, an engine ModelSpec, a config dict or a known alias."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        try:
            return KNOWN_MODELS[model.lower()]
        except KeyError:
            raise KeyError(f"unknown model alias {model!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None
    if isinstance(model, dict):
        return ModelShape.from_config(model)
    return ModelShape(
        hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_layers=model.num_layers, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, num_experts=model.num_experts, top_k=model.top_k,
        vocab_size=model.vocab_size, dtype=dtype_name(model),
        tie_word_embeddings=bool(model.tie_word_embeddings), sliding_window=model.sliding_window,
        name=getattr(model, "name", "") or getattr(model, "model_type", ""),
    )


# Published configs (config.json of mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1).
# sliding_window is null in both (full attention over 32k/64k positions).
KNOWN_MODELS: dict[str, ModelShape] = {
    "mixtral-8x7b": ModelShape(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, vocab_size=32000, dtype="bfloat16", name="mixtral-8x7b"),
    "mixtral-8x22b": ModelShape(
        hidden_size=6144, intermediate_size=16384, num_layers=56, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, vocab_size=32768, dtype="bfloat16", name="mixtral-8x22b"),
}


def total_params(shape) -> int:
    """All weights: per-layer attention, gate, experts, plus embeddings, final norm and head."""
    per_layer = shape.attention_params + shape.gate_params + shape.num_experts * shape.expert_params
    outer = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2) + shape.hidden_size
    return shape.num_layers * per_layer + outer
