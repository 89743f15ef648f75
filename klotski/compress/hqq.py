"""HQQ weight quantization for the tensors that move: expert and attention projections.

With `--quantize hqq4` the engine stores and moves the *quantized* form of a tensor group
and dequantizes on the compute device just before use, so the links carry ~3.75x fewer
bytes than bf16. The arithmetic is the `hqq` package's (`Quantizer.quantize/dequantize`);
this module only lays the result out as plain tensors (safetensors-able, `.to(device)`-able)
and writes/reads quantized checkpoints.

Layout of one quantized 2-D weight `W` (rows x cols), the "parts" dict:

    q        packed integer codes of W, grouped by `group_size` consecutive weights of a row
    scale_q  the per-group scales, themselves 8-bit codes in groups of `meta_group_size`
    scale_s, scale_z   fp32 scale/zero of those codes (one per meta group)
    zero_q, zero_s, zero_z   the same for the per-group zero points
             (with meta_group_size=None, as 8-bit weights need: fp32 `scale` and `zero`)
    header   an empty tensor: shape (0, bits, group_size, meta_group_size, rows, cols) and
             dtype = W's dtype. The integers live in a *shape* so they travel with
             save/load/.to(device) for free and reading them never syncs a GPU stream.

Rows whose length is not a multiple of `group_size` are padded by repeating their last
value (keeps that group's min/max, hence its error), and the group count is padded to a
multiple of 8 because hqq packs sub-byte codes along the group axis.

`optimize` defaults to False (plain min/max rounding). Measured on this machine (2 cores,
one torch thread, shared with other jobs), 4-bit g64 with scales/zeros 8-bit g128:

    1024x3584 bf16, std 0.02   plain: rel. error ||W-Ŵ||/||W|| 0.0898 in 0.05 s
                               HQQ optimize: 0.0862 in 1.8 s  (37x slower, 4% less error)
    4096x14336 (Mixtral expert) plain: 0.0902 in 0.9 s;  optimize: 0.0866 in 51 s
    Student-t(3) weights       plain 0.132, optimize 0.124 (6% less: outliers are its case)

The half-quadratic step minimises an l_0.7 error, which helps most on heavy-tailed real
weights, but a Mixtral-8x7B (~790 such matrices) then takes ~7-11 h here instead of ~12
min, for an error change far smaller than one bit buys (3-bit: 0.192, 8-bit: 0.0055).
So: round by default; `--quantize-optimize` for users who quantize once and keep it.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable

import torch

from klotski.util.safetensors import SafetensorsWriter
from klotski.util.writes import replacing

FORMAT = 1
WEIGHTS_FILE = "quantized.safetensors"
MANIFEST_FILE = "manifest.json"
META_BITS = 8  # scales/zeros are stored as 8-bit codes, as in HQQ's own quant_scale/quant_zero
_GROUP_ALIGN = 8  # 1-bit codes pack 8 groups per byte row; 2- and 4-bit need 4 and 2
PARTS = ("q", "scale", "scale_q", "scale_s", "scale_z", "zero", "zero_q", "zero_s", "zero_z", "header")
_BITS = (1, 2, 3, 4, 8)  # hqq packs 5/6 bits as full bytes: no saving, so not offered


@dataclass(frozen=True)
class QuantSpec:
    """The paper's preset: 4 bits, group 64, scales/zeros quantized with group 128."""
    bits: int = 4
    group_size: int = 64
    meta_group_size: int | None = 128  # None: keep scales/zeros in fp32
    optimize: bool = False

    def __post_init__(self):
        if self.bits not in _BITS:
            raise ValueError(f"quantization bits must be one of {_BITS}, not {self.bits}")
        if self.group_size < 1 or (self.meta_group_size is not None and self.meta_group_size < 1):
            raise ValueError("quantization group sizes must be positive")
        if self.bits >= META_BITS and self.meta_group_size is not None:
            # (q - z)·s spans 2^bits codes: 8-bit scales/zeros would add errors of the
            # order of a whole code step (measured: rel. error 0.040 instead of 0.005).
            raise ValueError(f"{self.bits}-bit weights need full-precision scales/zeros: "
                             "use meta_group_size=None")

    def tag(self) -> str:
        """E.g. "hqq4-g64-m128" (+ "-opt"): names the checkpoint directory and the report."""
        meta = f"-m{self.meta_group_size}" if self.meta_group_size else ""
        return f"hqq{self.bits}-g{self.group_size}{meta}" + ("-opt" if self.optimize else "")

    @classmethod
    def from_tag(cls, tag: str, *, optimize: bool | None = None) -> "QuantSpec":
        """Parse `hqq4`, `hqq8`, `hqq4-g128`, `hqq4-g64-m128-opt`, …; omitted fields take
        the preset (for 8 bits, unquantized scales/zeros)."""
        m = re.fullmatch(r"hqq(\d)(?:-g(\d+))?(?:-m(\d+))?(-opt)?", tag)
        if not m:
            raise ValueError(f"unknown quantization {tag!r}; expected e.g. hqq4 or hqq4-g64-m128")
        bits = int(m[1])
        meta = int(m[3]) if m[3] else (cls.meta_group_size if bits < META_BITS else None)
        return cls(bits=bits, group_size=int(m[2] or cls.group_size), meta_group_size=meta,
                   optimize=bool(m[4]) if optimize is None else optimize)


