"""GGUF checkpoints (llama.cpp's format): `--model file.gguf`, or a folder of one GGUF file or
of several split files (`*-00001-of-0000N.gguf`).

The config and the tokenizer come from the GGUF metadata through transformers' own GGUF
readers (`gguf_file=`), so they are what transformers would run. The tensors are indexed
with the `gguf` package's GGUFReader (offsets, ggml types) and presented under the names and
layouts the families read from a Hugging Face checkpoint: `GgufStore` is a TensorStore whose
entries are logical [rows, cols] weights. Merged experts (`blk.N.ffn_gate_exps` [E, I, H])
and older per-expert tensors (`blk.N.ffn_gate.E`) both become per-expert entries pointing
into the file, so the rest of the engine sees one hub layout. Reading a tensor (`read`)
dequantizes it on the host (non-expert groups: small, used by every token); expert groups
go through `klotski.compress.ggml.GgufCodec`, which reads their raw blocks (`read_raw`) and
keeps them packed until the device decodes them.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from klotski.compress import ggml
from klotski.errors import require
from placement.store import CheckpointError, TensorEntry, TensorStore

# GGUF architecture -> the model_type transformers and the families use
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "gpt-oss": "gpt_oss"}
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder holding GGUF files and no safetensors."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))


def files(path: Path) -> list[Path]:
    """The GGUF files of a checkpoint, the one with the metadata (split 1) first."""
    path = Path(path)
    if path.is_file():
        if _SPLIT.search(path.name):  # one split named: take all its siblings
            stem = _SPLIT.sub("", path.name)
            return sorted(path.parent.glob(f"{stem}-*-of-*.gguf"))
        return [path]
    found = sorted(path.glob("*.gguf"))
    whole = [f for f in found if not _SPLIT.search(f.name)]
    if len(whole) > 1 or (whole and len(found) > 1):
        raise CheckpointError(f"{path}: holds several GGUF models ({', '.join(f.name for f in found[:4])}); "
                              "pass the one to run as --model FILE.gguf")
    return found


def _reader(file: Path):
    """The `gguf` package's reader of `file`: made once while the file is unchanged (it parses
    every metadata field, the vocabulary's too: seconds on a 49k-token file, and opening a
    checkpoint asks three times)."""
    try:
        stat = Path(file).stat()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror}); check the path") from None
    return parsed(str(file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def parsed(file: str, size: int, mtime_ns: int):
    """GGUFReader(file), kept for the file as of `size` and `mtime_ns` (a changed file is parsed again)."""
    GGUFReader = require("gguf", extra="gguf", needed_by=f"reading the GGUF file {file}").GGUFReader
    try:
        return GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, struct errors, numpy errors on a bad header
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"{file}: not a readable GGUF file ({reason}); re-download it") from None


def read_config(first: Path) -> dict:
    """config.json's fields from the GGUF metadata, as transformers reads them, plus what its
    reader leaves out: the experts' own widths (it keeps Qwen's defaults) and, for `llama`
    files with experts (Mixtral; transformers reads them as dense Llama), the MoE fields."""
    from transformers import AutoConfig
    _give_gguf_a_version()
    reader = _reader(first)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{first}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)} (with expert tensors)")
    meta = {k[len(arch) + 1:]: _field(reader, k) for k in reader.fields if k.startswith(arch + ".")}
    if ARCHITECTURES[arch] == "gpt_oss":  # transformers' reader fails on its rope.scaling keys
        try:
            return _gpt_oss_config(reader, meta)
        except KeyError as e:
            raise CheckpointError(f"{first}: GGUF metadata lacks {arch}.{e.args[0]}; not a complete gpt-oss file") from None
    try:
        cfg = AutoConfig.from_pretrained(first.parent, gguf_file=first.name).to_dict()
    except Exception as e:  # transformers raises many kinds on a bad file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"{first}: cannot read the config from its GGUF metadata ({reason})") from None
    moe = meta.get("expert_feed_forward_length")
    if ARCHITECTURES[arch] == "mixtral":
        if not meta.get("expert_count"):
            raise CheckpointError(f"{first}: a dense llama GGUF (no {arch}.expert_count); Klotski runs MoE models")
        from transformers import CONFIG_MAPPING
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim")  # (rope_parameters: the
        # file's rope.freq_base in transformers 5; without it Mixtral's default 1e6 stood in silently)
        base = {k: cfg[k] for k in keep if cfg.get(k) is not None}
        base.update(num_local_experts=int(meta["expert_count"]), num_experts_per_tok=int(meta["expert_used_count"]))
        if moe:
            base["intermediate_size"] = int(moe)
        cfg = CONFIG_MAPPING["mixtral"](**base).to_dict()
    elif moe:
        cfg["moe_intermediate_size"] = int(moe)
        if meta.get("expert_shared_feed_forward_length"):
            cfg["shared_expert_intermediate_size"] = int(meta["expert_shared_feed_forward_length"])
    if cfg.get("dtype") is None and cfg.get("torch_dtype") is None:
        cfg["dtype"] = "bfloat16"  # quantized weights have no dtype of their own; --dtype overrides
    return cfg


def _gpt_oss_config(reader, meta: dict) -> dict:
    """gpt-oss's config from llama.cpp's `gpt-oss.*` keys (transformers' GGUF reader fails on
    them). llama.cpp writes no beta_fast/beta_slow and runs yarn untruncated: OpenAI's values.
    `gguf_experts` tells the family its experts are GGUF's separate gate/up/down."""
    from transformers import CONFIG_MAPPING
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    base = {"hidden_size": int(meta["embedding_length"]), "num_hidden_layers": int(meta["block_count"]),
            "num_attention_heads": int(meta["attention.head_count"]),
            "num_key_value_heads": int(meta.get("attention.head_count_kv") or meta["attention.head_count"]),
            "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon") or 1e-5),
            "max_position_embeddings": int(meta["context_length"]),
            "vocab_size": int(meta.get("vocab_size") or len(tokens.data)),
            "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
            "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
            "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id")}
    rope = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base") or 150000.0)}
    if meta.get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(meta["rope.scaling.factor"]), beta_fast=32.0, beta_slow=1.0,
                    truncate=False, original_max_position_embeddings=int(meta["rope.scaling.original_context_length"]))
    base.update(intermediate_size=int(meta.get("expert_feed_forward_length") or meta["feed_forward_length"]),
                num_local_experts=int(meta["expert_count"]), num_experts_per_tok=int(meta["expert_used_count"]),
                head_dim=int(meta["attention.key_length"]), sliding_window=int(meta["attention.sliding_window"]),
                rope_parameters=rope, attention_bias=True)
    cfg = CONFIG_MAPPING["gpt_oss"](**base).to_dict()
    cfg.update(gguf_experts=True, dtype="bfloat16")  # quantized weights have no dtype of their own
    return cfg


