"""GGUF (ggml) block types decoded with torch, and the codec that keeps GGUF experts packed.

A quantized GGUF tensor is rows of blocks: each row of `cols` weights is `cols / block`
blocks of `type_size` bytes (a 16-bit scale or two, then the packed codes). Experts stay in
that form on disk, in host memory and on the link (`GgufCodec`), and are decoded on the
compute device right before use, like MXFP4 and HQQ experts; the same code runs on the host.
Each decoder works on all blocks at once (no loop per block) and follows the operation
order of the `gguf` package's numpy decoders, which transformers uses, so the weights come
out bit-identical to what transformers computes with.
"""
from __future__ import annotations

import math

import torch

from klotski.compress import int4, mxfp4
from klotski.models.int4 import SCALES

# ggml type id -> (name, weights a block, bytes a block): the types decoded here
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 8: ("Q8_0", 32, 34),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 39: ("MXFP4", 32, 17)}
BY_NAME = {name: (tid, block, size) for tid, (name, block, size) in TYPES.items()}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# device bytes of temporaries a decode holds per weight beyond its output, at most: the codes
# as uint8 pieces, then as fp32 scaled in place (the output itself in fp32, a temporary before
# the cast to bf16); MXFP4's table lookup takes int32 indices and a [n, 16, 2] fp32 gather
WORKSPACE_PER_WEIGHT = 12


