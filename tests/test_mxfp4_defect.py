"""MXFP4 decode (issue 37, defect 3): the E2M1 lookup table is built once per (dtype, device),
not uploaded twice per expert per step; the decode's output is bit for bit what the format
says; and the temporaries it takes beside its output stay within what it declares, so a
caller can reserve them."""
import weakref

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from klotski.compress import mxfp4


class TableBuilds(TorchDispatchMode):
    """Counts ATen ops that produce a tensor shaped like the lookup table or its 16 codes (the
    test's shapes are chosen so that no other tensor of a decode is)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += any(isinstance(t, torch.Tensor) and (t.numel() == 16 or tuple(t.shape) == (256, 2))
                          for t in tree_leaves(out))
        return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak: a
    storage counts from the op that allocates it until the last tensor viewing it dies."""

    def __init__(self):
        super().__init__()
        self.refs: dict = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.refs:
                if func.is_view or any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                                       for a in tree_leaves((args, kwargs))):
                    continue  # a view or in-place result of a tensor from outside: not ours
                self.refs[ptr] = [0, storage.nbytes()]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[ptr][0] += 1
            weakref.finalize(t, self._drop, ptr)
        return out

    def _drop(self, ptr):
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.refs[ptr]


def packed(rows, cols, seed=0):
    """Random blocks (every byte value) and scales over every finite exponent (0..254)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (rows, cols // 32), dtype=torch.uint8, generator=g)
    scales.view(-1)[:3] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    return blocks, scales


def from_the_format(blocks, scales, dtype):
    """The weight as the MXFP4 format defines it, computed independently of the module: per byte
    the low nibble first, E2M1 = sign, 2-bit exponent (bias 1), 1-bit mantissa (exponent 0: 0.5·m),
    times 2^(scale - 127); out-dim major stored, transposed for `x @ W`. In float64 (exact), then
    cast (every value is representable in fp32 and bf16, or overflows alike)."""
    rows, groups, _ = blocks.shape
    b = blocks.long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(rows, groups, 32)
    sign = 1.0 - 2.0 * (codes >> 3).double()
    e, m = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).double()) * (1.0 + 0.5 * m))
    w = sign * mag * torch.exp2(scales.double() - 127)[..., None]
    return w.reshape(rows, groups * 32).t().contiguous().to(dtype)


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slab", ["one", "many"])
def test_decode_is_the_format_bit_for_bit(monkeypatch, dtype, slab):
    """Signed zeros, subnormal and overflowing scales included; decoded in one slab and in
    slabs of one group (a tiny workspace), alike."""
    if slab == "many":
        monkeypatch.setattr(mxfp4, "WORKSPACE_BYTES", 1)
    blocks, scales = packed(40, 160)
    out = mxfp4.dequantize(blocks, scales, dtype)
    assert out.shape == (160, 40) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(bits(out), bits(from_the_format(blocks, scales, dtype)))


def test_the_lookup_table_is_built_once_per_dtype_and_device():
    """Several decodes (several experts, both matrices) build the table once per dtype."""
    mxfp4.byte_values.cache_clear()
    parts = {}
    for m, (rows, cols) in zip(mxfp4.MATRICES, [(6, 96), (10, 64)]):  # no 16-element tensor but the table's
        parts[f"{m}_blocks"], parts[f"{m}_scales"] = packed(rows, cols)
    codec = mxfp4.Mxfp4Codec(None, None, torch.float32)
    with TableBuilds() as first:
        codec.decode(parts)
    with TableBuilds() as later:
        for _ in range(4):
            codec.decode(parts)
    assert first.count > 0  # the counter sees a table being built at all
    assert later.count == 0
    with TableBuilds() as other:
        for _ in range(3):
            mxfp4.dequantize(parts["down_blocks"], parts["down_scales"], torch.bfloat16)
    assert other.count == first.count
    assert mxfp4.byte_values.cache_info().currsize == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols, cap", [(64, 256, None), (256, 512, 1 << 16), (96, 2048, 1)])
def test_decode_temporaries_stay_within_its_workspace(monkeypatch, dtype, rows, cols, cap):
    """Every byte allocated while decoding, beyond the output, within `workspace_nbytes`; slabs
    keep it well under the whole matrix's codes and values."""
    if cap is not None:
        monkeypatch.setattr(mxfp4, "WORKSPACE_BYTES", cap)
    blocks, scales = packed(rows, cols)
    mxfp4.byte_values(dtype, blocks.device)  # the table is built once, before: not a decode's temporary
    with LiveBytes() as live:
        out = mxfp4.dequantize(blocks, scales, dtype)
    output = out.numel() * out.element_size()
    assert live.now == output  # every temporary freed
    work = mxfp4.workspace_nbytes(rows, cols, dtype)
    assert output < live.peak <= output + work
    if cap is not None:
        assert work < rows * cols * (2 + dtype.itemsize) // 2


