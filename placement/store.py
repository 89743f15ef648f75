"""TensorStore: lazy, tensor-by-tensor reads from a safetensors checkpoint.

We parse the safetensors headers ourselves (an 8-byte length, a JSON header, then raw
bytes) instead of going through `safe_open`, because the pipeline needs byte offsets: to
read one expert out of a fused `[E, 2I, H]` tensor, to read with O_DIRECT into aligned
buffers so that a model bigger than RAM does not thrash the page cache, and to validate a
truncated shard before generation starts rather than halfway through a night's run.

Every read starts at a 64-byte boundary (`TENSOR_ALIGN`), wherever the tensor lies in its
file: a CPU's matmul kernels give other last bits for a weight that starts elsewhere, and the
same weights must give the same bits whichever tier they were read for.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# every dtype a checkpoint may hold, by its safetensors code: the one table of those codes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
_ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block size
TENSOR_ALIGN = 64  # where every read tensor starts (torch's own CPU allocations do too)


class CheckpointError(Exception):
    """A checkpoint problem, stated in one line with the file and tensor concerned."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor in `file`
    nbytes: int

    def span(self, index: int | None = None, rows: tuple[int, int] | None = None):
        """(offset, nbytes, shape) of `self[index][rows[0]:rows[1]]`; both along leading dims."""
        shape, offset = self.shape, self.offset
        item = torch.empty((), dtype=self.dtype).element_size()
        if index is not None:
            shape = shape[1:]
            offset += index * _numel(shape) * item
        if rows is not None:
            row = _numel(shape[1:]) * item
            offset += rows[0] * row
            shape = (rows[1] - rows[0],) + shape[1:]
        return offset, _numel(shape) * item, shape


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: file is truncated (no safetensors header); re-download it")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} bytes); re-download it")
            header = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(header), 8 + n
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON); re-download it") from None