def row_nbytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` weights stored as `qtype`."""
    _, block, size = BY_NAME[qtype]
    return cols // block * size


def dequantize(raw: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw uint8 [..., row bytes] (whole blocks per row) -> [..., cols] in `dtype`, on raw's device."""
    if qtype in FLOAT_TYPES:
        return raw.contiguous().view(FLOAT_TYPES[qtype]).to(dtype)
    _, block, size = BY_NAME[qtype]
    lead, row = raw.shape[:-1], raw.shape[-1]
    blocks = raw.reshape(-1, size)
    out = _DECODERS[qtype](blocks)
    return out.reshape(*lead, row // size * block).to(dtype)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as fp32 [n, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:
    """Low then high nibbles of `qs`, stacked at `dim`."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=dim)


def _q4_0(b):
    n = b.shape[0]
    q = _nibbles(b[:, 2:], 1).reshape(n, 32).float().sub_(8.0)  # element j low nibble, j + 16 high
    return q.mul_(_f16(b, 0))


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def scale_min_k4(scales: torch.Tensor):
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K), as fp32 [n, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def _q4_k(b):
    n = b.shape[0]
    sc, mn = scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32), 2).reshape(n, 8, 32).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)  # (d * q) - dm, each rounded, as gguf computes


def _q5_k(b):
    n = b.shape[0]
    sc, mn = scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32), 2).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # bit i of each high byte: sub-block i
    q = (ql | (qh << 4)).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = _nibbles(b[:, :128].reshape(n, 2, 64), 2).reshape(n, 8, 32)
    # made on the device, not copied there (a host tensor sent up is a sync on every decode)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float().sub_(32.0).reshape(n, 16, 16)
    return q.mul_(d).reshape(n, 256)


def _mxfp4(b):
    """GGUF's MXFP4 block: an E8M0 exponent, then 16 bytes whose low nibbles are weights 0..15
    and high nibbles 16..31; values through mxfp4.py's table (the E2M1 values of each byte)
    times 2^(e - 127), exact in fp32 as ggml's doubled codes times half the scale are."""
    n = b.shape[0]
    table = mxfp4.byte_values(torch.float32, b.device)
    vals = torch.nn.functional.embedding(b[:, 1:].to(torch.int32), table)  # [n, 16, 2]
    scale = b[:, :1].float().sub_(127).exp2_()
    return vals.transpose(1, 2).reshape(n, 32).mul_(scale)  # the reshape copies: in place is safe


_DECODERS = {"Q4_0": _q4_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}


def scale_bytes(qtype: str) -> list[tuple[int, str]]:
    """(byte offset in a block, 'f16' | 'e8m0') of each scale field of `qtype`: what
    `klotski check` reads for non-finite scales."""
    return {"Q4_0": [(0, "f16")], "Q8_0": [(0, "f16")], "Q4_K": [(0, "f16"), (2, "f16")],
            "Q5_K": [(0, "f16"), (2, "f16")], "Q6_K": [(208, "f16")], "MXFP4": [(0, "e8m0")]}.get(qtype, [])


def non_finite_scales(raw: torch.Tensor, qtype: str) -> int:
    """Blocks of raw bytes [.., row bytes] of `qtype` with a NaN or infinite scale."""
    fields = scale_bytes(qtype)
    if not fields:
        return 0
    size = BY_NAME[qtype][2]
    blocks = raw.reshape(-1, size)
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool)
    for at, kind in fields:
        bad |= (~torch.isfinite(_f16(blocks, at))[:, 0]) if kind == "f16" else blocks[:, at] == 255
    return int(bad.sum())


# ---- 4-bit blocks held for torch's CPU int4 kernel (compress/int4.py, issue 60) ----------------
# On a CPU in 16 bits, Q4_0 and Q4_K experts are read into two parts with their blocks' bytes:
# `<w>.<TYPE>@codes`, uint8 [..., N, K/2], the codes in the kernel's layout, and `<w>.<TYPE>@meta`,
# the blocks' scale fields as stored (Q4_0's fp16 scale [..., N, K/32]; Q4_K's 16 bytes of d, dmin
# and 6-bit scales and mins [..., N, K/256, 16]). The per-use decode builds only the kernel's
# [..., K/32, N, 2] scales and zeros: Q4_0's (q - 8)·d with s = d, z = 0; Q4_K's q·(d·sc) - dmin·m
# with s = d·sc, z = 8·s - dmin·m, in fp32 as the decoders above, then in the activation's dtype.
INT4_FORMS = ("Q4_0", "Q4_K")  # block types whose codes and scales the kernel takes as they are
CODES, META = "@codes", "@meta"


def int4_applies(qtype: str, dtype: torch.dtype, rows: int) -> bool:
    """Whether a GGUF matrix of `qtype` with `rows` outputs is held as int4 codes for compute in
    `dtype` on the CPU."""
    return qtype in INT4_FORMS and dtype in (torch.bfloat16, torch.float16) and rows % 16 == 0 and int4.available()


def int4_from_blocks(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks [..., N, row bytes] -> (codes in the kernel's layout, the scale fields as
    stored): the same bytes, split."""
    _, block, size = BY_NAME[qtype]
    *lead, N, row = raw.shape
    b = raw.reshape(*lead, N, row // size, size)
    if qtype == "Q4_0":  # byte j: element j (low nibble), element j + 16 (high)
        qs = b[..., 2:]
        codes = torch.stack((qs & 0x0F, qs >> 4), dim=-2)
        meta = b[..., :2].contiguous().view(torch.float16).squeeze(-1)
    else:  # Q4_K: 4 runs of 32 bytes, each run's low nibbles a sub-block, its high ones the next
        qs = b[..., 16:].reshape(*lead, N, row // size, 4, 32)
        codes = torch.stack((qs & 0x0F, qs >> 4), dim=-2)
        meta = b[..., :16].contiguous()
    return int4.pack_codes(codes.reshape(*lead, N, row // size * block)), meta


def int4_scales_zeros(meta: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's [..., K/32, N, 2] scales and zeros from a matrix's scale fields (int4_from_blocks)."""
    if qtype == "Q4_0":
        return int4.scales_zeros(meta, None, dtype)  # fp16 to `dtype` through fp32, as .float().to() rounds
    *lead, N, supers, _ = meta.shape
    flat = meta.reshape(-1, 16)
    sc, mn = scale_min_k4(flat[:, 4:16])
    s = _f16(flat, 0) * sc  # d·sc and dmin·m, as _q4_k rounds them
    z = (s * 8).sub_(_f16(flat, 2) * mn)
    return int4.scales_zeros(s.reshape(*lead, N, supers * 8), z.reshape(*lead, N, supers * 8), dtype)


def int4_parts(name: str, raw: torch.Tensor, qtype: str) -> dict:
    """A GGUF matrix's parts in the int4 form, named for GgufCodec.decode."""
    codes, meta = int4_from_blocks(raw, qtype)
    return {f"{name}.{qtype}{CODES}": codes, f"{name}.{qtype}{META}": meta}


def int4_decode_part(local: str, qtype: str, t: torch.Tensor, dtype: torch.dtype) -> tuple[str, torch.Tensor] | None:
    """A part of the int4 form as the weights dict holds it (codes as they are, scale fields as
    the kernel's scales and zeros), or None for a part of another form."""
    if qtype.endswith(CODES):
        return local, t
    if qtype.endswith(META):
        return local + SCALES, int4_scales_zeros(t, qtype[:-len(META)], dtype)
    return None


def format_name(block_types) -> str:
    """A GGUF model's expert format as the planner's shape names it: each matrix's block type
    (`GgufCodec.block_types`), e.g. "gguf:w1=Q4_0,w2=Q4_0,w3=Q4_0" (the profile times those)."""
    return "gguf:" + ",".join(f"{name}={qtype}" for name, qtype in sorted(block_types))


def format_types(expert_format: str) -> dict[str, str]:
    """`format_name`'s inverse: {matrix: block type}, empty for a format that is not GGUF's."""
    if not expert_format.startswith("gguf:"):
        return {}
    return dict(item.split("=", 1) for item in expert_format[len("gguf:"):].split(","))


class GgufCodec:
    """The WeightCache's codec for a GGUF checkpoint: expert matrices read, held and moved as
    their GGUF blocks, decoded on the device per use. A packed part is named `<local>.<TYPE>`
    (`w1.Q4_K`), so `decode` knows its type from the parts alone; float parts (an F16 expert
    tensor) are cast to the compute dtype on read and travel as such. A family whose experts
    are laid out otherwise than GGUF's gate/up/down (gpt-oss: gate and up interleaved, transposed)
    has a `join_gguf_expert` that `decode` hands the decoded matrices to."""

    def __init__(self, store, spec, dtype: torch.dtype, on_cpu: bool = False):
        self.store, self.spec, self.dtype = store, spec, dtype
        self.join = getattr(spec.family, "join_gguf_expert", None)
        # computing on a CPU in 16 bits, Q4_0/Q4_K experts are read into torch's int4 form
        # (compress/int4.py): the same bytes, multiplied where they lie instead of decoded per use
        self.int4 = on_cpu and self.join is None and dtype in (torch.bfloat16, torch.float16)

    def covers(self, key) -> bool:
        return key[0] == "expert"

    def _parts(self, key):
        for name, ref in self.spec.group_refs(key).items():
            yield name, ref, self.store.qtype(ref.name)

    def block_types(self, key) -> tuple:
        """The block type of each part: experts stacked together (a pool's rows) must share it."""
        return tuple((name, q) for name, _, q in self._parts(key))

    def packed_nbytes(self, key) -> int:
        return sum(self.store.raw_nbytes(r.name, r.index, r.rows) if q not in FLOAT_TYPES
                   else math.prod(self.store.entries[r.name].span(r.index, r.rows)[2]) * self.dtype.itemsize
                   for _, r, q in self._parts(key))

    def decoded_nbytes(self, key) -> int:
        return sum(math.prod(self.store.entries[r.name].span(r.index, r.rows)[2]) * self.dtype.itemsize
                   for _, r, _ in self._parts(key))

    def workspace_nbytes(self, key) -> int:
        work = max((math.prod(self.store.entries[r.name].span(r.index, r.rows)[2]) * WORKSPACE_PER_WEIGHT
                    for _, r, q in self._parts(key) if q not in FLOAT_TYPES), default=0)
        # joining copies each matrix once beside the decoded parts (gpt-oss: stack, then transpose)
        return max(work, 2 * self.decoded_nbytes(key)) if self.join else work

    def held_as_int4(self, ref, qtype: str) -> bool:
        """Whether the matrix `ref` of `qtype` is read into the int4 form (compress/int4.py)."""
        if not self.int4:
            return False
        rows = self.store.entries[ref.name].span(ref.index, ref.rows)[2][-2]
        return int4_applies(qtype, self.dtype, rows)

    def int4_held(self, key) -> bool:
        """Whether every quantized matrix of `key` is read into the int4 form (the kernel's path)."""
        return all(self.held_as_int4(ref, q) for _, ref, q in self._parts(key) if q not in FLOAT_TYPES)

    def kept_copy(self, key) -> dict:
        """`key` decoded once into the compute dtype, to be kept for the run (a decoded copy as a
        placement choice: WeightCache's `kept`): the blocks decoded as `decode` does per use,
        never the int4 form, so the weights are the per-use path's, bit for bit."""
        out = {}
        for name, ref, qtype in self._parts(key):
            raw = self.store.read(ref.name, ref.index, ref.rows) if qtype in FLOAT_TYPES else \
                self.store.read_raw(ref.name, ref.index, ref.rows)
            out[name] = raw.to(self.dtype) if qtype in FLOAT_TYPES else dequantize(raw, qtype, self.dtype)
        return self.join(out) if self.join else out

    def read(self, key) -> dict:
        out = {}
        for name, ref, qtype in self._parts(key):
            if qtype in FLOAT_TYPES:
                out[name] = self.store.read(ref.name, ref.index, ref.rows).to(self.dtype)
            elif self.held_as_int4(ref, qtype):
                out.update(int4_parts(name, self.store.read_raw(ref.name, ref.index, ref.rows), qtype))
            else:
                out[f"{name}.{qtype}"] = self.store.read_raw(ref.name, ref.index, ref.rows)
        return out

    def decode(self, parts: dict) -> dict:
        out = {}
        for name, t in parts.items():
            local, _, qtype = name.partition(".")
            if "@" in qtype:  # the int4 form: codes as they are, the kernel's scales built
                local, t = int4_decode_part(local, qtype, t, self.dtype)
                out[local] = t
                continue
            out[local] = dequantize(t, qtype, self.dtype) if qtype else t
        return self.join(out) if self.join else out