def test_an_experts_decode_stays_within_what_the_codec_declares(tmp_path):
    """On a gpt-oss checkpoint: decoding one expert allocates its decoded copy (what the cache
    reserves for it) and, while it runs, no more than the codec's `workspace_nbytes`."""
    from klotski.builtin.families import build_family, pack_mxfp4
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(pack_mxfp4(build_family(tmp_path / "fp32", "gpt_oss"), tmp_path / "mxfp4")))
    codec = mxfp4.Mxfp4Codec(ckpt.store, ckpt.spec, torch.float32)
    key = ("expert", 1, 3)
    parts = codec.read(key)
    biases = sum(t.numel() * t.element_size() for n, t in parts.items() if n not in mxfp4.PACKED_PARTS)
    mxfp4.byte_values(torch.float32, torch.device("cpu"))
    with LiveBytes() as live:
        w = codec.decode(parts)
    assert live.now == codec.decoded_nbytes(key) - biases == sum(w[m].numel() * 4 for m in mxfp4.MATRICES)
    assert live.now < live.peak <= live.now + codec.workspace_nbytes(key)
    spec = ckpt.spec
    assert codec.workspace_nbytes(key) == mxfp4.workspace_nbytes(2 * spec.shape.intermediate_size, spec.shape.hidden_size,
                                                                  torch.float32)
    ckpt.close()


def test_a_decode_runs_inside_its_reserved_workspace(tmp_path, monkeypatch):
    """The weight cache reserves the codec's temporaries for the length of a decode: the
    device account during every MXFP4 decode covers what was in use before plus them. Each
    codec decode is matched to the cache decode it runs inside (a decode that took another
    path, or ran outside one, fails here rather than leave nothing to compare)."""
    from conftest import requests
    from klotski.assemble import open_engine
    from klotski.builtin.families import build_family, pack_mxfp4
    from klotski.compress.mxfp4 import Mxfp4Codec
    from klotski.config import RunConfig
    mx = pack_mxfp4(build_family(tmp_path / "fp32", "gpt_oss"), tmp_path / "mxfp4")
    before, during = [], []  # (account, workspace) as each cache decode starts; (its index, account) in each codec one
    decode = Mxfp4Codec.decode
    monkeypatch.setattr(Mxfp4Codec, "decode",
                        lambda self, parts: during.append((len(before) - 1, engine.memory.used)) or decode(self, parts))
    # the per-use decode (a CPU run keeps MXFP4 experts decoded once unless told not to)
    engine, seqs, _ = open_engine(RunConfig(model=str(mx), progress=False, dtype="float32", decoded_copies="off"),
                                  requests(["x"], 1))
    cache_decode = engine.cache.decode

    def watched(key):
        before.append((engine.memory.used, engine.cache.workspace[key]))
        return cache_decode(key)
    engine.cache.decode = watched
    list(engine.run(seqs))
    engine.close()
    assert before and all(w > 0 for _, w in before)
    assert [i for i, _ in during] == list(range(len(before))), "codec decodes and the cache's do not pair up"
    for i, used in during:
        b, w = before[i]
        assert used >= b + w, (i, used, b, w)
