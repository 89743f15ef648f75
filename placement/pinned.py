"""Page-locked host memory in exact amounts, for everything that crosses the host->device link.

torch's `pin_memory()` takes its blocks from a caching allocator that rounds every request up
to a power of two, so a host tier of pinned copies could hold up to twice the bytes the host
budget counted. Here each group (or KV tensor) gets one block of its own size, an anonymous
mapping (whole pages of its own, so no page is registered twice, and the tensor's storage
starts where the locked range does), page-locked with `cudaHostRegister`; the host budget is
charged exactly what the block takes (`charge`: its bytes rounded up to whole pages). A
channel's staging ring (execute/staging.StagedCopies) is such a block too (`buffer`).
Blocks are unregistered by `close`, after every copy that reads them has finished.

With `pinned=False` the blocks are plain memory of the same layout (what the CPU tests
check); the CPU engine does not use them: its host tier is ordinary tensors.
"""
from __future__ import annotations

import mmap

import torch

PAGE = mmap.PAGESIZE
_SLOT = 64  # alignment of each tensor inside a block


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def charge(nbytes: int) -> int:
    """Host bytes a block holding `nbytes` takes."""
    return _up(max(nbytes, 1), PAGE)


def group_nbytes(tensors) -> int:
    """Bytes a block holding these tensors needs (each at a 64-byte boundary)."""
    return sum(_up(t.numel() * t.element_size(), _SLOT) for t in tensors)


class PinnedBlocks:
    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._blocks: list[torch.Tensor] = []

    def _block(self, nbytes: int) -> torch.Tensor:
        span = charge(nbytes)
        block = torch.frombuffer(mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                                 dtype=torch.uint8)
        if self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), span, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {span} bytes failed (error {int(err)}); "
                                   "the system may limit locked memory (ulimit -l)")
        self._blocks.append(block)
        return block

    def copy(self, tensors: dict) -> dict:
        """One block holding copies of every tensor of a group."""
        block = self._block(group_nbytes(tensors.values()))
        out, at = {}, 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            out[name] = block[at:at + n].view(t.dtype).view(t.shape)
            out[name].copy_(t)
            at += _up(n, _SLOT)
        return out

    def buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` bytes of a block of their own (a channel's staging ring), charged `charge(nbytes)`."""
        return self._block(nbytes)[:nbytes]

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = _numel(shape) * dtype.itemsize
        return self._block(n)[:n].zero_().view(dtype).view(shape)

    def close(self) -> None:
        """Unlock every block (the caller makes sure no copy still reads one)."""
        if self.pinned:
            for block in self._blocks:
                torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
        self._blocks.clear()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