def spec_for(config) -> QuantSpec | None:
    """The quantization a run's config asks for (`--quantize hqq4`, `--quantize-optimize`), or None."""
    return QuantSpec(optimize=config.quantize_optimize) if config.quantize == "hqq4" else None


# ---- one tensor ---------------------------------------------------------------------------
def _hqq():
    # Imported on first use: hqq adds ~1 s to start-up, and most runs do not quantize.
    from hqq.core.quantize import Quantizer
    return Quantizer


def quantize_tensor(w: torch.Tensor, spec: QuantSpec = QuantSpec()) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight into plain tensors (see the module docstring for the layout)."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"can only quantize 2-D float weights, got {tuple(w.shape)} {w.dtype}")
    rows, cols = w.shape
    gs = spec.group_size
    W = w.detach().float()
    if cols % gs:
        W = torch.cat([W, W[:, -1:].expand(rows, -cols % gs)], dim=1)
    groups = _pad_rows(W.reshape(-1, gs), _GROUP_ALIGN)
    q, meta = _hqq().quantize(groups, nbits=spec.bits, channel_wise=True, group_size=gs,
                                 optimize=spec.optimize, round_zero=False, axis=1, bitpack=True,
                                 device=str(w.device))
    parts = {"q": q}
    for key in ("scale", "zero"):
        if spec.meta_group_size:
            parts[f"{key}_q"], parts[f"{key}_s"], parts[f"{key}_z"] = _quantize_meta(meta[key], spec.meta_group_size)
        else:
            parts[key] = meta[key].float()
    parts["header"] = torch.empty((0, spec.bits, gs, spec.meta_group_size or 0, rows, cols),
                                  dtype=w.dtype, device=w.device)
    return parts


