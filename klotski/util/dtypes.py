"""Dtypes, written once: the names weights are computed and built in, their torch dtypes, and
the safetensors code and size of every dtype a checkpoint may hold (placement.store's table,
as the reader of safetensors headers it is the one that must know them all).

Only the names are read at import time: klotski.config lists them, and parsing a command line
does not load torch. The torch tables are made on first use.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NAMES = ("float32", "bfloat16", "float16")  # what --dtype and config.json's torch_dtype may name
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # also taken by tiny.build_checkpoint


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """{name: torch dtype} for NAMES, in that order."""
    import torch
    return {name: getattr(torch, name) for name in NAMES}


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse(dtype) -> torch.dtype:
    """One of the NAMES dtypes, given as itself, its name, "torch.<name>" or an alias (bf16, ...)."""
    import torch
    table = torch_dtypes()
    if isinstance(dtype, torch.dtype):
        if dtype not in table.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in table and name not in ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted([*NAMES, *ALIASES])}")
    return table[ALIASES.get(name, name)]


@functools.cache
def _safetensors_codes() -> dict[torch.dtype, str]:
    from placement.store import SAFETENSORS_DTYPES
    return {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_code(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "BF16", the dtype as a safetensors header writes it."""
    return _safetensors_codes()[dtype]


def safetensors_itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code ("BF16" -> 2)."""
    from placement.store import SAFETENSORS_DTYPES
    return SAFETENSORS_DTYPES[code].itemsize
