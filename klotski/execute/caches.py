"""The executor's caches: made, charged to their tier's budget, changed as the scheduler says,
and given back.

The `CacheManager` owns every cache of a run's KV tier; the scheduler names them by handle and
changes them only through the operations of execute/contract.py (`apply`), reading back plain
`CacheView`s. It makes a cache of the kinds the model's layers keep: attention keys and values
per layer (`BatchKV`; MLA's latent and rotary key are its keys and values of other widths) and,
for a hybrid's linear-attention layers (`ModelShape.linear_layers`), their recurrent state beside
it (`RecurrentState`, the cache's `state`); every row operation is applied to each kind
(`kinds`, the `CacheKind` protocol), and no call site of the scheduler changes. Rows of a prefilled cache
become shared prompt segments (`share_rows`: execute/segments.py), named by handle too.

A `KVSpace` is one accounting group of per-batch caches (a run's rows, a newcomer batch, the
rows of shared prompt segments): each cache is charged to the KV tier's budget when it is made
(on the device, room is made first, so the allocator never holds more than the accounts) and
given back by `free` or, for whatever is left, by `close`. The scheduler asks for caches by
their shape (rows, slots) and hands them back; what a cache holds, and how its bytes are
counted, is decided here, from the model's shape (keys and values of the attention layers, a
hybrid's recurrent state as a constant per row).
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Protocol

from klotski.execute.contract import Adopt, BatchStep, CacheView, Free, Realign, Reset, Scrub
from klotski.execute.kvcache import BatchKV
from klotski.execute.recurrent import RecurrentState
from klotski.execute.segments import SegmentGroup, SegmentKV
from placement import pinned
from placement.pinned import PinnedBlocks


class CacheKind(Protocol):
    """What the manager asks of a batch's per-layer cache (`BatchKV` is the attention kind,
    `RecurrentState` a hybrid's linear layers')."""
    filled: int
    capacity: int

    @property
    def batch(self) -> int: ...
    def row_lengths(self) -> list[int]: ...
    def adopt(self, row: int, src: "CacheKind", src_row: int, length: int) -> None: ...
    def scrub(self, row: int) -> None: ...
    def realign(self, keep: int, filled: int, room=None) -> None: ...
    def reset(self, rows: int) -> None: ...
    def mark_prefix(self, chains: list) -> None: ...
    def use_rows(self, rows: int) -> None: ...
    def settle(self) -> None: ...
    def release(self) -> None: ...


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
        # keys and values of the attention layers only (a hybrid's linear layers keep a state instead)
        nbytes = BatchKV.nbytes_for(self.shape.attention_layers, *dims[1:], self.dtype, value_dim)
        blocks = PinnedBlocks(pinned=True) if self.on_host and self.device.type == "cuda" else None
        if blocks:  # one locked block per layer's keys and one per its values, each charged what it takes
            nbytes = self.shape.attention_layers * sum(map(pinned.charge, BatchKV.tensor_nbytes(
                *dims[1:], self.dtype, value_dim)))
            # and one per linear layer's conv state and one per its matrix
            nbytes += len(self.shape.linear_layers) * sum(map(pinned.charge, RecurrentState.tensor_nbytes(
                rows, *state_dims(self.shape), self.dtype)))
        else:
            nbytes += state_nbytes(self.shape, rows, self.dtype)
        if not self.on_host:
            self.make_room(nbytes + keep_free, "KV cache")
        self.account.reserve(nbytes, "KV cache")
        kv = BatchKV(*dims, self.dtype, device=self.device, on_host=self.on_host,
                     host_zeros=blocks.zeros if blocks else None, value_dim=value_dim,
                     linear=self.shape.linear_layers)
        if self.shape.linear_layers:
            kv.state = RecurrentState(self.shape.linear_layers, rows, *state_dims(self.shape), self.dtype,
                                      device=self.device, on_host=self.on_host,
                                      host_zeros=blocks.zeros if blocks else None)
        if self.on_host and self.staging is not None:
            kv.staging = self.staging
        if chains is not None:
            for kind in kinds(kv):
                kind.mark_prefix(chains)
        self.held[id(kv)] = (nbytes, blocks, kv)
        return kv, nbytes

    @contextmanager
    def room(self, nbytes: int, what: str):
        """`nbytes` more of the budget while a block lives beside the caches (a realign's
        scratch): room is made on the device as for a cache, or the run stops over budget."""
        if not self.on_host:
            self.make_room(nbytes, what)
        self.account.reserve(nbytes, what)
        try:
            yield
        finally:
            self.account.free(nbytes)

    def free(self, kv: BatchKV) -> None:
        nbytes, blocks, _ = self.held.pop(id(kv))
        if blocks:
            # its own last stores have landed (its loads finished before the compute those
            # stores wait for): no device-wide synchronize
            for kind in kinds(kv):
                kind.settle()
            blocks.close()
        self.account.free(nbytes)

    def close(self) -> None:
        if any(blocks for _, blocks, _ in self.held.values()):
            # a step that failed may have left loads issued ahead reading the locked blocks
            self.drain()
        for nbytes, blocks, kv in self.held.values():
            if blocks:
                for kind in kinds(kv):
                    kind.settle()
                blocks.close()
            self.account.free(nbytes)
        self.held.clear()


def state_dims(shape) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """A linear-attention layer's state per row: (conv [channels, kernel - 1], matrix [value
    heads, key dim, value dim])."""
    return ((shape.linear_conv_dim, max(shape.linear_conv_kernel - 1, 0)),
            (shape.linear_value_heads, shape.linear_key_dim, shape.linear_value_dim))


def state_nbytes(shape, rows: int, dtype) -> int:
    """The recurrent state of `rows` sequences over every linear-attention layer (0: none)."""
    if not shape.linear_layers:
        return 0
    return RecurrentState.nbytes_for(len(shape.linear_layers), rows, *state_dims(shape), dtype)


def kinds(kv: BatchKV) -> list:
    """The kinds a batch's cache holds: attention keys and values, and a hybrid's recurrent state."""
    return [kv] if kv.state is None else [kv, kv.state]


class CacheManager:
    """Every cache of the run's KV tier, by handle, in accounting groups (`open_group`: a
    `KVSpace` each). `space()` makes a group's space (the arguments of `KVSpace`)."""

    def __init__(self, shape, dtype, device, *, on_host: bool, account, make_room, drain, staging=None):
        self.shape, self.dtype, self.device, self.on_host = shape, dtype, device, on_host
        self.account, self.make_room, self.drain, self.staging = account, make_room, drain, staging
        self.groups: dict[int, KVSpace] = {}
        self.caches: dict[int, tuple[int, BatchKV]] = {}  # handle -> (its group, the cache)
        self.segments: dict[int, SegmentKV] = {}  # handle -> a shared segment (a row of a group's cache)
        self._handles = itertools.count(1)

    @staticmethod
    def staging_for(kv_load, device):
        """The ring host caches gather strided slots into on their way up: the kv_load
        channel's on CUDA; none on a CPU "device", which copies straight."""
        return kv_load.staged if device.type == "cuda" else None

    def space(self) -> KVSpace:
        return KVSpace(self.shape, self.dtype, self.device, on_host=self.on_host, account=self.account,
                       make_room=self.make_room, drain=self.drain, staging=self.staging)

    def open_group(self) -> int:
        """A new accounting group (a run's rows, a group of segments), given back by `close_group`."""
        group = next(self._handles)
        self.groups[group] = self.space()
        return group

    def nbytes(self, rows: int, capacity: int) -> int:
        """A cache's bytes for `rows` sequences of `capacity` slots, every layer (before making it)."""
        heads, key_dim, value_dim = self.shape.kv_cache_dims
        return (BatchKV.nbytes_for(self.shape.attention_layers, rows, heads, key_dim, capacity, self.dtype, value_dim)
                + state_nbytes(self.shape, rows, self.dtype))

    def allocate(self, group: int, rows: int, capacity: int, keep_free: int = 0, chains=None) -> int:
        """A cache of `rows` rows and `capacity` slots in `group`, each row starting from the
        shared segments `chains[row]` names; raises OverBudget if it does not fit with
        `keep_free` device bytes still free beside it."""
        kv, _ = self.groups[group].allocate(rows, capacity, keep_free,
                                            chains=None if chains is None else self._chains(chains))
        handle = next(self._handles)
        self.caches[handle] = (group, kv)
        return handle

    def view(self, cache: int) -> CacheView:
        kv = self.caches[cache][1]
        return CacheView(cache, kv.batch, kv.capacity, kv.filled, tuple(kv.row_lengths()))

    def apply(self, *ops) -> None:
        """Carry out the scheduler's cache operations, in order."""
        for op in ops:
            if isinstance(op, Free):
                group, kv = self.caches.pop(op.cache)
                for kind in kinds(kv):
                    kind.release()  # its tensors before its account
                self.groups[group].free(kv)
                continue
            kv = self.caches[op.cache][1]
            if isinstance(op, Adopt):  # every kind's row moves, each from its own kind
                for mine, theirs in zip(kinds(kv), kinds(self.caches[op.src][1])):
                    mine.adopt(op.row, theirs, op.src_row, op.length)
            elif isinstance(op, Scrub):
                for kind in kinds(kv):
                    kind.scrub(op.row)
            elif isinstance(op, Realign):
                room = self.groups[self.caches[op.cache][0]].room
                for kind in kinds(kv):
                    kind.realign(op.keep, op.keep, room=lambda nbytes: room(nbytes, "KV realign"))
            elif isinstance(op, Reset):
                for kind in kinds(kv):
                    kind.reset(op.rows)
                    kind.mark_prefix(self._chains(op.chains))
            else:
                raise TypeError(f"not a cache operation: {op!r}")

    def batches(self, steps: list[BatchStep]) -> list[BatchKV]:
        """The caches a step's batches run in, each computing the rows its input has."""
        kvs = [self.caches[b.cache][1] for b in steps]
        for kv, b in zip(kvs, steps):
            for kind in kinds(kv):
                kind.use_rows(b.input.ids.shape[0])
        return kvs

    def close_group(self, group: int) -> None:
        """Give back every cache of `group`: their tensors, then their accounts."""
        for handle in [h for h, (g, _) in self.caches.items() if g == group]:
            for kind in kinds(self.caches.pop(handle)[1]):
                kind.release()
        self.groups.pop(group).close()

    # ---- shared prompt segments ---------------------------------------------------------
    def share_rows(self, cache: int, lengths: list[int]) -> list[int]:
        """The rows of a prefilled cache become shared segments (row r: its newest
        `lengths[r]` slots), one handle each; the cache's group goes with the last of them."""
        group, kv = self.caches[cache]
        for kind in kinds(kv):  # its stores have landed: loads read it from now on with no wait
            kind.settle()
        owner = SegmentGroup(lambda: self.close_group(group), len(lengths))
        handles = []
        for row, length in enumerate(lengths):
            handles.append(next(self._handles))
            self.segments[handles[-1]] = SegmentKV(owner, kv, row, length)
        return handles

    def release_segment(self, segment: int) -> None:
        self.segments.pop(segment).release()

    def _chains(self, chains) -> list[tuple]:
        """Chains of segment handles as the caches read them: the segments themselves."""
        return [tuple(self.segments[h] for h in chain) for chain in chains]

    def close(self) -> None:
        """Give back every group still open (a run that stopped; segments never released)."""
        self.segments.clear()
        for group in list(self.groups):
            self.close_group(group)
