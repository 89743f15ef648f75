"""`--quantize hqq4`: the quantized copy of a checkpoint and the codec the WeightCache uses.

Attention and expert groups are quantized once into the offload directory (or the user
cache), with a manifest naming the method and the source checkpoint; a later run reuses
the copy while the manifest matches. What sits on host/disk and crosses the links is the
packed form; the device dequantizes just before use (timed as compute by the pipeline).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from klotski.compress import hqq as quant
from klotski.compress.hqq import QUANTIZED_KINDS
from klotski.util import dtypes


def label(key) -> str:
    return ".".join(str(p) for p in key)


class QuantCodec:
    """`on_cpu`: compute is on a CPU, where 4-bit weights in 16-bit runs are read into torch's int4
    form (compress/int4.py: the same bytes, multiplied where they lie instead of decoded per use)."""

    def __init__(self, directory: Path, dtype, on_cpu: bool = False):
        from safetensors import safe_open
        self.directory, self.dtype = Path(directory), dtype
        self.int4 = on_cpu and dtype in (torch.bfloat16, torch.float16)
        self._packed: dict[str, int] = {}
        self._headers: dict[str, list] = {}  # a group's quantized weights' header shapes
        with safe_open(self.directory / quant.WEIGHTS_FILE, framework="pt") as f:
            for name in f.keys():
                group = name.split("/", 1)[0]
                sl = f.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                self._packed[group] = self._packed.get(group, 0) + numel * dtypes.safetensors_itemsize(sl.get_dtype())
                if name.endswith(".header"):
                    self._headers.setdefault(group, []).append(tuple(sl.get_shape()))

    def covers(self, key) -> bool:
        return key[0] in QUANTIZED_KINDS

    def packed_nbytes(self, key) -> int:
        return self._packed[label(key)]

    def workspace_nbytes(self, key) -> int:
        """Device bytes a decode of `key` holds beyond its output (the WeightCache reserves them)."""
        return quant.group_workspace_nbytes(self._headers.get(label(key), ()), self.dtype)

    def read(self, key) -> dict:
        parts = quant.load_quantized(self.directory, label(key))
        if self.int4:
            from klotski.compress import int4
            for name in [k[:-len(".header")] for k in parts if k.endswith(".header")]:
                if int4.hqq_applies(parts[f"{name}.header"].shape, self.dtype):
                    mine = {p: parts.pop(f"{name}.{p}") for p in quant.PARTS if f"{name}.{p}" in parts}
                    codes, rest = int4.from_hqq(mine)
                    parts.update({f"{name}.{p}": t for p, t in rest.items()})
                    parts[f"{name}.{int4.HQQ_CODES}"] = codes
        return parts

    def int4_held(self, key) -> bool:
        """Whether every quantized weight of `key` is read into the int4 form (the kernel's path)."""
        if not self.int4:
            return False
        from klotski.compress import int4
        return all(int4.hqq_applies(h, self.dtype) for h in self._headers.get(label(key), ()))

    def kept_copy(self, key) -> dict:
        """`key` dequantized once, to be kept for the run (WeightCache's `kept`): as the per-use
        decode of its stored parts computes it, never the int4 form."""
        return quant.dequantize_group(quant.load_quantized(self.directory, label(key)), self.dtype)

    def decode(self, parts: dict) -> dict:
        from klotski.compress import int4
        held = [k[:-len(int4.HQQ_CODES) - 1] for k in parts if k.endswith("." + int4.HQQ_CODES)]
        if not held:
            return quant.dequantize_group(parts, self.dtype)
        from klotski.models.int4 import SCALES
        parts, out = dict(parts), {}
        for name in held:  # codes as they are, the kernel's scales and zeros built from the rest
            out[name] = parts.pop(f"{name}.{int4.HQQ_CODES}")
            rest = {p: parts.pop(f"{name}.{p}") for p in quant.PARTS if f"{name}.{p}" in parts}
            out[name + SCALES] = int4.hqq_scales_zeros(rest, self.dtype)
        out.update(quant.dequantize_group(parts, self.dtype))
        return out


def copy_path(ckpt, dtype, offload_dir: str | None, optimize: bool) -> tuple[Path, "quant.QuantSpec", str]:
    """Where the quantized copy of `ckpt` lives: `offload_dir`, or the user cache."""
    from klotski.util import cachedir
    qspec = quant.QuantSpec(optimize=optimize)
    dtype_name = dtypes.name_of(dtype)  # unquantized parts are kept in the compute dtype
    out = Path(offload_dir) if offload_dir else cachedir.quantized_copy(ckpt.key, f"{qspec.tag()}-{dtype_name}")
    return out, qspec, dtype_name


def _room_needed(ckpt, dtype, qspec) -> int:
    """Disk bytes that building the copy needs: the packed groups twice, as the streaming
    writer stages tensor bytes beside the file it assembles."""
    packed = sum(ckpt.group_nbytes(k, dtype, qspec)[0] for k in ckpt.spec.group_keys() if k[0] in QUANTIZED_KINDS)
    return 2 * packed + (1 << 20)


def check_room(ckpt, dtype, offload_dir: str | None, *, optimize: bool = False) -> None:
    """Refuse, before the output exists, a quantized copy that is not there and cannot fit, or of
    a checkpoint already quantized (GGUF: requantizing its blocks would only lose precision)."""
    from klotski.util.writes import require_space
    if getattr(ckpt, "is_gguf", False):
        from klotski.errors import ConfigError
        raise ConfigError(f"{ckpt.directory}: a GGUF checkpoint is quantized already (its experts stay in their "
                          "GGUF blocks on every tier); HQQ 4-bit (--quantize hqq4) applies to 16-bit checkpoints")
    out, qspec, dtype_name = copy_path(ckpt, dtype, offload_dir, optimize)
    if not quant.manifest_matches(out, ckpt.directory, qspec, dtype_name):
        require_space(out.parent, _room_needed(ckpt, dtype, qspec), "the HQQ 4-bit copy of the model",
                      "free some space or pass --offload-dir on a bigger disk")


def ensure_quantized(ckpt, dtype, offload_dir: str | None, *, optimize: bool = False) -> Path:
    """The quantized copy of checkpoint `ckpt` (a klotski.io.checkpoint.Checkpoint), built on
    first use in `offload_dir` or the user cache."""
    from klotski.util.writes import writing
    out, qspec, dtype_name = copy_path(ckpt, dtype, offload_dir, optimize)
    if not quant.manifest_matches(out, ckpt.directory, qspec, dtype_name):
        print(f"klotski: quantizing attention and experts with HQQ ({qspec.tag()}) into {out} (first use)",
              file=sys.stderr)
        store, spec = ckpt.store, ckpt.spec
        groups = ((label(k), {n: store.read(r.name, r.index, r.rows).to(dtype) for n, r in spec.group_refs(k).items()})
                  for k in spec.group_keys() if k[0] in QUANTIZED_KINDS)
        with writing(out, "the HQQ 4-bit copy of the model", need=_room_needed(ckpt, dtype, qspec),
                     then="the partial copy was removed; free some space or pass --offload-dir on a bigger disk, "
                          "then rerun the same command"):
            quant.quantize_checkpoint(ckpt.directory, out, qspec, groups, dtype=dtype_name)
    return out
