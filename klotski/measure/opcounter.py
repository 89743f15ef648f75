"""Counting the ATen ops a piece of code issues on the calling thread. On a GPU every op that
is not a view is a kernel launch (5-10 µs of host time each), so the count, not the CPU's
seconds, says whether the host or the link bounds a run; a CPU can check it."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as ops: ...`; then `ops.total` (every ATen op), `ops.kernels` (those
    that compute or copy: views and metadata excluded) and `ops.by_name`. Thread-local, as
    torch's dispatch modes are: transfers on the channels' threads are not counted."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()
        self.total = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        if not func.is_view:
            self.kernels += 1
            self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
