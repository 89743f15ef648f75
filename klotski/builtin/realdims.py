"""Checkpoints with real MoE layer shapes and few layers, random weights made on the device.

`klotski bench --preset gpu` measures the job Klotski exists for (a model far bigger than the
card, streamed over the link) at the layer dimensions of Mixtral-8x7B, Mixtral-8x22B and
Qwen3-30B-A3B, in minutes. The seeded CPU generator of klotski.builtin.tiny would take an hour
for 10 GB, so here every tensor is drawn by a torch generator ON the device it is built on
(seconds on a GPU), with a small standard deviation (1/sqrt(fan-in)) so activations stay finite in bfloat16,
then written one tensor at a time (util.safetensors) — to a RAM-backed directory when the
caller picks one. Names and shapes are transformers' own: the model is instantiated on the
meta device from the family's config class and its state dict is what gets written (fused
expert tensors, which transformers and Klotski both read).

`shrink` divides the widths (hidden, expert width, vocabulary by s; heads and head_dim by
sqrt(s)) for the same command on a CPU. `routing="skewed"` gives every embedding a common
component along one direction u and each router a Zipf-ranked component along u, the rank
order dealt per layer by a fixed permutation, so a few experts take most tokens and the
predictors have something to find.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from klotski.util import dtypes
from klotski.util.safetensors import SafetensorsWriter

BUILD_VERSION = 1
STAMP_FILE = "klotski-realdims.json"
# The published configs' shapes (config.json on the hub); `full_layers` is the real depth
# the benchmark extrapolates to.
SHAPES: dict[str, dict] = {
    "mixtral-8x7b": dict(family="mixtral", full_layers=32, vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5),
    "mixtral-8x22b": dict(family="mixtral", full_layers=56, vocab_size=32768, hidden_size=6144,
                          intermediate_size=16384, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                          num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5),
    "qwen3-30b-a3b": dict(family="qwen3_moe", full_layers=48, vocab_size=151936, hidden_size=2048,
                          moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, rms_norm_eps=1e-6),
}
WIDTHS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size")
HEADS = ("num_attention_heads", "num_key_value_heads", "head_dim")
WEIGHT_GAIN = 1.0   # linear layers: std gain / sqrt(fan_in), an O(1) update per sub-layer at every width
ROUTER_GAIN = 2.0   # router logits of std ~2: decisive routing
SKEW_OFFSET = 1.0   # each embedding's component along u
SKEW_ZIPF = 3.0     # router logit advantage of a layer's most popular expert


def config_fields(name: str, layers: int, shrink: int = 1) -> tuple[str, dict]:
    """(family, config kwargs) of `name` at `layers` layers, widths divided by `shrink`."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    root = math.isqrt(shrink)
    if shrink < 1 or root * root != shrink:
        raise ValueError(f"shrink must be a perfect square (1, 4, 16, ...), got {shrink}")
    kw = {k: v for k, v in SHAPES[name].items() if k not in ("family", "full_layers")}
    for k in WIDTHS:
        if k in kw:
            kw[k] = max(kw[k] // shrink, 8)
    for k in HEADS:
        kw[k] = max(kw[k] // root, 1)
    kw["vocab_size"] = max(kw["vocab_size"], 600)  # the byte-level tokenizer's base
    kw.update(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return SHAPES[name]["family"], kw


def _stamp(name, layers, shrink, routing, dtype, seed) -> dict:
    return {"build_version": BUILD_VERSION, "shape": name, "layers": layers, "shrink": shrink,
            "routing": routing, "dtype": dtype, "seed": seed}


def is_built(out_dir, name: str, layers: int, *, shrink: int = 1, routing: str = "skewed",
             dtype: str = "bfloat16", seed: int = 0) -> bool:
    try:
        return json.loads((Path(out_dir) / STAMP_FILE).read_text()) == _stamp(name, layers, shrink, routing, dtype, seed)
    except (OSError, ValueError):
        return False


class _Draw:
    """Each tensor from a generator on `device` seeded by (seed, its index): reproducible per device."""

    def __init__(self, kw: dict, device: torch.device, seed: int, routing: str):
        self.kw, self.device, self.seed, self.skewed = kw, device, seed, routing == "skewed"
        self.count = 0
        self.u = self._randn((kw["hidden_size"],))
        self.u /= self.u.norm()

    def _randn(self, shape) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.count)
        self.count += 1
        return torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)

    def make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = self._randn(shape)
        if name.endswith("norm.weight"):
            return w.mul_(0.05).add_(1.0)
        if name == "model.embed_tokens.weight":
            w.mul_(0.5)
            if self.skewed:
                w.add_(self.u, alpha=SKEW_OFFSET * 0.5 * math.sqrt(shape[1]))
            return w
        if name.endswith("mlp.gate.weight"):
            w.mul_(ROUTER_GAIN / math.sqrt(shape[1]))
            if self.skewed:
                layer = int(name.split(".")[2])
                experts = shape[0]
                gen = torch.Generator().manual_seed(self.seed * 7919 + layer)
                rank = torch.randperm(experts, generator=gen).to(self.device, torch.float32)
                zipf = -torch.log1p(rank) / math.log(experts) * SKEW_ZIPF
                # the embedding's u part reaches the router through the norm at ~1/sqrt(1+offset^2) of it
                w.add_(torch.outer(zipf, self.u) / (SKEW_OFFSET * math.sqrt(shape[1]) / math.sqrt(1 + SKEW_OFFSET ** 2)))
            return w
        return w.mul_(WEIGHT_GAIN / math.sqrt(shape[-1]))


def build(out_dir, name: str, layers: int, *, device: str = "cpu", shrink: int = 1, routing: str = "skewed",
          dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write `name` at `layers` layers (config, tokenizer, weights, stamp last) into out_dir;
    a directory already holding this build is returned as it is."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    from klotski.builtin.tokenizer import save_tokenizer

    out = Path(out_dir)
    if is_built(out, name, layers, shrink=shrink, routing=routing, dtype=dtype, seed=seed):
        return out
    family, kw = config_fields(name, layers, shrink)
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP_FILE).unlink(missing_ok=True)
    tok = save_tokenizer(out, kw["vocab_size"], kw["max_position_embeddings"])
    ids = {k: tok.token_to_id(t) for k, t in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"))}
    config = CONFIG_MAPPING[family](**kw, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    config.dtype = dtype
    with torch.device("meta"):
        entries = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()]
    config.architectures = [{"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    wdtype, draw = dtypes.parse(dtype), _Draw(kw, torch.device(device), seed, routing)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    with SafetensorsWriter(out / "model.safetensors", {"format": "pt"},
                           [(n, wdtype, s) for n, s in entries]) as writer:
        for n, s in entries:
            writer.add(n, draw.make(n, s).to(wdtype))
        writer.finish()
    (out / STAMP_FILE).write_text(json.dumps(_stamp(name, layers, shrink, routing, dtype, seed)) + "\n")
    return out


def model_bytes(name: str, layers: int, shrink: int = 1, dtype_bytes: int = 2) -> dict:
    """{"layer": bytes of one layer, "ends": embedding + head + final norm} of the shape, on paper."""
    _, kw = config_fields(name, layers, shrink)
    h, q, kv = kw["hidden_size"], kw["num_attention_heads"] * kw["head_dim"], kw["num_key_value_heads"] * kw["head_dim"]
    experts = kw.get("num_local_experts") or kw["num_experts"]
    inter = kw.get("moe_intermediate_size") or kw["intermediate_size"]
    layer = h * (2 * q + 2 * kv) + experts * (3 * h * inter + h) + 2 * h
    return {"layer": layer * dtype_bytes, "ends": (2 * kw["vocab_size"] * h + h) * dtype_bytes}