class TensorStore:
    """All tensors of a checkpoint directory, read on demand.

    `direct=True` reads with O_DIRECT where the filesystem allows it (falls back to buffered
    reads otherwise, e.g. on tmpfs). `entries`: the tensors by name, where a store of another
    format (klotski/io/gguf.py) indexed its files itself; else the safetensors shards of
    `directory` are indexed here."""

    def __init__(self, directory: str | Path, *, direct: bool = False, entries: dict | None = None):
        self.directory = Path(directory)
        self.direct = direct
        self._fds: dict[tuple[Path, bool], int] = {}
        self.entries: dict[str, TensorEntry] = {}
        if entries is not None:
            self.entries.update(entries)
            return
        for file in self._shard_files():
            self._index_file(file)

    def _shard_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise CheckpointError(f"{index}: not a valid safetensors index (needs a weight_map)") from None
            files = sorted({self.directory / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{f}: shard listed in {index.name} is missing; download it again")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files; is this a Hugging Face checkpoint?")
        return files

    def _index_file(self, file: Path) -> None:
        header, data_start = _read_header(file)
        size = file.stat().st_size
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {meta.get('dtype')!r}")
            begin, end = meta["data_offsets"]
            if data_start + end > size:
                raise CheckpointError(
                    f"{file}: truncated — tensor {name} ends at byte {data_start + end} but the file has {size}; "
                    "re-download this shard")
            entry = TensorEntry(file, dtype, tuple(meta["shape"]), data_start + begin, end - begin)
            if entry.nbytes != _numel(entry.shape) * torch.empty((), dtype=dtype).element_size():
                raise CheckpointError(f"{file}: tensor {name} size does not match its shape; corrupt file")
            self.entries[name] = entry

    # ---- reads --------------------------------------------------------------------------
    def names(self) -> set[str]:
        return set(self.entries)

    def nbytes(self, name: str, index: int | None = None, rows=None) -> int:
        return self.entries[name].span(index, rows)[1]

    def read(self, name: str, index: int | None = None, rows=None) -> torch.Tensor:
        """A fresh CPU tensor with the bytes of `name[index][rows]`."""
        entry = self._entry(name)
        offset, nbytes, shape = entry.span(index, rows)
        return self._pread(entry.file, offset, nbytes).view(entry.dtype).view(shape)

    def read_ref(self, ref) -> torch.Tensor:
        """`read` of a ref (.name/.index/.rows); an FP8 weight with a `.scale` tensor comes back
        as the values it stands for (fp32): dequantized on load, so every tier holds the
        compute dtype and nothing downstream knows the checkpoint was FP8."""
        t = self.read(ref.name, ref.index, ref.rows)
        scale = getattr(ref, "scale", None)
        return t if scale is None else dequantize_blocks(t, self.read(scale), ref.block)

    def read_flat(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of `name` in storage order, as a 1-D CPU tensor: for
        scanning a tensor of any shape in pieces of bounded size."""
        entry = self._entry(name)
        item = entry.dtype.itemsize
        return self._pread(entry.file, entry.offset + start * item, count * item).view(entry.dtype)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} not found in the checkpoint") from None

    def _fd(self, file: Path, direct: bool) -> int:
        key = (file, direct)
        if key not in self._fds:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
            self._fds[key] = os.open(file, flags)
        return self._fds[key]

    def _pread(self, file: Path, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of `file`, as uint8 starting at a TENSOR_ALIGN boundary."""
        if self.direct and nbytes and hasattr(os, "O_DIRECT"):
            try:
                return self._pread_direct(file, offset, nbytes)
            except OSError:
                self.direct = False  # filesystem refuses O_DIRECT (tmpfs, some overlays)
        buf = torch.empty(nbytes, dtype=torch.uint8)  # starts at a TENSOR_ALIGN boundary
        got = os.preadv(self._fd(file, False), [buf.numpy()], offset)
        if got != nbytes:
            raise CheckpointError(f"{file}: short read at byte {offset}; the file changed or is truncated")
        return buf

    def _pread_direct(self, file: Path, offset: int, nbytes: int):
        start = offset - offset % _ALIGN
        end = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        # Private anonymous memory: page-aligned, as O_DIRECT needs. Huge pages (where the kernel
        # allows them on request) cut the page faults of filling GBs of fresh buffers per step.
        buf = mmap.mmap(-1, end - start, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        got = os.preadv(self._fd(file, True), [buf], start)
        if got < offset + nbytes - start:
            raise CheckpointError(f"{file}: short read at byte {offset}; the file changed or is truncated")
        at = offset - start
        if at % TENSOR_ALIGN:  # moved down to the boundary below, in place: no second buffer
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            ctypes.memmove(base + at - at % TENSOR_ALIGN, base + at, nbytes)
            at -= at % TENSOR_ALIGN
        return torch.frombuffer(memoryview(buf)[at: at + nbytes], dtype=torch.uint8)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ---- validation ---------------------------------------------------------------------
    def validate(self, expected: dict) -> None:
        """`expected` maps refs (with .name/.index/.rows) to shapes; raise on the first problem."""
        for ref, shape in expected.items():
            entry = self._entry(ref.name)
            try:
                got = entry.span(ref.index, ref.rows)[2]
            except IndexError:
                got = None
            where = ref.name + (f"[{ref.index}]" if ref.index is not None else "")
            if ref.index is not None and (len(entry.shape) < 1 or ref.index >= entry.shape[0]):
                raise CheckpointError(f"{entry.file}: tensor {ref.name} has shape {list(entry.shape)}, "
                                      f"too small for index {ref.index}; config.json and weights disagree")
            if got != tuple(shape):
                raise CheckpointError(f"{entry.file}: tensor {where} has shape {list(got or entry.shape)}, "
                                      f"expected {list(shape)} from config.json; config and weights disagree")
            if getattr(ref, "scale", None):
                want = [-(-n // b) for n, b in zip(shape, ref.block)]
                scale = self._entry(ref.scale)
                if list(scale.shape) != want:
                    raise CheckpointError(f"{scale.file}: tensor {ref.scale} has shape {list(scale.shape)}, expected "
                                          f"{want} (blocks of {list(ref.block)} from quantization_config."
                                          "weight_block_size); config and weights disagree")



def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """Block-quantized weight [out, in] (float8) times its scale [ceil(out/bo), ceil(in/bi)],
    each scale covering one bo x bi block (the last ones cut at the edge), in fp32."""
    bo, bi = block
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * scale
