"""Writing safetensors files one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once (and a copy): 25 GB for a
4-bit Mixtral-8x7B, more than RAM for the biggest built-in model. The format puts a header
listing every tensor's offsets before the data, so a streaming writer must know every shape
first. When the caller does (`planned`), the header is written at once and each tensor goes
straight after it; when shapes are only known as tensors arrive, their bytes are staged in a
side file and appended after the header at the end: one extra sequential copy.

File layout: the header's length (8 bytes, little-endian), the JSON header (compact,
"__metadata__" first, then the tensors in file order) padded with spaces so the data starts
8-byte aligned, then the raw bytes of the tensors.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch

from klotski.util import dtypes


class SafetensorsWriter:
    """`add` tensors in file order, then `finish`; only the tensor being added is in memory.

    `planned`: [(name, dtype, shape)] of every tensor, in the order they will be added."""

    def __init__(self, path: str | Path, metadata: dict[str, str],
                 planned: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None):
        self.path = Path(path)
        self.metadata = metadata
        self.header: dict[str, dict] = {}
        self.offset = 0  # bytes of tensor data listed in the header so far
        self.planned = planned
        if planned is None:
            self.staging: Path | None = self.path.with_suffix(".data")
            self.file = open(self.staging, "wb")
        else:
            self.staging = None
            for name, dtype, shape in planned:
                self._list(name, dtype, shape)
            self.added = 0
            self.file = open(self.path, "wb")
            self.file.write(self._header_bytes())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()  # on success already closed by finish()
        if exc[0] is not None and self.staging is not None:
            self.staging.unlink(missing_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if self.planned is None:
            self._list(name, t.dtype, t.shape)
        else:
            want, dtype, shape = self.planned[self.added]
            if (name, t.dtype, tuple(t.shape)) != (want, dtype, tuple(shape)):
                raise AssertionError(f"{name}: built {tuple(t.shape)} {t.dtype}, "
                                     f"planned {want} {tuple(shape)} {dtype}")
            self.added += 1
        self.file.write(t.reshape(-1).view(torch.uint8).numpy().data)

    def finish(self, *, sync: bool = False) -> int:
        """Complete the file (flushed to the disk with `sync`); returns the bytes of tensor data."""
        if self.planned is not None:
            if self.added != len(self.planned):
                raise AssertionError(f"{self.path}: {self.added} of {len(self.planned)} planned tensors written")
            _close(self.file, sync)
            return self.offset
        self.file.close()
        with open(self.path, "wb") as f, open(self.staging, "rb") as src:
            f.write(self._header_bytes())
            shutil.copyfileobj(src, f, 16 << 20)
            _close(f, sync)
        self.staging.unlink()
        return self.offset

    def _list(self, name: str, dtype: torch.dtype, shape) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        self.header[name] = {"dtype": dtypes.safetensors_code(dtype), "shape": list(shape),
                             "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes

    def _header_bytes(self) -> bytes:
        blob = json.dumps({"__metadata__": self.metadata, **self.header}, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob


def _close(f, sync: bool) -> None:
    if sync:
        f.flush()
        os.fsync(f.fileno())
    f.close()