def dequantize_tensor(parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild the weight on the device `parts` are on, in `dtype` (default: the source dtype).
    Parts stacked along leading dimensions (experts of one layer, each part [n, ...]) give the
    weights stacked the same way, each bit for bit what it gives alone.

    Up to 4 bits the arithmetic runs in `dtype`, as HQQ does: for bf16 on this CPU it is
    ~3x faster than fp32 (3 vs 9.5 ms per 1024x3584, one thread), error 0.0897 → 0.0898.
    8-bit codes run in fp32: bf16 cannot hold a zero point in [0, 255] to within one code
    step (rel. error 0.0071 instead of 0.0053)."""
    header = parts["header"]
    lead = header.shape[:-6]
    _, bits, gs, _, rows, cols = header.shape[-6:]
    dtype = dtype or header.dtype
    work = dtype if bits < META_BITS else torch.float32
    groups = _padded_groups(rows, cols, gs)
    n = math.prod(lead)
    Quantizer = _hqq()
    # hqq's unpacking works down the first dimension of a [packed groups, gs] matrix, column by
    # column: the stacked experts go side by side in its columns and come back out after
    q = parts["q"].reshape(n, *parts["q"].shape[-2:])
    codes = Quantizer.unpack[Quantizer.bit_to_packing[bits]](q.transpose(0, 1).reshape(q.shape[1], -1), dtype=work)
    codes = codes[:groups].view(groups, n, gs).transpose(0, 1)  # 3 bits: 10 codes an int32, padded
    meta = {}
    for key in ("scale", "zero"):
        v = parts[key] if key in parts else \
            _dequantize_meta(parts[f"{key}_q"], parts[f"{key}_s"], parts[f"{key}_z"], groups)
        meta[key] = v.reshape(n, groups, 1).to(work)
    # hqq's Quantizer.dequantize, (codes - zero) * scale, over every expert at once; in place on the
    # codes (a fresh tensor), so a stacked decode holds no temporaries beyond them (workspace_nbytes
    # bounds what it does hold: the codes' copies while they unpack, and the output's layout copy)
    W = codes.sub_(meta["zero"]).mul_(meta["scale"])
    W = W[:, : rows * -(-cols // gs)].reshape(n, rows, -1)[:, :, :cols]
    return W.reshape(*lead, rows, cols).to(dtype).contiguous()


def _layout(parts: dict[str, torch.Tensor]):
    header = parts["header"]
    lead = header.shape[:-6]
    _, bits, gs, _, rows, cols = header.shape[-6:]
    return lead, bits, gs, rows, cols, _padded_groups(rows, cols, gs), math.prod(lead)


def codes_of(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A weight's codes as uint8 [..., rows, cols], for compute that takes codes as they are
    (compress/int4.py): widths that are whole groups only."""
    lead, bits, gs, rows, cols, groups, n = _layout(parts)
    Quantizer = _hqq()
    q = parts["q"].reshape(n, *parts["q"].shape[-2:])  # unpacked side by side, as dequantize_tensor does
    codes = Quantizer.unpack[Quantizer.bit_to_packing[bits]](q.transpose(0, 1).reshape(q.shape[1], -1),
                                                             dtype=torch.uint8)
    return codes[:groups].view(groups, n, gs).transpose(0, 1)[:, :rows * cols // gs].reshape(*lead, rows, cols)


def scales_and_zeros_of(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's per-group scales and zeros as fp32 [..., rows, cols/gs] (each weight being
    (code - zero)·scale), from its parts less its codes: widths that are whole groups only."""
    lead, _, gs, rows, cols, groups, n = _layout(parts)
    out = []
    for key in ("scale", "zero"):
        v = parts[key] if key in parts else \
            _dequantize_meta(parts[f"{key}_q"], parts[f"{key}_s"], parts[f"{key}_z"], groups)
        out.append(v.reshape(n, groups)[:, :rows * cols // gs].float().reshape(*lead, rows, cols // gs))
    return out[0], out[1]


def workspace_nbytes(rows: int, cols: int, bits: int, gs: int, dtype: torch.dtype, experts: int = 1) -> int:
    """Device bytes `dequantize_tensor` holds beyond its output while it decodes a rows x cols
    weight (`experts` of them stacked), at most: the packed codes laid side by side and hqq's
    two shifted copies of them while it unpacks, the unpacked codes in the working dtype, the
    scales and zeros, and a copy in the working dtype for each step between the codes' layout
    and the output's that is not a view (8-bit codes: the conversion to `dtype`; a width not a
    multiple of gs: the cut of its padding). Measured against a count of every storage the
    decode makes (tests/test_quant.py)."""
    groups = _padded_groups(rows, cols, gs)
    work = dtype.itemsize if bits < META_BITS else 4
    packed = -(-groups // 10) * gs * 4 if bits == 3 else groups * gs * bits // 8
    meta = groups * (2 * work + 2 * 4)  # scale and zero, and their fp32 decode from 8-bit codes
    copies = (work != dtype.itemsize) + (cols % gs != 0)
    return experts * (3 * packed + groups * gs * work + meta + copies * rows * -(-cols // gs) * gs * work)


def group_workspace_nbytes(headers, dtype: torch.dtype) -> int:
    """`dequantize_group`'s temporaries: its weights decode one after another (each one's
    output is the group's decoded copy), so the largest weight's `workspace_nbytes`. `headers`:
    each quantized weight's header shape (..., bits, gs, ., rows, cols)."""
    return max((workspace_nbytes(h[-2], h[-1], h[-5], h[-4], dtype) for h in headers), default=0)


def packed_weight_nbytes(rows: int, cols: int, spec: QuantSpec = QuantSpec()) -> int:
    """Bytes of `quantize_tensor`'s parts for a rows x cols weight, without quantizing it: what
    the planner sizes a quantized group by before the copy exists."""
    gs, mgs = spec.group_size, spec.meta_group_size
    groups = _padded_groups(rows, cols, gs)
    codes = -(-groups // 10) * gs * 4 if spec.bits == 3 else groups * gs * spec.bits // 8  # 3 bits: 10 per int32
    if mgs:
        meta_groups = -(-groups // mgs)
        return codes + 2 * (meta_groups * mgs + 2 * 4 * meta_groups)  # 8-bit codes + fp32 scale, zero
    return codes + 2 * 4 * groups  # fp32 scale and zero per group


def packed_nbytes(parts: dict[str, torch.Tensor]) -> int:
    """Bytes stored and moved for a parts dict or a whole quantized group."""
    return sum(t.numel() * t.element_size() for t in parts.values())


def _padded_groups(rows: int, cols: int, gs: int) -> int:
    n = rows * -(-cols // gs)
    return n + (-n % _GROUP_ALIGN)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Append copies of the last row: padding never widens any group's min/max."""
    extra = -x.shape[0] % multiple
    return torch.cat([x, x[-1:].expand(extra, *x.shape[1:])]) if extra else x


def _quantize_meta(v: torch.Tensor, mgs: int):
    flat = _pad_rows(v.reshape(-1, 1), mgs).reshape(-1, mgs)
    q, meta = _hqq().quantize(flat, nbits=META_BITS, channel_wise=True, group_size=mgs,
                                 optimize=False, round_zero=False, axis=1, bitpack=True,
                                 device=str(v.device))
    return q, meta["scale"].float(), meta["zero"].float()


def _dequantize_meta(q, s, z, count: int) -> torch.Tensor:
    meta = {"nbits": META_BITS, "group_size": q.shape[-1], "axis": 1, "shape": tuple(q.shape),
            "packing": "8bit_u8", "view_as_float": False, "unpack_view_dtype": torch.uint8,
            "compute_dtype": torch.float32, "scale": s, "zero": z}
    return _hqq().dequantize(q, meta).reshape(*q.shape[:-2], -1, 1)[..., :count, :]


# ---- tensor groups ------------------------------------------------------------------------
# Group-local names (ModelSpec.group_refs: the same in every family, whatever the tensor is
# called on disk). An allow-list: norms, biases, routers, shared experts, embeddings and
# lm_head are small or precision-critical, and anything we do not recognise is safer left alone.
PROJECTIONS = {"q", "k", "v", "o", "w1", "w2", "w3"}
QUANTIZED_KINDS = ("attn", "expert")  # the group kinds whose projections are quantized


def should_quantize(name: str, tensor: torch.Tensor) -> bool:
    """True for 2-D expert and attention projection weights, by group-local name."""
    return tensor.ndim == 2 and tensor.is_floating_point() and name in PROJECTIONS


def quantize_group(tensors: dict[str, torch.Tensor], spec: QuantSpec = QuantSpec()) -> dict[str, torch.Tensor]:
    """{name: tensor} → flat {f"{name}.{part}": part} for projections; the rest as {name: tensor}."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if should_quantize(name, t):
            out.update({f"{name}.{part}": p for part, p in quantize_tensor(t, spec).items()})
        else:
            out[name] = t
    return out


def dequantize_group(parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_group`: {name: tensor}; pass-through tensors are returned as is."""
    quantized = {k[: -len(".header")] for k in parts if k.endswith(".header")}
    grouped: dict[str, dict[str, torch.Tensor]] = {name: {} for name in quantized}
    out: dict[str, torch.Tensor] = {}
    for key, t in parts.items():
        name, _, part = key.rpartition(".")
        if name in quantized and part in PARTS:
            grouped[name][part] = t
        else:
            out[key] = t
    for name, p in grouped.items():
        out[name] = dequantize_tensor(p, dtype)
    return out


# ---- quantized checkpoints ----------------------------------------------------------------
def source_hash(src_dir: str | Path) -> str:
    """Identity of a checkpoint without reading its weights: every shard's name, size and
    safetensors header (names, dtypes, shapes, offsets). A moved copy hashes the same."""
    files = sorted(Path(src_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src_dir}: no *.safetensors files to quantize")
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            header = fh.read(struct.unpack("<Q", raw)[0]) if len(raw) == 8 else b""
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode() + header)
    return h.hexdigest()


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, spec: QuantSpec,
                        groups: Iterable[tuple[str, dict[str, torch.Tensor]]], *, dtype: str | None = None) -> Path:
    """Quantize every (label, {name: tensor}) group into `out_dir`.

    Writes `quantized.safetensors` (keys f"{label}/{name}.{part}", or f"{label}/{name}" for
    pass-through tensors) and `manifest.json`. Groups are written as they come, so memory
    stays at one group however big the model. Everything is built in a sibling temp
    directory and renamed into place: a crash never leaves a checkpoint that looks whole."""
    out = Path(out_dir)
    digest = source_hash(src_dir)  # before the long part: a missing source fails at once
    with replacing(out) as tmp:  # (a killed run's temporary is removed there first: as big as the checkpoint)
        tmp.mkdir()
        labels = set()
        with SafetensorsWriter(tmp / WEIGHTS_FILE, {"klotski_format": str(FORMAT), "tag": spec.tag()}) as writer:
            for label, group in groups:
                if "/" in label or label in labels:
                    raise ValueError(f"group label {label!r} is repeated or contains '/'")
                labels.add(label)
                for key, t in quantize_group(group, spec).items():
                    writer.add(f"{label}/{key}", t)
            nbytes = writer.finish(sync=True)
        manifest = {"klotski_format": FORMAT, "method": "hqq", "bits": spec.bits,
                    "group_size": spec.group_size, "meta_group_size": spec.meta_group_size,
                    "optimize": spec.optimize, "source": str(Path(src_dir).resolve()),
                    "source_hash": digest, "hqq_version": _hqq_version(),
                    "groups": len(labels), "bytes": nbytes, "dtype": dtype}
        (tmp / MANIFEST_FILE).write_bytes(json.dumps(manifest, indent=1).encode())
    return out


def load_quantized(out_dir: str | Path, label: str) -> dict[str, torch.Tensor]:
    """The flat parts of one group (the form `dequantize_group` takes), read lazily."""
    from safetensors import safe_open
    prefix = label + "/"
    with safe_open(str(Path(out_dir) / WEIGHTS_FILE), framework="pt") as f:
        parts = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    if not parts:
        raise KeyError(f"{out_dir}: no group {label!r} in the quantized checkpoint")
    return parts


def read_manifest(out_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(out_dir) / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def manifest_matches(out_dir: str | Path, src_dir: str | Path, spec: QuantSpec, dtype: str | None = None) -> bool:
    """Whether `out_dir` holds a complete quantization of `src_dir` with `spec` (made from
    weights in `dtype`, when given: the dtype its unquantized parts are stored in)."""
    m = read_manifest(out_dir)
    if not m or not (Path(out_dir) / WEIGHTS_FILE).is_file():
        return False
    wanted = {"klotski_format": FORMAT, "method": "hqq", "bits": spec.bits, "group_size": spec.group_size,
              "meta_group_size": spec.meta_group_size, "optimize": spec.optimize}
    if dtype is not None:
        wanted["dtype"] = dtype
    if any(m.get(k) != v for k, v in wanted.items()):
        return False
    try:
        return m.get("source_hash") == source_hash(src_dir)
    except FileNotFoundError:
        return False


def _hqq_version() -> str:
    try:
        return version("hqq")
    except PackageNotFoundError:
        return "unknown"
