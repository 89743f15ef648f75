"""Broken copies of a good test checkpoint, one way each, as a careless download, a bad edit
or a corrupt training run would leave them. `KINDS` maps a name to (how to break it, what
Klotski must do): refuse in one line naming what it says, or write error records for the
prompts it cannot compute (non-finite numbers)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _config(**changes):
    """Edit config.json: a value of ... deletes the field."""
    def apply(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is ...:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


def _rope(**params):
    def apply(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_parameters"] = {**cfg.get("rope_parameters", {}), **params}
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


def _remove(*names):
    def apply(d: Path):
        for n in names:
            (d / n).unlink()
    return apply


def _write(name, text):
    def apply(d: Path):
        (d / name).write_text(text)
    return apply


def _truncate(name: str):
    def apply(d: Path):
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])
    return apply


def add_tokens(n: int):
    """A tokenizer with `n` tokens more than the embedding has rows."""
    def apply(d: Path):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(d)
        tok.add_tokens([f"<extra_{i}>" for i in range(n)])
        tok.save_pretrained(d)
    return apply


def _poison(tensor: str, value: float, row: int | None = None):
    """Put `value` (nan or inf) into `tensor` (one row of it if `row` is given)."""
    def apply(d: Path):
        for f in d.glob("*.safetensors"):
            tensors = load_file(f)
            if tensor in tensors:
                t = tensors[tensor].clone()
                if row is None:
                    t.view(-1)[:: 7] = value
                else:
                    t[row] = value
                tensors[tensor] = t
                save_file(tensors, f, metadata={"format": "pt"})
                return
        raise KeyError(tensor)
    return apply


EXPERT = "model.layers.1.block_sparse_moe.experts.3.w1.weight"

# name: (break, expected) -- expected is ("refused", words the one line must contain) or
# ("records", words every error record's message must contain)
KINDS = {
    # the six of the issue
    "tokenizer missing": (_remove("tokenizer.json", "tokenizer_config.json"), ("refused", "no tokenizer files")),
    "top-k above experts": (_config(num_experts_per_tok=9), ("refused", "'num_experts_per_tok' is 9")),
    "negative layers": (_config(num_hidden_layers=-2), ("refused", "'num_hidden_layers' is -2")),
    "top-k zero": (_config(num_experts_per_tok=0), ("refused", "'num_experts_per_tok' is 0")),
    "negative rope theta": (_rope(rope_theta=-10000.0), ("refused", "'rope_parameters.rope_theta' is -10000.0")),
    "nan expert": (_poison(EXPERT, float("nan")), ("records", "at layer 1 of 4")),
    # more of our own
    "heads not divisible": (_config(num_key_value_heads=3), ("refused", "multiple of 'num_key_value_heads'")),
    "zero epsilon": (_config(rms_norm_eps=0), ("refused", "'rms_norm_eps' is 0")),
    "unknown rope type": (_rope(rope_type="dynamic", factor=4.0), ("refused", "'rope_parameters.rope_type' is 'dynamic'")),
    "unknown dtype": (_config(dtype="float8_e4m3fn", torch_dtype=...), ("refused", "'dtype' is 'float8_e4m3fn'")),
    "gelu experts": (_config(hidden_act="gelu"), ("refused", "'hidden_act' is 'gelu'")),
    "vocab size as text": (_config(vocab_size="512"), ("refused", "'vocab_size' is '512'")),
    "hidden size missing": (_config(hidden_size=...), ("refused", "'hidden_size' is missing")),
    "eos outside vocabulary": (_config(eos_token_id=70000), ("refused", "'eos_token_id' is 70000")),
    "quantized checkpoint": (_config(quantization_config={"quant_method": "gptq", "bits": 4}),
                             ("refused", "quant_method 'gptq'")),
    "tokenizer corrupt": (_write("tokenizer.json", "{not json"), ("refused", "cannot load the tokenizer")),
    # handled before this issue; kept
    "experts disagree with tensors": (_config(num_local_experts=16), ("refused", "config and weights disagree")),
    "config not json": (_write("config.json", '{"model_type": "mixtral",'), ("refused", "not valid JSON")),
    "truncated shard": (_truncate("model.safetensors"), ("refused", "truncated")),
    # non-finite numbers: error records
    "inf lm head": (_poison("lm_head.weight", float("inf")), ("records", "in the final norm or lm_head")),
    "nan embedding row": (_poison("model.embed_tokens.weight", float("nan")), ("records", "at layer 0 of 4")),
}


def broken_copy(good: Path, dest: Path, kind: str) -> Path:
    shutil.copytree(good, dest)
    KINDS[kind][0](dest)
    return dest


def poison_row(d: Path, tensor: str, row: int) -> None:
    _poison(tensor, float("nan"), row=row)(d)


def tensor_has_non_finite(d: Path, tensor: str) -> bool:
    for f in d.glob("*.safetensors"):
        t = load_file(f).get(tensor)
        if t is not None:
            return not bool(torch.isfinite(t).all())
    raise KeyError(tensor)