def _give_gguf_a_version() -> None:
    """transformers parses gguf's version from its metadata, which some gguf wheels lack (see
    klotski/builtin/smollm.py): give the module one."""
    gguf = require("gguf", extra="gguf", needed_by="reading a GGUF file")
    if not hasattr(gguf, "__version__"):
        from importlib.metadata import version
        gguf.__version__ = version("gguf")


def load_tokenizer(first: Path, model_type: str = ""):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    _give_gguf_a_version()
    # AutoTokenizer reads the config first, which transformers' reader fails on for gpt-oss
    cls = PreTrainedTokenizerFast if model_type == "gpt_oss" else AutoTokenizer
    try:
        return cls.from_pretrained(first.parent, gguf_file=first.name)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"{first}: cannot load the tokenizer from its GGUF metadata ({reason})") from None


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents() if hasattr(f, "contents") else bytes(f.parts[f.data[0]]).decode()


def open_parts(path: Path, direct: bool):
    """(store, spec, tokenizer, fingerprint) of GGUF checkpoint `path`, checked as a safetensors
    one is: the store's extents and block sizes, the config, shapes against it, the tokenizer."""
    import hashlib
    import json
    from klotski.models.spec import ModelSpec
    paths = files(path)
    if not paths:
        raise CheckpointError(f"{path}: no *.gguf files")
    count = _field(_reader(paths[0]), "split.count")
    if count and int(count) != len(paths):
        raise CheckpointError(f"{paths[0]}: the model is split in {int(count)} files but {len(paths)} are here "
                              f"({', '.join(p.name for p in paths)}); download the missing ones")
    cfg = read_config(paths[0])
    store = GgufStore(paths, cfg["model_type"], (cfg["num_attention_heads"], cfg.get("num_key_value_heads")),
                      direct=direct)
    try:
        spec = ModelSpec.from_config(cfg)
    except ValueError as e:
        raise CheckpointError(f"{paths[0]}: {e}") from None
    store.validate(spec.expected_shapes())
    tokenizer = load_tokenizer(paths[0], cfg["model_type"])
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name in sorted(store.entries):
        e = store.entries[name]
        h.update(f"{name}:{e.shape}:{e.qtype}".encode())
    return store, spec, tokenizer, h.hexdigest()[:16]


