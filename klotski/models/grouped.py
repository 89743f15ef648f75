"""Many experts in one call: a grouped matmul over experts whose weights are stacked along a
first dimension, each taking a contiguous run of rows. A layer's expert phase issues a handful
of kernels whatever the number of experts (a fine-grained model routes a step to 100+), where
one call per expert cost ~8 kernels and a Python round each.

`torch._grouped_mm` computes it where the device and dtype have it (on a CPU in fp32 and
bf16, bit for bit the per-expert products; on CUDA bf16 on Hopper and Blackwell); elsewhere, at
torch versions without it, and for fp32 on a GPU, the fallback is one product per non-empty
group (the per-expert math, exact, and the host counts say where each group's rows are). The
choice is made once per device and dtype: a call the kernel refuses marks that pair as
unsupported (running out of memory, or a device error, is raised as it is).

A whole wave of SwiGLU experts in fp32 on a CPU goes another way (`wave_runner`, issue 60):
torch._grouped_mm on a CPU loops over its groups, a dispatch and ~1.5-3 µs each, and a decode
step of a 128-expert layer has ~110 groups of ~2 rows, so that was most of the layer. Where
torch's own libtorch_cpu carries MKL (its x86 builds), MKL's `sgemm_batch` takes every group's
product in one call (`BatchedGemm`): a wave's pointers are worked out once, its calls reuse
one set of buffers, and each group's product is bit for bit the per-group op at one thread
(checked once, when first wanted; groups of one row go in a BLAS call of their own, where MKL
computes them as the matrix-vector product `F.linear` does). Without MKL, or where the check
fails, the wave goes call by call as above."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from klotski.models import int4, prepacked
from klotski.models import layers as L

_SUPPORTED: dict = {}  # (device type, dtype) -> whether torch._grouped_mm runs there
_BATCHED: dict = {}    # (device type, dtype) -> False where the batched per-group products are switched off
_CPU_FP32 = ("cpu", torch.float32)
_DEVICE_ERRORS = tuple(e for e in (getattr(torch, "AcceleratorError", None),) if e is not None)


@dataclass
class Groups:
    """Rows x[offsets[g-1]:offsets[g]] belong to group g (its weights w[g]): `offsets` on the
    device as int32 cumulative ends (the grouped kernel's), `counts` on the host (the fallback's
    slices) or None where they were counted on the device (a wave launched before the routing
    ids reached the host). Rows past the last offset belong to no group: their outputs are
    undefined (the caller overwrites them)."""
    counts: list[int] | None
    offsets: torch.Tensor

    def host_counts(self) -> list[int]:
        """`counts`, read from the device if only the offsets exist (a sync: only where a device
        and dtype turned out to lack the grouped kernel after a wave had been launched for it)."""
        if self.counts is None:
            self.counts = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1)).tolist()
        return self.counts

    def row_group(self, rows: int) -> torch.Tensor:
        """Each of `rows` rows' group (to gather per-group biases), found on the offsets' device
        (the number of ends at or before the row; a row past the last group takes the last): no
        upload, no sync."""
        at = torch.arange(rows, device=self.offsets.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets, at, right=True).clamp_(max=len(self.offsets) - 1)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """x [rows, K] @ w[g] [K, N] for each group's rows -> [rows, N] (gpt-oss stores [in, out])."""
    return _grouped(x, w, groups, lambda part, g: torch.mm(part, w[g]))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """F.linear per group: w [G, out, in] as a checkpoint stores linear weights."""
    return _grouped(x, w.transpose(1, 2), groups, lambda part, g: F.linear(part, w[g]))


