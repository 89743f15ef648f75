"""One layer's shared prompt segments (klotski/schedule/prefix.py) for a step: each segment's
keys and values read once for the whole group (on the host tier, loaded once on `kv_load`),
joined side by side for each batch that reads them."""
from __future__ import annotations

import torch


def joined(parts: list) -> tuple:
    """Segments' (keys, values) [kv_heads, length, dim] side by side: one segment as it is."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)


class SharedLayer:
    """One layer's shared-segment keys/values for a step, by segment: `get(layout)` waits for
    a host load once (timed as bubble) and joins a batch's segments; `release()` gives the
    room back (to `memory`) after the layer's attention."""

    def __init__(self, res, memory, tensors, ticket=None, nbytes: int = 0, name: str = ""):
        self.res, self.memory = res, memory
        self.tensors, self.ticket, self.nbytes, self.name = tensors, ticket, nbytes, name

    def get(self, layout: list):
        if self.tensors is None and self.ticket is not None:
            self.tensors = self.res.wait(self.ticket, self.name)
        return joined([self.tensors[id(p)] for p in layout])

    def release(self) -> None:
        if self.ticket is not None:
            self.res.wait(self.ticket, self.name)  # no copy into the room is still running
            self.tensors, self.ticket = None, None
            self.memory.free(self.nbytes)