@dataclass(frozen=True)
class GgufEntry:
    """A logical weight in a GGUF file: `shape` as Hugging Face lays it out ([out, in]), its
    rows stored as whole ggml blocks of `qtype` from byte `offset`. `span` and `nbytes`
    speak of what `read` returns (fp32), `raw_span` of the bytes as stored."""
    file: Path
    shape: tuple[int, ...]
    offset: int
    qtype: str
    gguf_name: str
    heads: int = 0  # llama's q/k rows are stored permuted per head (llama.cpp's convert): undone on read
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    def _raw(self) -> TensorEntry:
        raw_shape = self.shape[:-1] + (ggml.row_nbytes(self.qtype, self.shape[-1]),)
        return TensorEntry(self.file, torch.uint8, raw_shape, self.offset, math.prod(raw_shape))

    def raw_span(self, index=None, rows=None):
        return self._raw().span(index, rows)

    def span(self, index=None, rows=None):
        offset, _, raw_shape = self.raw_span(index, rows)
        shape = tuple(raw_shape[:-1]) + (self.shape[-1],)
        return offset, math.prod(shape) * 4, shape


class GgufStore(TensorStore):
    """The tensors of a GGUF checkpoint under Hugging Face names (see the module doc)."""

    gguf = True

    def __init__(self, paths: list[Path], model_type: str = "qwen3_moe", heads: tuple = (0, 0), *,
                 direct: bool = False):
        self.files = paths
        self.model_type, self.heads = model_type, (heads[0], heads[1] or heads[0])
        entries: dict[str, GgufEntry] = {}
        for file in paths:
            for t in _reader(file).tensors:
                entries.update(self._index(file, t))
        super().__init__(paths[0], direct=direct, entries=entries)

    def _index(self, file: Path, t) -> dict[str, GgufEntry]:
        """The entries of GGUF tensor `t` of `file`, by Hugging Face name."""
        tid = int(t.tensor_type)
        if tid not in ggml.TYPES:
            raise CheckpointError(f"{file}: tensor {t.name} is stored as {t.tensor_type.name}, which Klotski does "
                                  f"not decode; supported: {', '.join(n for n, _, _ in ggml.TYPES.values())}")
        qtype, block, size = ggml.TYPES[tid]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
        if shape[-1] % block or t.n_bytes != math.prod(shape[:-1]) * shape[-1] // block * size:
            raise CheckpointError(f"{file}: tensor {t.name} has {t.n_bytes} bytes, which is not whole {qtype} "
                                  f"blocks for shape {list(shape)}; corrupt file")
        end, have = t.data_offset + t.n_bytes, file.stat().st_size
        if end > have:
            raise CheckpointError(f"{file}: truncated — tensor {t.name} ends at byte {end} but the file has "
                                  f"{have}; re-download it")
        permuted = self.model_type == "mixtral" and re.search(r"\.attn_[qk]\.weight$", t.name)
        heads = (self.heads[0] if ".attn_q." in t.name else self.heads[1]) if permuted else 0
        return {name: GgufEntry(file, sub_shape, t.data_offset + offset, qtype, t.name, heads)
                for name, sub_shape, offset in hf_names(t.name, shape, qtype, self.model_type)}

    def qtype(self, name: str) -> str:
        return self._entry(name).qtype

    def raw_nbytes(self, name: str, index=None, rows=None) -> int:
        return self._entry(name).raw_span(index, rows)[1]

    def read_raw(self, name: str, index=None, rows=None) -> torch.Tensor:
        """The stored blocks of `name[index][rows]`: uint8 [rows..., row bytes]."""
        offset, nbytes, shape = self._entry(name).raw_span(index, rows)
        return self._pread(self._entry(name).file, offset, nbytes).view(shape)

    def read(self, name: str, index=None, rows=None) -> torch.Tensor:
        """`name[index][rows]` dequantized on the host, fp32 (llama's q/k rows back in Hugging Face order)."""
        w = ggml.dequantize(self.read_raw(name, index, rows), self.qtype(name), torch.float32)
        n = self._entry(name).heads
        if n and index is None and rows is None:
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        return w

    def read_ref(self, ref) -> torch.Tensor:
        return self.read(ref.name, ref.index, ref.rows)

    def read_flat(self, name, start, count):
        raise NotImplementedError("GGUF tensors are scanned by klotski check's own GGUF pass")


