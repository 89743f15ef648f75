"""Deterministic small Mixtral checkpoints in the real Hugging Face format.

They are the default model (`tiny-mixtral`), the fixtures of the tests and the
subjects of the benchmarks, so three things matter more than anything else:

* the files are genuine: `config.json` comes from `transformers.MixtralConfig`,
  weights use the hub's tensor names, the tokenizer loads with `AutoTokenizer`;
* they are reproducible: every tensor is drawn from a generator seeded by
  (seed, tensor name), so rebuilding gives byte-identical files and neither the
  shard count nor the expert layout changes a single value;
* greedy decoding is meaningful: weight scales are chosen so the top-1 / top-2
  logit gap is far above rounding noise and routing is not a coin flip, which
  lets the engine's schedules be compared token for token against transformers.

Weights are generated and streamed to disk one tensor at a time, so building
`medium` (~1.5 GB) takes a few hundred MB of RAM whatever the shard count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Callable

import torch

from klotski.builtin.tokenizer import quiet_token_ids, save_tokenizer
from klotski.util import dtypes
from klotski.util.safetensors import SafetensorsWriter

# Bump when anything that changes the bytes of a built model changes, so cached
# built-in models are rebuilt instead of silently going stale.
BUILD_VERSION = 1

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
        rope_theta=10000.0, rms_norm_eps=1e-5, dtype="float32",
    ),
    "small": dict(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-5, dtype="bfloat16",
    ),
    "medium": dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-5, dtype="bfloat16",
    ),
    # Bigger than this machine's 24 GB of RAM (~32 GB in bfloat16): Mixtral-8x7B's layer
    # shape, 11 layers. Only for the by-hand bench of the regime where every system reads
    # from the SSD; nothing in the tests builds it.
    "xl": dict(
        vocab_size=4096, hidden_size=4096, intermediate_size=14336, num_hidden_layers=11,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-5, dtype="bfloat16",
    ),
}

BUILTIN_MODELS: dict[str, str] = {
    "tiny-mixtral": "tiny",
    "small-mixtral": "small",
    "medium-mixtral": "medium",
}

ROUTINGS = ("uniform", "skewed")
STAMP_FILE = "klotski-tiny.json"


# --------------------------------------------------------------------------- weights

def _generator(seed: int, name: str) -> torch.Generator:
    # Python's hash() is salted per process; blake2b is stable everywhere.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _randn(seed: int, name: str, shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    t = torch.randn(tuple(shape), generator=_generator(seed, name))
    return t.mul_(std).add_(mean) if (std != 1.0 or mean != 0.0) else t


@dataclasses.dataclass(frozen=True)
class _Shapes:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    tied: bool

    @classmethod
    def of(cls, cfg) -> "_Shapes":
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size,
                   cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   head_dim, cfg.num_local_experts, bool(cfg.tie_word_embeddings))


class _Weights:
    """Produces each tensor (fp32) from its hub name alone.

    Scales, chosen so a random model still makes crisp decisions:
    embeddings N(0,1); projections N(0, 1/fan_in) so every sub-layer adds an
    O(1) update to the residual; norms 1 +- 0.1 so they are not all identical;
    router rows N(0, ROUTER_GAIN^2/H) so router logits have std ~ROUTER_GAIN and
    the top-2 choice is clear-cut; lm_head N(0, HEAD_GAIN^2/H) so logits spread
    over a few units and top-1/top-2 gaps dwarf fp32 rounding.
    """

    ROUTER_GAIN = 2.0
    HEAD_GAIN = 2.0
    NORM_NOISE = 0.1

    QUIET_GAIN = 0.2
    SELF_PENALTY = 1.0

    def __init__(self, shapes: _Shapes, seed: int, routing: str = "uniform",
                 quiet_ids: tuple[int, ...] = ()):
        self.s, self.seed, self.routing = shapes, seed, routing
        self.quiet_ids = list(quiet_ids)

    def hub_entries(self) -> list[tuple[str, tuple[int, ...]]]:
        s = self.s
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
        for i in range(s.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (s.hidden,)),
                (p + "self_attn.q_proj.weight", (q, s.hidden)),
                (p + "self_attn.k_proj.weight", (kv, s.hidden)),
                (p + "self_attn.v_proj.weight", (kv, s.hidden)),
                (p + "self_attn.o_proj.weight", (s.hidden, q)),
                (p + "post_attention_layernorm.weight", (s.hidden,)),
                (p + "block_sparse_moe.gate.weight", (s.experts, s.hidden)),
            ]
            for e in range(s.experts):
                x = f"{p}block_sparse_moe.experts.{e}."
                out += [(x + "w1.weight", (s.inter, s.hidden)),
                        (x + "w2.weight", (s.hidden, s.inter)),
                        (x + "w3.weight", (s.inter, s.hidden))]
        out.append(("model.norm.weight", (s.hidden,)))
        if not s.tied:
            out.append(("lm_head.weight", (s.vocab, s.hidden)))
        return out

    def fused_entries(self) -> list[tuple[str, tuple[int, ...]]]:
        s = self.s
        out = []
        for name, shape in self.hub_entries():
            if ".experts." in name:
                continue
            if name.endswith("block_sparse_moe.gate.weight"):
                p = name[: -len("block_sparse_moe.gate.weight")]
                out += [(p + "mlp.gate.weight", shape),
                        (p + "mlp.experts.gate_up_proj", (s.experts, 2 * s.inter, s.hidden)),
                        (p + "mlp.experts.down_proj", (s.experts, s.hidden, s.inter))]
            else:
                out.append((name, shape))
        return out

    def make(self, name: str) -> torch.Tensor:
        """The fp32 tensor stored under `name` (hub or fused naming)."""
        if ".mlp." in name:
            return self._fused(name)
        return self._hub(name)

    def _fused(self, name: str) -> torch.Tensor:
        # Fused tensors are assembled from the hub-named experts so both layouts
        # hold exactly the same numbers.
        p, rest = name.split(".mlp.", 1)
        moe = f"{p}.block_sparse_moe."
        if rest == "gate.weight":
            return self._hub(moe + "gate.weight")
        ex = [f"{moe}experts.{e}." for e in range(self.s.experts)]
        if rest == "experts.gate_up_proj":
            return torch.stack([torch.cat([self._hub(x + "w1.weight"), self._hub(x + "w3.weight")])
                                for x in ex])
        if rest == "experts.down_proj":
            return torch.stack([self._hub(x + "w2.weight") for x in ex])
        raise KeyError(name)

    def _hub(self, name: str) -> torch.Tensor:
        s, seed, skewed = self.s, self.seed, self.routing == "skewed"
        if name.endswith("norm.weight"):
            return _randn(seed, name, (s.hidden,), self.NORM_NOISE, 1.0)
        if name == "model.embed_tokens.weight":
            w = _randn(seed, name, (s.vocab, s.hidden))
            return self._skew_embedding(w) if skewed else w
        if name == "lm_head.weight":
            w = _randn(seed, name, (s.vocab, s.hidden), self.HEAD_GAIN / math.sqrt(s.hidden))
            # The last position's residual still holds its input embedding;
            # pointing each token's row away from its own embedding keeps a
            # random model from locking onto one token (x x x x ...).
            emb = self._hub("model.embed_tokens.weight")
            w.sub_(emb, alpha=self.SELF_PENALTY / math.sqrt(s.hidden))
            # Short rows give tokens that cannot stand alone in text (control
            # bytes, UTF-8 fragments, <pad>) small logits, so greedy output
            # reads as words; eos keeps a full row so some sequences stop.
            w[self.quiet_ids] *= self.QUIET_GAIN
            return self._skew_blind_reader(w) if skewed else w
        if name.endswith("block_sparse_moe.gate.weight"):
            return self._router(name)
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        shapes = {
            "q_proj": (q, s.hidden), "k_proj": (kv, s.hidden), "v_proj": (kv, s.hidden),
            "o_proj": (s.hidden, q), "w1": (s.inter, s.hidden), "w3": (s.inter, s.hidden),
            "w2": (s.hidden, s.inter),
        }
        kind = name.rsplit(".", 2)[-2]
        w = _randn(seed, name, shapes[kind], 1.0 / math.sqrt(shapes[kind][1]))
        if skewed and kind in ("o_proj", "w2"):
            return self._skew_blind_writer(w)
        if skewed:
            return self._skew_blind_reader(w)
        return w

    def _router(self, name: str) -> torch.Tensor:
        s = self.s
        std = self.ROUTER_GAIN / math.sqrt(s.hidden)
        w = _randn(self.seed, name, (s.experts, s.hidden), std)
        return self._skew_router(name, w) if self.routing == "skewed" else w

    # Skewed routing mimics two properties of trained MoE routers that the
    # engine's planner and prefetcher exploit: a few experts take most tokens
    # (Zipf-like popularity), and a token's expert at layer l predicts its
    # expert at layer l+1.
    # A router has no bias, so popularity needs a direction every token carries:
    # embeddings get a common component along a unit vector u, and router rows
    # a Zipf-ranked component along u. Every other weight is made blind to u
    # (readers ignore it, writers never write it), so u is a private channel to
    # the routers: the residual's u part stays constant through the layers and
    # the rest of the model behaves like the uniform one (no common component
    # drawing every step towards the same tokens).
    # Layer correlation comes from router rows sharing a base matrix whose rows
    # are dealt to experts by a per-layer permutation; the base row's index is
    # also its popularity rank, so popular experts follow each other too.
    SKEW_OFFSET = 0.5       # u component of every embedding, per-dimension units
    SKEW_ZIPF = 2.5         # router logit advantage of the most popular expert
    SKEW_SHARED = 0.8       # weight of the cross-layer base in each router row

    def _skew_direction(self) -> torch.Tensor:
        u = _randn(self.seed, "skew/direction", (self.s.hidden,))
        return u / u.norm()

    def _skew_embedding(self, w: torch.Tensor) -> torch.Tensor:
        w = self._skew_blind_reader(w)  # the u component is then exactly the offset
        return w.add_(self._skew_direction(), alpha=self.SKEW_OFFSET * math.sqrt(self.s.hidden))

    def _skew_blind_reader(self, w: torch.Tensor) -> torch.Tensor:
        u = self._skew_direction()
        return w.sub_(torch.outer(w @ u, u))

    def _skew_blind_writer(self, w: torch.Tensor) -> torch.Tensor:
        u = self._skew_direction()
        return w.sub_(torch.outer(u, u @ w))

    def _skew_router(self, name: str, fresh: torch.Tensor) -> torch.Tensor:
        s, seed = self.s, self.seed
        layer = int(name.split(".")[2])
        base = _randn(seed, "skew/router-base", (s.experts, s.hidden),
                      self.ROUTER_GAIN / math.sqrt(s.hidden))
        perm = torch.randperm(s.experts, generator=_generator(seed, f"skew/perm/{layer}"))
        mix = self.SKEW_SHARED
        w = self._skew_blind_reader(mix * base[perm] + math.sqrt(1 - mix * mix) * fresh)
        zipf = -torch.log1p(perm.to(torch.float32)) / math.log(s.experts) * self.SKEW_ZIPF
        # The embedding's normalised u projection; deeper layers see less as
        # the residual grows, which keeps their routing a little flatter.
        proj = self.SKEW_OFFSET * math.sqrt(s.hidden) / math.sqrt(1 + self.SKEW_OFFSET ** 2)
        return w + torch.outer(zipf / proj, self._skew_direction())


# --------------------------------------------------------------------------- files

def _write_safetensors(path: Path, entries, dtype: torch.dtype,
                       make: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file of `entries` [(name, shape)], each tensor made when it is written."""
    planned = [(name, dtype, tuple(shape)) for name, shape in entries]
    with SafetensorsWriter(path, {"format": "pt"}, planned) as writer:
        for name, _ in entries:
            writer.add(name, make(name).to(dtype))
        writer.finish()


