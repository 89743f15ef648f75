"""bf16 weights oneDNN reordered once, for a CPU's products (issue 60): resident SwiGLU experts
and the projections a family reads only through layers.linear (Family.LINEAR_WEIGHTS).

A bf16 product over a plain [N, K] weight on a CPU lets oneDNN reorder the weight into its
blocked layout on every call; a decode step reads each resident expert once, so that reorder
was most of the expert phase (docs/benchmarks.md). Reordered once, at load
(`torch.ops.mkldnn._reorder_linear_weight`), the same product (`_linear_pointwise`) reads the
weight as it lies, bit for bit `F.linear`'s output at every row count (checked once on this
machine, `available`). w1 and w3 are reordered as one [2I, K] matrix, so an expert takes two
products, not three (each output column's sum is the same computation either way).

A resident group's projections are replaced by their reordered form (`reorder_linear`), read
by `linear` (layers.linear and layers.logits call it). A layer's resident experts in this form
are a stack of lists (`pack_expert` makes one expert's row; placement.cache.ExpertStack keeps
them): `w["w13"][g]` and `w["w2"][g]` are expert g's reordered matrices (opaque oneDNN
tensors: nothing else reads them). The bytes are the 16-bit matrices' own: oneDNN's blocks
pad N and K to its block sizes, which divide sizes that are multiples of 64; other sizes stay
plain (`packs`, `reorder_linear`).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

ROWS_HINT = 8  # rows a call is expected to take (a decode step's few tokens an expert): the layout chosen for them
MULTIPLE = 64  # sizes whose blocks need no padding


@functools.cache
def available() -> bool:
    """Whether this torch reorders bf16 weights for oneDNN and its product over them is bit for
    bit F.linear's here (checked once; if not, the weights are held as read, said once)."""
    why = None
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            why = "oneDNN has no bf16 on this CPU"
        elif not _agrees():
            why = "its product differs from F.linear's"
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        why = f"torch {torch.__version__} lacks it ({str(e).splitlines()[0][:120]})"
    if why:
        print(f"klotski: bf16 weights on the CPU are held as read (not reordered for oneDNN): {why}", file=sys.stderr)
    return why is None


def applies(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a run on `device_type` in `dtype` holds its weights in this form: bf16 on a CPU,
    where this torch has it."""
    return device_type == "cpu" and dtype == torch.bfloat16 and available()


def _agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * MULTIPLE, 3 * MULTIPLE, generator=gen).bfloat16()
    packed = reorder(w)
    return all(torch.equal(product(x, packed), F.linear(x, w))
               for x in (torch.randn(rows, w.shape[1], generator=gen).bfloat16() for rows in (1, 5, ROWS_HINT, 33)))


def reorder(w: torch.Tensor) -> torch.Tensor:
    """A [N, K] bf16 weight in oneDNN's layout (an opaque tensor: only `product` reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ROWS_HINT)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [..., K] over w reordered (`reorder`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), whether `weight` is plain or reordered (`reorder_linear`)."""
    if weight.layout == torch.strided:
        return F.linear(x, weight, bias)
    return product(x, weight, bias)


def reorder_linear(names: dict, kind: str, tensors: dict) -> dict:
    """A resident group's tensors with the projections its family reads only through `linear`
    (`names[kind]`: Family.LINEAR_WEIGHTS) reordered where they take the form (bf16 [N, K],
    whole blocks); the rest as they are."""
    return {n: reorder(t) if n in names.get(kind, ()) and _takes(t) else t for n, t in tensors.items()}


def _takes(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.dim() == 2 and t.layout == torch.strided \
        and all(d % MULTIPLE == 0 for d in t.shape)


def packs(tensors: dict) -> bool:
    """Whether an expert's SwiGLU weights (w1, w3 [I, H], w2 [H, I]) take this form: bf16, and
    sizes its blocks hold without padding."""
    return set(tensors) == {"w1", "w2", "w3"} and all(_takes(t) for t in tensors.values())


def pack_expert(tensors: dict) -> dict:
    """One expert's {w1, w3, w2} -> {"w13": w1 and w3 as one matrix, "w2"}, reordered."""
    return {"w13": reorder(torch.cat([tensors["w1"], tensors["w3"]])), "w2": reorder(tensors["w2"])}


def held(w: dict) -> bool:
    """Whether a stack `w` holds its experts reordered (`pack_expert`'s rows)."""
    return "w13" in w and isinstance(w["w13"], list)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x) over one expert's rows x, its matrices reordered (`pack_expert`)."""
    gate, up = product(x, w13).chunk(2, dim=-1)
    return product(F.silu(gate) * up, w2)
