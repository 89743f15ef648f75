"""Small GGUF checkpoints written with the `gguf` package (GGUFWriter), for the GGUF tests.

Experts are stored as the asked ggml type: Q8_0 and Q4_0 through gguf's own quantizer, the
K-quants as random valid blocks (random codes, small finite fp16 scales), since gguf cannot
quantize those. Everything else is F32. The tokenizer is the built-in byte-level BPE written
as GGUF `gpt2` tokenizer metadata.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

QWEN3 = dict(arch="qwen3moe", hidden=256, heads=4, kv_heads=2, head_dim=64, layers=2, experts=4, top_k=2,
             moe_inter=768, vocab=384)
# transformers' GGUF config reader ignores Qwen2-MoE's expert sizes: its defaults (1408, 5632) are used
QWEN2 = dict(arch="qwen2moe", hidden=128, heads=4, kv_heads=2, head_dim=32, layers=2, experts=4, top_k=2,
             moe_inter=1408, shared_inter=5632, vocab=384)
MIXTRAL = dict(arch="llama", hidden=256, heads=4, kv_heads=2, head_dim=64, layers=2, experts=4, top_k=2,
               moe_inter=512, vocab=384)
F16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def expert_blocks(qtype: str, w: np.ndarray, rng) -> tuple[np.ndarray, object]:
    """(raw bytes [rows, row bytes] or the float array, ggml type) of weight w [rows, cols]."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype in ("Q8_0", "Q4_0"):
        return gguf.quants.quantize(w.astype(np.float32), T[qtype]), T[qtype]
    block, size = GGML_QUANT_SIZES[T[qtype]]
    rows, cols = w.shape
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        d = np.abs(rng.normal(0, 4e-4 if qtype != "Q6_K" else 2e-3, size=(raw.shape[0], 1))).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1), T[qtype]