def _shard_ids(sizes: list[int], n: int) -> list[int]:
    """Contiguous split of tensors into n byte-balanced, non-empty shards."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"num_shards must be in 1..{len(sizes)}, got {n}")
    target, acc, prev, ids = sum(sizes) / n, 0, 0, []
    for i, size in enumerate(sizes):
        k = min(int(acc // target), n - 1, prev + 1)
        k = max(k, n - (len(sizes) - i))  # leave one tensor for every later shard
        ids.append(k)
        acc, prev = acc + size, k
    return ids


def _config_fields() -> set[str]:
    from transformers import MixtralConfig
    return {f.name for f in dataclasses.fields(MixtralConfig)} | {"rope_theta"}


def _save_config(out: Path, kwargs: dict, dtype_name: str, tok):
    from transformers import GenerationConfig, MixtralConfig

    ids = {t: tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")}
    cfg = MixtralConfig(
        **kwargs, architectures=["MixtralForCausalLM"], dtype=dtype_name,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
    )
    cfg.save_pretrained(out)
    # Hub Mixtral configs carry these legacy top-level keys; transformers 5
    # accepts them silently and readers written against hub files find them.
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw["torch_dtype"] = dtype_name
    raw["rope_theta"] = raw["rope_parameters"]["rope_theta"]
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(out)
    return cfg


def _save_weights(out: Path, entries, dtype: torch.dtype, make, num_shards: int) -> None:
    """model.safetensors, or hub-style numbered shards plus their index."""
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous build with another shard count
    if num_shards == 1:
        _write_safetensors(out / "model.safetensors", entries, dtype, make)
        return
    sizes = [math.prod(shape) * dtype.itemsize for _, shape in entries]
    ids = _shard_ids(sizes, num_shards)
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = [e for e, i in zip(entries, ids) if i == k]
        _write_safetensors(out / fname, part, dtype, make)
        weight_map.update({name: fname for name, _ in part})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_checkpoint(out_dir, preset: str = "tiny", *, seed: int = 0, dtype=None,
                     num_shards: int = 1, fused_experts: bool = False,
                     routing: str = "uniform", **overrides) -> Path:
    """Write a deterministic Mixtral checkpoint (config, weights, tokenizer) to out_dir.

    overrides are MixtralConfig fields (num_key_value_heads=1, sliding_window=8,
    tie_word_embeddings=True, ...). vocab_size is the model's vocabulary; the
    tokenizer is trained to that size, or as large as the corpus allows.
    fused_experts writes transformers-5 in-memory names (mlp.gate,
    mlp.experts.gate_up_proj, mlp.experts.down_proj) instead of the hub's
    per-expert block_sparse_moe tensors; values are identical.
    routing="skewed" builds routers with Zipf-like expert popularity and
    correlated consecutive layers: the two most popular experts of a layer
    take ~50% of token-expert assignments, as in real Mixtral, against ~30%
    with "uniform" (see _Weights for how).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    unknown = set(overrides) - _config_fields()
    if unknown:
        raise TypeError(f"not MixtralConfig fields: {sorted(unknown)}")
    kwargs = {**PRESETS[preset], **overrides}
    if "rope_parameters" in overrides:
        kwargs.pop("rope_theta", None)
    preset_dtype = kwargs.pop("dtype")
    wdtype = dtypes.parse(dtype if dtype is not None else preset_dtype)
    dtype_name = dtypes.name_of(wdtype)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(out, kwargs["vocab_size"], kwargs["max_position_embeddings"])
    cfg = _save_config(out, kwargs, dtype_name, tok)
    weights = _Weights(_Shapes.of(cfg), seed, routing, quiet_token_ids(tok, cfg.vocab_size))
    entries = weights.fused_entries() if fused_experts else weights.hub_entries()
    _save_weights(out, entries, wdtype, weights.make, num_shards)

    stamp = {"build_version": BUILD_VERSION, "preset": preset, "seed": seed,
             "dtype": dtype_name, "fused_experts": fused_experts, "routing": routing,
             "num_shards": num_shards, "overrides": overrides}
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True, default=str) + "\n")
    return out


# --------------------------------------------------------------------------- built-ins

def _is_current(path: Path, preset: str) -> bool:
    from klotski.util.cachedir import stamp_matches
    return stamp_matches(path / STAMP_FILE, build_version=BUILD_VERSION, preset=preset)


def ensure_builtin(name: str) -> Path:
    """Directory of built-in model `name`, building it on first use (klotski.util.cachedir.build_once)."""
    from klotski.util import cachedir
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose from {sorted(BUILTIN_MODELS)}")
    preset = BUILTIN_MODELS[name]
    from planner.shapes import ModelShape, total_params
    shape = ModelShape.from_config(PRESETS[preset])
    return cachedir.build_once(name, lambda path: _is_current(path, preset),
                               lambda tmp: build_checkpoint(tmp, preset),
                               need=total_params(shape) * shape.dtype_bytes)
