"""The executor's caches: KV caches made, charged to their tier's budget, and given back.

A `KVSpace` is one accounting group of per-batch caches (a run's rows, a newcomer batch, the
rows of shared prompt segments): each cache is charged to the KV tier's budget when it is made
(on the device, room is made first, so the allocator never holds more than the accounts) and
given back by `free` or, for whatever is left, by `close`. The scheduler asks for caches by
their shape (rows, slots) and hands them back; what a cache holds, and how its bytes are
counted, is decided here, from the model's shape: one kind today, attention keys and values
per layer (`BatchKV`; MLA's latent and rotary key are its keys and values of other widths).
"""
from __future__ import annotations

from klotski.execute.kvcache import BatchKV
from placement import pinned
from placement.pinned import PinnedBlocks


class KVSpace:
    """Caches on one tier (`on_host`), charged to `account`; `make_room(nbytes, what)` frees
    device bytes first (the pipeline's transient weights), `drain()` waits for the KV loads
    issued ahead (the kv_load channel); `staging`: the ring a host cache's strided slots are
    gathered into on their way up (the kv_load channel's, on CUDA)."""

    def __init__(self, shape, dtype, device, *, on_host: bool, account, make_room, drain, staging=None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.on_host, self.account = on_host, account
        self.make_room, self.drain, self.staging = make_room, drain, staging
        self.held: dict[int, tuple[int, PinnedBlocks | None, BatchKV]] = {}  # id(kv) -> (bytes charged, blocks, kv)

    def allocate(self, rows: int, capacity: int, keep_free: int = 0, chains=None) -> tuple[BatchKV, int]:
        """A cache for `rows` sequences of `capacity` slots (`chains`: the shared segments each
        row starts from); raises OverBudget if it does not fit with `keep_free` device bytes
        still free beside it (what the steps need)."""
        heads, key_dim, value_dim = self.shape.kv_cache_dims  # MLA: its latent and rotary key
        dims = (self.shape.num_layers, rows, heads, key_dim, capacity)
        nbytes = BatchKV.nbytes_for(*dims, self.dtype, value_dim)
        blocks = PinnedBlocks(pinned=True) if self.on_host and self.device.type == "cuda" else None
        if blocks:  # one locked block per layer's keys and one per its values, each charged what it takes
            nbytes = self.shape.num_layers * sum(map(pinned.charge, BatchKV.tensor_nbytes(*dims[1:], self.dtype,
                                                                                          value_dim)))
        if not self.on_host:
            self.make_room(nbytes + keep_free, "KV cache")
        self.account.reserve(nbytes, "KV cache")
        kv = BatchKV(*dims, self.dtype, device=self.device, on_host=self.on_host,
                     host_zeros=blocks.zeros if blocks else None, value_dim=value_dim)
        if self.on_host and self.staging is not None:
            kv.staging = self.staging
        if chains is not None:
            kv.mark_prefix(chains)
        self.held[id(kv)] = (nbytes, blocks, kv)
        return kv, nbytes

    def free(self, kv: BatchKV) -> None:
        nbytes, blocks, _ = self.held.pop(id(kv))
        if blocks:
            # its own last stores have landed (its loads finished before the compute those
            # stores wait for): no device-wide synchronize
            kv.settle()
            blocks.close()
        self.account.free(nbytes)

    def close(self) -> None:
        if any(blocks for _, blocks, _ in self.held.values()):
            # a step that failed may have left loads issued ahead reading the locked blocks
            self.drain()
        for nbytes, blocks, kv in self.held.values():
            if blocks:
                kv.settle()
                blocks.close()
            self.account.free(nbytes)
        self.held.clear()