def add_tokenizer(w, size: int) -> None:
    """The built-in byte-level BPE as GGUF `gpt2` tokenizer metadata, padded to `size` tokens."""
    from klotski.builtin import tokenizer as builtin_tok
    tok = json.loads(builtin_tok.tokenizer_json(size))
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert len(tokens) <= size
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    specials = set(builtin_tok.SPECIAL_TOKENS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_pad_token_id(tokens.index("<pad>"))


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert: q/k rows regrouped per head (interleaved rotary halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path: Path, qtype: str = "Q8_0", shape: dict = QWEN3, seed: int = 0, merged: bool = True,
          attn_qtype: str = "F32", hf: dict | None = None, split_max_tensors: int = 0) -> Path:
    """Write a random model of `shape` to `path` (a .gguf file), experts as `qtype`. `hf`, when
    given, receives the weights as a Hugging Face checkpoint names and lays them out (fp32 as
    gguf decodes them), written independently of Klotski's reader: the Mixtral reference."""
    import gguf

    rng = np.random.default_rng(seed)
    s = shape
    H, D, L, E, Im = s["hidden"], s["head_dim"], s["layers"], s["experts"], s["moe_inter"]
    w = gguf.GGUFWriter(str(path), s["arch"], split_max_tensors=split_max_tensors)
    w.add_name("klotski-test")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(Im * 2)
    w.add_expert_feed_forward_length(Im)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(E)
    w.add_expert_used_count(s["top_k"])
    if "shared_inter" in s:
        w.add_expert_shared_feed_forward_length(s["shared_inter"])

    add_tokenizer(w, s["vocab"])

    llama = s["arch"] == "llama"
    hf = {} if hf is None else hf

    def keep(name, data, raw_type):
        if name in HF_NAMES:
            hf[HF_NAMES[name]] = decoded(data, raw_type)
        elif (m := EXPERT.match(name)):
            for e in range(data.shape[0]):
                j, proj = m.group(1), {"gate": "w1", "up": "w3", "down": "w2"}[m.group(2)]
                hf[f"model.layers.{j}.block_sparse_moe.experts.{e}.{proj}.weight"] = decoded(data[e], raw_type)
        elif (m := LAYER.match(name)) and m.group(2) in LAYER_NAMES:
            hf[f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"] = decoded(data, raw_type)

    def f32(name, *dims, scale=0.05, base=0.0):
        data = (base + rng.normal(0, scale, size=dims)).astype(np.float32)
        keep(name, data, None)
        w.add_tensor(name, data)

    def mat(name, rows, cols, qt):
        data, raw_type = expert_blocks(qt, rng.normal(0, 0.05, size=(rows, cols)), rng)
        keep(name, data, raw_type)
        heads = {"attn_q": s["heads"], "attn_k": s["kv_heads"]}.get(name.split(".")[2]) if llama else None
        w.add_tensor(name, permute(data, heads) if heads else data, raw_dtype=raw_type)

    V = s["vocab"]
    f32("token_embd.weight", V, H, scale=0.5)
    f32("output_norm.weight", H, base=1.0)
    f32("output.weight", V, H, scale=0.1)
    for j in range(L):
        p = f"blk.{j}."
        f32(p + "attn_norm.weight", H, base=1.0)
        mat(p + "attn_q.weight", s["heads"] * D, H, attn_qtype)
        mat(p + "attn_k.weight", s["kv_heads"] * D, H, attn_qtype)
        mat(p + "attn_v.weight", s["kv_heads"] * D, H, attn_qtype)
        mat(p + "attn_output.weight", H, s["heads"] * D, attn_qtype)
        if llama:
            pass
        elif s["arch"] == "qwen3moe":
            f32(p + "attn_q_norm.weight", D, base=1.0)
            f32(p + "attn_k_norm.weight", D, base=1.0)
        else:
            for n, width in (("q", s["heads"] * D), ("k", s["kv_heads"] * D), ("v", s["kv_heads"] * D)):
                f32(p + f"attn_{n}.bias", width, scale=0.02)
            Is = s["shared_inter"]
            f32(p + "ffn_gate_inp_shexp.weight", H, scale=0.1)
            f32(p + "ffn_gate_shexp.weight", Is, H)
            f32(p + "ffn_up_shexp.weight", Is, H)
            f32(p + "ffn_down_shexp.weight", H, Is)
        f32(p + "ffn_norm.weight", H, base=1.0)
        f32(p + "ffn_gate_inp.weight", E, H, scale=0.2)
        for proj, rows, cols in (("gate", Im, H), ("up", Im, H), ("down", H, Im)):
            qt = qtype.get(proj, "Q4_K") if isinstance(qtype, dict) else qtype  # Q4_K_M-like: types per tensor
            parts = [expert_blocks(qt, rng.normal(0, 0.05, size=(rows, cols)), rng) for _ in range(E)]
            keep(p + f"ffn_{proj}_exps.weight", np.stack([d for d, _ in parts]), parts[0][1])
            if merged:
                w.add_tensor(p + f"ffn_{proj}_exps.weight", np.stack([d for d, _ in parts]), raw_dtype=parts[0][1])
            else:
                for e, (d, t) in enumerate(parts):
                    w.add_tensor(p + f"ffn_{proj}.{e}.weight", d, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
LAYER = re.compile(r"blk\.(\d+)\.(.+)$")
EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def decoded(data: np.ndarray, raw_type) -> np.ndarray:
    import gguf
    return data.astype(np.float32) if raw_type is None else gguf.quants.dequantize(data, raw_type)


def write_reference(hf: dict, path: Path, out: Path) -> Path:
    """A Mixtral (or gpt-oss) safetensors checkpoint of `hf`'s weights, for transformers to run as
    the reference. Its config and tokenizer are built here from what the writer put in the file
    (`reference_config`, the built-in tokenizer the file's vocabulary came from), never through
    Klotski's GGUF reader: a field that reader gets wrong makes the two runs differ."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from klotski.builtin import tokenizer as builtin_tok
    out.mkdir()
    save_file({n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in hf.items()}, str(out / "model.safetensors"))
    reference_config(path).save_pretrained(out)
    # the vocabulary and merges `add_tokenizer` wrote; the file sets no tokenizer.ggml.add_bos_token,
    # so, as llama.cpp reads a gpt2 tokenizer, no <s> is added: the built-in's post-processor goes
    spec = json.loads(builtin_tok.tokenizer_json(GPT_OSS["vocab"] if path.name.startswith("gpt-oss")
                                                 else MIXTRAL["vocab"]))
    spec["post_processor"] = None
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", clean_up_tokenization_spaces=False).save_pretrained(out)
    return out


def reference_config(path: Path):
    """transformers' config for the file `write` (Mixtral, a `llama` file) or `write_gpt_oss`
    made, from the values those writers put in it; what a GGUF file does not carry keeps the
    config class's defaults (the family's published conventions: gpt-oss's alternating sliding
    layers, its yarn betas, its SwiGLU clamp)."""
    from transformers import GptOssConfig, MixtralConfig
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # <pad>, <s>, </s>: SPECIAL_TOKENS' order
    if path.name.startswith("gpt-oss"):
        s = GPT_OSS
        return GptOssConfig(
            num_hidden_layers=s["layers"], num_local_experts=s["experts"], num_experts_per_tok=s["top_k"],
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], head_dim=s["head_dim"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], sliding_window=s["window"],
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="float32",
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False}, **ids)
    s = MIXTRAL
    return MixtralConfig(
        num_hidden_layers=s["layers"], num_local_experts=s["experts"], num_experts_per_tok=s["top_k"],
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["moe_inter"], head_dim=s["head_dim"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, dtype="float32", **ids)


GPT_OSS = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, layers=2, experts=4, top_k=2, inter=128, vocab=384,
               window=8)


def mxfp4_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Random valid GGUF MXFP4 blocks [rows, cols / 32 * 17]: an E8M0 exponent (2^-8 .. 2^-5, so
    weights stay within ±0.2) then 16 bytes of two E2M1 codes each."""
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(119, 123, size=(rows, cols // 32))
    return raw.reshape(rows, -1)


def write_gpt_oss(path: Path, hf: dict, seed: int = 0, s: dict = GPT_OSS) -> Path:
    """A gpt-oss GGUF file named and laid out as llama.cpp's convert writes one (separate
    `ffn_{gate,up,down}_exps` MXFP4 experts with F32 `.bias` tensors, `attn_sinks`,
    `post_attention_norm`, router `ffn_gate_inp` with a bias, yarn RoPE); `hf` receives the same
    weights in transformers' unquantized gpt-oss layout (gate and up columns interleaved in
    `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]), dequantized by gguf: the reference."""
    import gguf
    from gguf.constants import GGMLQuantizationType as T
    rng = np.random.default_rng(seed)
    H, D, L, E, I, V = s["hidden"], s["head_dim"], s["layers"], s["experts"], s["inter"], s["vocab"]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("klotski-test")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_expert_feed_forward_length(I)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
    w.add_sliding_window(s["window"])
    w.add_expert_count(E)
    w.add_expert_used_count(s["top_k"])
    add_tokenizer(w, V)

    def f32(name, hf_name, *dims, scale=0.05, base=0.0):
        data = (base + rng.normal(0, scale, size=dims)).astype(np.float32)
        hf[hf_name] = data
        w.add_tensor(name, data)
        return data

    f32("token_embd.weight", "model.embed_tokens.weight", V, H, scale=0.5)
    f32("output_norm.weight", "model.norm.weight", H, base=1.0)
    f32("output.weight", "lm_head.weight", V, H, scale=0.1)
    for j in range(L):
        p, q = f"blk.{j}.", f"model.layers.{j}."
        f32(p + "attn_norm.weight", q + "input_layernorm.weight", H, base=1.0)
        for n, rows in (("q", s["heads"] * D), ("k", s["kv_heads"] * D), ("v", s["kv_heads"] * D)):
            f32(p + f"attn_{n}.weight", q + f"self_attn.{n}_proj.weight", rows, H)
            f32(p + f"attn_{n}.bias", q + f"self_attn.{n}_proj.bias", rows, scale=0.02)
        f32(p + "attn_output.weight", q + "self_attn.o_proj.weight", H, s["heads"] * D)
        f32(p + "attn_output.bias", q + "self_attn.o_proj.bias", H, scale=0.02)
        f32(p + "attn_sinks.weight", q + "self_attn.sinks", s["heads"], scale=0.5)
        f32(p + "post_attention_norm.weight", q + "post_attention_layernorm.weight", H, base=1.0)
        f32(p + "ffn_gate_inp.weight", q + "mlp.router.weight", E, H, scale=0.2)
        f32(p + "ffn_gate_inp.bias", q + "mlp.router.bias", E, scale=0.1)
        mats, biases = {}, {}
        for proj, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
            raw = np.stack([mxfp4_blocks(rows, cols, rng) for _ in range(E)])
            w.add_tensor(p + f"ffn_{proj}_exps.weight", raw, raw_dtype=T.MXFP4)
            mats[proj] = gguf.quants.dequantize(raw, T.MXFP4)  # [E, rows, cols]
            biases[proj] = (rng.normal(0, 0.02, size=(E, rows))).astype(np.float32)
            w.add_tensor(p + f"ffn_{proj}_exps.bias", biases[proj])
        gate_up = np.empty((E, H, 2 * I), np.float32)
        gate_up[..., ::2], gate_up[..., 1::2] = mats["gate"].transpose(0, 2, 1), mats["up"].transpose(0, 2, 1)
        gate_up_bias = np.empty((E, 2 * I), np.float32)
        gate_up_bias[:, ::2], gate_up_bias[:, 1::2] = biases["gate"], biases["up"]
        hf[q + "mlp.experts.gate_up_proj"], hf[q + "mlp.experts.gate_up_proj_bias"] = gate_up, gate_up_bias
        hf[q + "mlp.experts.down_proj"] = np.ascontiguousarray(mats["down"].transpose(0, 2, 1))
        hf[q + "mlp.experts.down_proj_bias"] = biases["down"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