def runs_grouped(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the grouped kernel computes for this device and dtype (as probed, or as expected
    before the first call): the offsets alone then say where each group's rows are."""
    key = (device_type, dtype)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _expected(device_type, dtype)
    return _SUPPORTED[key]


def _expected(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type != "cuda":
        return True
    # On CUDA torch's own kernel takes bf16 on compute capability 9.x and 10.x (Hopper, Blackwell;
    # torch 2.10-2.11); elsewhere its fallback copies the offsets to the host, a sync per call:
    # the per-group path here does with the host's counts. fp32 stays on the per-expert ops: a
    # grouped kernel may take TF32 or another summation order, and fp32 is where output must be
    # transformers' token for token.
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10)


def _grouped(x, w_kn, groups: Groups, per_group) -> torch.Tensor:
    """The grouped kernel where it runs; else `per_group` (the per-expert op itself, so the
    fallback is the per-expert path bit for bit) over each non-empty group."""
    key = (x.device.type, x.dtype)
    if runs_grouped(*key):
        try:
            return torch._grouped_mm(x, w_kn, offs=groups.offsets)
        except (torch.OutOfMemoryError, *_DEVICE_ERRORS):
            raise  # the device's trouble, not the kernel's: never a reason to leave it
        except (RuntimeError, NotImplementedError, TypeError):
            _SUPPORTED[key] = False
    return each_group(x, groups.host_counts(), w_kn.shape[-1], per_group)


def force_fallback(device_type: str, dtype: torch.dtype, fallback: bool = True) -> None:
    """Use the per-group fallback, one op a group, in waves too (True), or choose again as at
    the start (False: the grouped kernel; MKL's batch for fp32 SwiGLU waves on a CPU), for tests."""
    if fallback:
        _SUPPORTED[(device_type, dtype)] = False
        _BATCHED[(device_type, dtype)] = False
    else:
        _SUPPORTED.pop((device_type, dtype), None)
        _BATCHED.pop((device_type, dtype), None)


def cpu_kernel(dtype: torch.dtype = torch.float32) -> str:
    """What a CPU wave of SwiGLU experts runs in `dtype`: "batched" (BatchedGemm's wave),
    "grouped" (torch._grouped_mm a call) or "per-group" (an op a group)."""
    if dtype == torch.float32 and _BATCHED.get(("cpu", dtype), True) and batched_gemm() is not None:
        return "batched"
    return "grouped" if runs_grouped("cpu", dtype) else "per-group"


def grouped_swiglu(x: torch.Tensor, w: dict, groups: Groups) -> torch.Tensor:
    """SwiGLU experts (layers.swiglu) over their groups of rows: w2(silu(w1 x) * w3 x)."""
    if prepacked.held(w):  # reordered once for oneDNN (a CPU's bf16 resident experts): a call pair an expert
        return each_group(x, groups.host_counts(), x.shape[-1],
                          lambda part, g: prepacked.swiglu(part, w["w13"][g], w["w2"][g]))
    if int4.held(w, "w1"):  # torch's int4 kernel takes one weight a call: one SwiGLU an expert
        return each_group(x, groups.host_counts(), x.shape[-1],
                          lambda part, g: L.swiglu(part, {n: t[g] for n, t in w.items()}))
    return grouped_linear(F.silu(grouped_linear(x, w["w1"], groups)) * grouped_linear(x, w["w3"], groups),
                          w["w2"], groups)


def stack_form(ffn, device_type: str, dtype: torch.dtype):
    """The form a layer's resident experts are held in for `ffn` (placement.cache.ExpertStack):
    SwiGLU experts in bf16 on a CPU reordered for oneDNN (models/prepacked.py) where this torch
    has it; None: stacked tensors."""
    if ffn is grouped_swiglu and prepacked.applies(device_type, dtype):
        return prepacked
    return None


def each_group(x: torch.Tensor, counts: list[int], width: int, per_group) -> torch.Tensor:
    """`per_group(rows, g)` over each non-empty group's rows of x (counts[g] of them), outputs
    `width` wide in row order; rows in no group (past the counts' total) come out as zeros (the
    grouped kernel leaves them undefined: the caller overwrites them)."""
    total = sum(counts)
    parts = [per_group(part, g) for g, part in enumerate(x[:total].split(counts)) if len(part)]
    if total < len(x):
        parts.append(x.new_zeros(len(x) - total, width))
    if not parts:
        return x.new_empty(0, width)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# ---- many small fp32 products in one call on a CPU: MKL's sgemm_batch --------------------------
_UNSET = object()
_BATCH = _UNSET


def batched_gemm() -> "BatchedGemm | None":
    """The batched products, once found and checked (None where they are not to be used)."""
    global _BATCH
    if _BATCH is _UNSET:
        _BATCH = BatchedGemm.load()
    return _BATCH


def wave_runner(ffn, x: torch.Tensor, w: dict):
    """A whole wave of `ffn` at once where BatchedGemm runs it (the SwiGLU experts, fp32 on a
    CPU, not switched off by force_fallback, its tensors laid out for BLAS): `run(x, counts,
    calls, tokens, order, weights, flat)` (BatchedGemm.swiglu_wave), else None (the wave goes
    call by call through `ffn`)."""
    key = (x.device.type, x.dtype)
    if ffn is not grouped_swiglu or key != _CPU_FP32 or not _BATCHED.get(key, True):
        return None
    batch = batched_gemm()
    if batch is None or not batch.fits(x, w["w1"], w["w3"], w["w2"]):
        return None
    return lambda *args: batch.swiglu_wave(w, *args)


class BatchedGemm:
    """MKL's `sgemm_batch` from torch's own libtorch_cpu (present in its x86 builds, whose
    matmuls are MKL's): groups of rows of x, each times its own weight, in one call without a
    dispatch per group. Column-major as BLAS sees it: each group's outputs C (N x rows) =
    op(W) (N x K) · X (K x rows), X being the group's rows of x and C its rows of the output
    (both row-major with a row stride), W the group's weight ([K, N] row-major: 'N'; [N, K]
    row-major, a linear layer's: 'T')."""

    def __init__(self, fn):
        self.fn = fn
        self._size = 0
        self._kept = []  # every set of shared arguments made: a call on another thread may still read one
        self._grow(256)

    @classmethod
    def load(cls) -> "BatchedGemm | None":
        if os.environ.get("KLOTSKI_NO_BATCHED_GEMM"):
            return None
        try:
            if not torch.backends.mkl.is_available():
                return None
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            fn = lib.SGEMM_BATCH  # the Fortran interface, 32-bit integers (MKL's LP64, as torch links it)
        except (OSError, AttributeError):
            return None
        fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 15
        batch = cls(fn)
        return batch if batch.agrees() else None

    def _grow(self, size: int) -> None:
        """The arguments every product of a call shares (BLAS takes one per product), for calls
        of up to `size` products: alpha 1, beta 0, groups of one, the layouts, the sizes."""
        keep = {"one": np.ones(size, np.float32), "zero": np.zeros(size, np.float32),
                "groups": np.ones(size, np.int32), "N": np.full(size, ord("N"), np.uint8),
                "T": np.full(size, ord("T"), np.uint8)}
        self._kept.append(keep)
        self._addr = {k: a.ctypes.data for k, a in keep.items()}
        self._ints = {}
        self._size = size

    def _int(self, value: int) -> int:
        """Address of `size` copies of an int32 value."""
        addr = self._ints.get(value)
        if addr is None:
            arr = np.full(self._size, value, np.int32)
            self._kept.append(arr)
            addr = self._ints[value] = arr.ctypes.data
        return addr

    @staticmethod
    def fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """x [rows, K] and each stack of weights as BLAS reads them: x's rows contiguous, each
        weight a row-major matrix either way round, fp32 on the CPU, no autograd, every size
        within BLAS's 32-bit integers."""
        if x.dim() != 2 or x.stride(1) != 1 or x.requires_grad or x.stride(0) >= 2 ** 31:
            return False
        for w in weights:
            if w.dtype != torch.float32 or w.dim() != 3 or w.device.type != "cpu" or w.requires_grad:
                return False
            if not (w.is_contiguous() or w.transpose(1, 2).is_contiguous()) or w.shape[1] * w.shape[2] >= 2 ** 31:
                return False
        return True

    def swiglu_wave(self, w: dict, x: torch.Tensor, counts: np.ndarray, calls: list, tokens: torch.Tensor,
                    order: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor) -> None:
        """A wave of SwiGLU experts (w's stacks, `counts` pairs each in the order of their rows)
        over its pairs (`tokens`: rows of x; `order`: slots of `flat`; `weights`: router
        weights), call by call (`calls`: row ranges, as experts.call_rows cuts them), each
        call's outputs times their router weight into their slots. What LayerExperts does a
        call at a time through grouped_swiglu's per-group fallback, the same products of the
        same rows and the same activation over each call's rows (so its bits, as `agrees`
        checks), but every call's pointers worked out at once, one buffer of each kind for all
        calls, and no op a group: a call is an index_select, one BLAS call per set of pieces
        (several rows; one row) for w1 and w3 side by side and one for w2, the activation, the
        router weight and an index_copy_."""
        w1, w3, w2 = w["w1"].transpose(1, 2), w["w3"].transpose(1, 2), w["w2"].transpose(1, 2)
        K, inter, H = w1.shape[1], w1.shape[2], w2.shape[2]
        counts = np.asarray(counts, dtype=np.int64)
        ends = counts.cumsum()
        if not len(calls) or ends[-1] == 0:
            return
        call_starts = np.fromiter((a for a, _ in calls), dtype=np.int64, count=len(calls))
        call_stops = np.fromiter((b for _, b in calls), dtype=np.int64, count=len(calls))
        # the pieces: every group's rows cut where calls are cut (both partition 0..total)
        bounds = np.union1d(np.concatenate(([0], ends)), call_stops)
        lo, length = bounds[:-1], np.diff(bounds)
        group = np.searchsorted(ends, lo, side="right")
        call = np.searchsorted(call_stops, lo, side="right")
        offset = lo - call_starts[call]
        # per call, its pieces of several rows, then those of one: a block each
        block = 2 * call + (length == 1)
        ranked = np.argsort(block, kind="stable")
        group, offset, length, block = group[ranked], offset[ranked], length[ranked], block[ranked]
        per_block = np.bincount(block, minlength=2 * len(calls))
        first = per_block.cumsum() - per_block
        step = int((call_stops - call_starts).max())
        xs, up = x.new_empty(step, K), x.new_empty(2, step, inter)
        hidden, ys = x.new_empty(step, inter), x.new_empty(step, H)
        item = x.element_size()
        P = len(group)
        # up: each block's w1 products then its w3 products, side by side in one BLAS call
        at = np.arange(P) - first[block]
        pos1 = 2 * first[block] + at
        pos3 = pos1 + per_block[block]
        up_ptrs = np.empty((3, 2 * P), dtype=np.int64)
        up_ptrs[0, pos1] = w1.data_ptr() + group * (w1.stride(0) * item)
        up_ptrs[0, pos3] = w3.data_ptr() + group * (w3.stride(0) * item)
        up_ptrs[1, pos1] = up_ptrs[1, pos3] = xs.data_ptr() + offset * (xs.stride(0) * item)
        up_ptrs[2, pos1] = up.data_ptr() + offset * (up.stride(1) * item)
        up_ptrs[2, pos3] = up_ptrs[2, pos1] + up.stride(0) * item
        up_rows = np.empty(2 * P, dtype=np.int32)
        up_rows[pos1] = up_rows[pos3] = length
        down_ptrs = np.empty((3, P), dtype=np.int64)
        down_ptrs[0] = w2.data_ptr() + group * (w2.stride(0) * item)
        down_ptrs[1] = hidden.data_ptr() + offset * (hidden.stride(0) * item)
        down_ptrs[2] = ys.data_ptr() + offset * (ys.stride(0) * item)
        down_rows = length.astype(np.int32)
        if 2 * P > self._size:
            self._grow(2 * P)
        t_up = ("N", w1.stride(1)) if w1.stride(2) == 1 else ("T", w1.stride(2))
        t_down = ("N", w2.stride(1)) if w2.stride(2) == 1 else ("T", w2.stride(2))
        fits_up = w3.stride() == w1.stride()
        up_at, up_row, rows_up = up_ptrs.ctypes.data, 8 * 2 * P, up_rows.ctypes.data
        down_at, down_row, rows_down = down_ptrs.ctypes.data, 8 * P, down_rows.ctypes.data
        first, per_block = first.tolist(), per_block.tolist()
        for c, (start, stop) in enumerate(calls):
            n = stop - start
            torch.index_select(x, 0, tokens[start:stop], out=xs[:n])
            for b in (2 * c, 2 * c + 1):
                g = per_block[b]
                if not g:
                    continue
                f = first[b]
                if fits_up:
                    self._call(t_up, inter, K, rows_up + 8 * f, up_at + 16 * f, up_row, K, up.stride(1), 2 * g)
                else:  # w1's and w3's strides differ: one call each (their halves of the block)
                    self._call(t_up, inter, K, rows_up + 8 * f, up_at + 16 * f, up_row, K, up.stride(1), g)
                    self._call(t_up, inter, K, rows_up + 8 * f + 4 * g, up_at + 16 * f + 8 * g, up_row, K,
                               up.stride(1), g)
            a = up[0, :n]
            torch.mul(F.silu(a, inplace=True), up[1, :n], out=hidden[:n])
            for b in (2 * c, 2 * c + 1):
                g = per_block[b]
                if g:
                    f = first[b]
                    self._call(t_down, H, inter, rows_down + 4 * f, down_at + 8 * f, down_row, inter, H, g)
            flat.index_copy_(0, order[start:stop], ys[:n] * weights[start:stop, None])

    def _wave_agrees(self, w: dict, counts: list, K: int, gen: torch.Generator) -> bool:
        """swiglu_wave against grouped_swiglu's per-group ops call by call: tokens drawn from
        fewer rows than pairs, calls cut within groups too, slots in a shuffled order."""
        total = sum(counts)
        x = torch.randn(total // 2 + 1, K, generator=gen)
        tokens = torch.randint(0, len(x), (total,), generator=gen)
        order = torch.randperm(total, generator=gen)
        weights = torch.rand(total, generator=gen)
        calls = [(0, 9), (9, 10), (10, 31), (31, total)]
        ends = np.cumsum(counts)
        want = x.new_zeros(total, w["w2"].shape[1])
        for start, stop in calls:
            part = (np.clip(ends, start, stop) - np.clip(ends - np.asarray(counts), start, stop)).tolist()
            xs = x.index_select(0, tokens[start:stop])
            pieces = [(i, p) for i, p in enumerate(xs.split(part)) if len(p)]
            hidden = F.silu(torch.cat([F.linear(p, w["w1"][i]) for i, p in pieces])) * \
                torch.cat([F.linear(p, w["w3"][i]) for i, p in pieces])
            parts = [(i, p) for i, p in enumerate(hidden.split(part)) if len(p)]
            y = torch.cat([F.linear(p, w["w2"][i]) for i, p in parts])
            want.index_copy_(0, order[start:stop], y * weights[start:stop, None])
        got = torch.full_like(want, float("nan"))
        self.swiglu_wave(w, x, np.asarray(counts), calls, tokens, order, weights, got)
        return torch.equal(got, want)

    def _call(self, layout: tuple, N: int, K: int, rows_at: int, ptrs_at: int, row: int, ldb: int, ldc: int,
              count: int) -> None:
        """One sgemm_batch over `count` products whose rows (int32) start at `rows_at` and
        whose W, X and C pointers start at `ptrs_at`, `row` bytes apart."""
        trans, lda = layout
        groups = ctypes.c_int32(count)
        self.fn(self._addr[trans], self._addr["N"], self._int(N), rows_at, self._int(K), self._addr["one"],
                ptrs_at, self._int(lda), ptrs_at + row, self._int(ldb), self._addr["zero"], ptrs_at + 2 * row,
                self._int(ldc), ctypes.addressof(groups), self._addr["groups"])

    def agrees(self) -> bool:
        """Whether a wave gives each group the bits of the per-group ops at one thread (what
        grouped_swiglu's fallback computes call by call), at two shapes, with the weights in
        both layouts BLAS is given (linear weights as stored, and as a transposed view), groups
        of 1 to 40 rows (and none) mixed in a call: checked once, as this MKL computes them."""
        before = torch.get_num_threads()
        g = torch.Generator().manual_seed(0)
        try:
            torch.set_num_threads(1)
            for K, N in ((64, 96), (200, 72)):
                counts = [3, 1, 0, 2, 7, 1, 40, 5, 4, 1]
                w = {n: torch.randn(len(counts), *shape, generator=g) for n, shape in
                     (("w1", (N, K)), ("w3", (N, K)), ("w2", (K, N)))}
                flipped = {n: t.transpose(1, 2).contiguous().transpose(1, 2) for n, t in w.items()}
                if not (self._wave_agrees(w, counts, K, g) and self._wave_agrees(flipped, counts, K, g)):
                    return False
            return True
        except Exception:  # any failure of a foreign call: not used
            return False
        finally:
            torch.set_num_threads(before)
