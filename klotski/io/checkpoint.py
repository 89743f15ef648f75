"""A checkpoint opened for a run: its files, shapes, tokenizer and identity, and the exact
bytes of every tensor group. Nothing is loaded: everything the planner needs to accept or
refuse a run is known here, before a single weight is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from klotski.compress import hqq
from klotski.util import cachedir, dtypes
from klotski.io import gguf, registry
from klotski.models.spec import ModelSpec
from placement.store import CheckpointError, TensorStore
from planner.costmodel import GroupBytes


@dataclass
class Checkpoint:
    directory: Path
    store: TensorStore
    spec: ModelSpec
    tokenizer: object
    key: str  # fingerprint: names this checkpoint's entries in the cache

    @classmethod
    def open(cls, model: str, *, direct_io: bool = True) -> "Checkpoint":
        directory = registry.resolve(model)
        if gguf.is_gguf(directory):  # config, tokenizer and tensors from the GGUF file(s)
            return cls(directory, *gguf.open_parts(directory, direct_io))
        store = TensorStore(directory, direct=direct_io)
        spec = ModelSpec.from_dir(directory, store.names())
        store.validate(spec.expected_shapes())
        tokenizer = load_tokenizer(directory, spec)
        return cls(directory, store, spec, tokenizer, cachedir.fingerprint(directory, store))

    def compute_dtype(self, name: str) -> torch.dtype:
        """`--dtype`: the checkpoint's own for 'auto'."""
        return self.spec.dtype if name == "auto" else dtypes.torch_dtypes()[name]

    def eos_ids(self) -> set[int]:
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def group_nbytes(self, key, dtype: torch.dtype, quant=None) -> tuple[int, int]:
        """(bytes of `key` in a tier and on a link, bytes of its dequantized copy or 0) in the
        compute dtype; `quant` (a klotski.compress.hqq.QuantSpec) packs attention and experts."""
        if key[0] == "expert" and self.spec.shape.expert_format == "mxfp4":  # packed as shipped
            from klotski.compress import mxfp4
            return mxfp4.group_nbytes(self.spec, self.store, key, dtype)
        if key[0] == "expert" and self.is_gguf:  # GGUF blocks as stored
            codec = self.expert_codec(dtype)
            return codec.packed_nbytes(key), codec.decoded_nbytes(key)
        full = packed = 0
        for name, ref in self.spec.group_refs(key).items():
            shape = self.store.entries[ref.name].span(ref.index, ref.rows)[2]
            nbytes = math.prod(shape) * dtype.itemsize
            full += nbytes
            coded = quant is not None and key[0] in hqq.QUANTIZED_KINDS and name in hqq.PROJECTIONS
            packed += hqq.packed_weight_nbytes(*shape, quant) if coded else nbytes
        coded = quant is not None and key[0] in hqq.QUANTIZED_KINDS
        return packed, (full if coded else 0)

    def hqq_workspace_nbytes(self, key, dtype: torch.dtype, quant) -> int:
        """The temporaries one decode of `key`'s HQQ copy holds (hqq.workspace_nbytes of its
        largest quantized weight); 0 for a group HQQ does not quantize."""
        if quant is None or key[0] not in hqq.QUANTIZED_KINDS:
            return 0
        return max((hqq.workspace_nbytes(*self.store.entries[r.name].span(r.index, r.rows)[2], quant.bits,
                                         quant.group_size, dtype)
                    for name, r in self.spec.group_refs(key).items() if name in hqq.PROJECTIONS), default=0)

    def group_bytes(self, dtype: torch.dtype, quant=None) -> GroupBytes:
        """The planner's sizes of each group kind: the largest group of each kind."""
        sizes: dict = {}
        for key in self.spec.group_keys():
            moved, decoded = self.group_nbytes(key, dtype, quant)
            kind = {"attn": "attention"}.get(key[0], key[0])
            sizes[kind] = max(sizes.get(kind, 0), moved)
            if decoded:
                sizes[f"{kind}_decoded"] = max(sizes.get(f"{kind}_decoded", 0), decoded)
            if key[0] == "expert" and self.spec.shape.expert_format == "mxfp4":  # decode temporaries, one at a time
                from klotski.compress import mxfp4
                work = mxfp4.group_workspace_nbytes(self.spec, self.store, key, dtype)
                sizes["expert_workspace"] = max(sizes.get("expert_workspace", 0), work)
            if key[0] == "expert" and self.is_gguf:
                work = self.expert_codec(dtype).workspace_nbytes(key)
                sizes["expert_workspace"] = max(sizes.get("expert_workspace", 0), work)
            elif decoded and quant is not None and not (key[0] == "expert" and self.spec.shape.expert_format == "mxfp4"):
                # HQQ's decode temporaries, one group at a time
                work = self.hqq_workspace_nbytes(key, dtype, quant)
                sizes[f"{kind}_workspace"] = max(sizes.get(f"{kind}_workspace", 0), work)
        return GroupBytes(**sizes)

    @property
    def is_gguf(self) -> bool:
        return getattr(self.store, "gguf", False)

    def expert_codec(self, dtype: torch.dtype, on_cpu: bool = False):
        """The codec that keeps this checkpoint's experts packed (GGUF blocks, MXFP4), or None;
        `on_cpu`: for compute on a CPU (4-bit GGUF experts then held in torch's int4 form)."""
        if self.is_gguf:
            from klotski.compress.ggml import GgufCodec
            return GgufCodec(self.store, self.spec, dtype, on_cpu=on_cpu)
        if self.spec.shape.expert_format == "mxfp4":
            from klotski.compress.mxfp4 import Mxfp4Codec
            return Mxfp4Codec(self.store, self.spec, dtype)
        return None

    def close(self) -> None:
        self.store.close()


def load_tokenizer(directory: Path, spec: ModelSpec):
    """The checkpoint's tokenizer, or one line saying which files were expected and how to get
    them. (A tokenizer with more tokens than the model has embeddings is not refused: some
    conversions add a few unreachable special tokens; a prompt that uses one fails alone.)"""
    from transformers import AutoTokenizer
    found = [f for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json") if (directory / f).exists()]
    how = ("a Hugging Face checkpoint needs tokenizer.json (or tokenizer.model with the sentencepiece package "
           "installed); copy the tokenizer files from the model's repository into the folder")
    if not {"tokenizer.json", "tokenizer.model"} & set(found):
        raise CheckpointError(f"{directory}: no tokenizer files (found {', '.join(found) or 'none'}); {how}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises many kinds here (ValueError, OSError, JSON errors, ...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{directory}: cannot load the tokenizer ({reason}); {how}") from None
    return tokenizer