# GGUF block tensor suffix -> the Hugging Face name under model.layers.N (qwen families)
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
          **{f"attn_{p}.{w}": f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")},
          **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(_exps|\.(\d+))\.(weight|bias)$")
# gpt-oss's own names (llama.cpp's convert): the rest are _LAYER's
_GPT_OSS = {"post_attention_norm.weight": "post_attention_layernorm.weight", "attn_sinks.weight": "self_attn.sinks",
            "attn_output.bias": "self_attn.o_proj.bias", "ffn_gate_inp.weight": "mlp.router.weight",
            "ffn_gate_inp.bias": "mlp.router.bias"}


_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def expert_types(store: "GgufStore") -> list[str]:
    """The block types of the experts' weights (`*_exps`, biases aside), most bytes first:
    what a GGUF file's precision is named and measured by (its attention is a small share)."""
    counts: dict[str, int] = {}
    for entry in store.entries.values():
        if "_exps" in entry.gguf_name and not entry.gguf_name.endswith(".bias"):
            counts[entry.qtype] = counts.get(entry.qtype, 0) + entry.raw_span()[1]
    return sorted(counts, key=lambda t: -counts[t])


def hf_names(name: str, shape: tuple, qtype: str, model_type: str = "qwen3_moe"):
    """(Hugging Face name, logical shape, byte offset within the GGUF tensor) of each weight that
    GGUF tensor `name` of `shape` holds: one, or one per expert of a merged expert tensor."""
    if name in _TOP:
        return [(_TOP[name], shape, 0)]
    mixtral = model_type == "mixtral"
    m = _EXPERTS.match(name)
    if m:
        layer, proj = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts."
        local = f"{_MIXTRAL[proj]}.{m.group(5)}" if mixtral else f"{proj}_proj.{m.group(5)}"
        if m.group(3) == "_exps":  # [E, rows, cols] ([E, cols] biases): expert e's rows follow expert e - 1's
            step = math.prod(shape[1:-1]) * ggml.row_nbytes(qtype, shape[-1])
            return [(f"{prefix}{e}.{local}", shape[1:], e * step) for e in range(shape[0])]
        return [(f"{prefix}{m.group(4)}.{local}", shape, 0)]
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    if m and model_type == "gpt_oss" and m.group(2) in _GPT_OSS:
        return [(f"model.layers.{m.group(1)}.{_GPT_OSS[m.group(2)]}", shape, 0)]
    if m and m.group(2) in _LAYER:
        hf = f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
        if mixtral and m.group(2) == "ffn_gate_inp.weight":
            hf = f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
        if m.group(2) == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
            shape = (1,) + shape  # stored as [H]; the sigmoid gate is a [1, H] linear
        return [(hf, shape, 0)]
    return []  # tensors no family reads (rope_freqs, ...): left out


def scan(path: Path, piece_bytes: int):
    """`klotski check` of a GGUF checkpoint: one line per problem. Header, tensor extents and
    block sizes (the store), config, shapes and tokenizer (open_parts), then every weight read
    in pieces of at most `piece_bytes` stored bytes: NaN/inf in float tensors, non-finite block
    scales in quantized ones."""
    try:
        store, spec, tokenizer, _ = open_parts(path, direct=False)
    except CheckpointError as e:
        yield str(e)
        return
    try:
        if len(tokenizer) > spec.shape.vocab_size:
            yield (f"{path}: the tokenizer has {len(tokenizer)} tokens but the model has {spec.shape.vocab_size} "
                   "embedding rows; prompts that use the extra tokens will fail")
        for name, entry in sorted(store.entries.items(), key=lambda kv: (str(kv[1].file), kv[1].offset)):
            bad = 0
            rows = entry.shape[0] if len(entry.shape) > 1 else None
            row_bytes = entry.raw_span()[1] // (rows or 1)
            step = max(1, piece_bytes // max(1, row_bytes))
            for a in range(0, rows or 1, step):
                part = (a, min(rows, a + step)) if rows else None
                if entry.qtype in ggml.FLOAT_TYPES:
                    bad += int((~torch.isfinite(store.read(name, rows=part))).sum())
                else:
                    bad += ggml.non_finite_scales(store.read_raw(name, rows=part), entry.qtype)
            if bad:
                what = "non-finite values" if entry.qtype in ggml.FLOAT_TYPES else f"{entry.qtype} blocks with a NaN or infinite scale"
                yield (f"{entry.file}: tensor {entry.gguf_name} ({name}) has {bad} {what}; the weights are corrupt: "
                       "re-download this file")
    finally:
        store.close()
