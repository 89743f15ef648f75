"""WeightCache: the device-side view of every tensor group, and the moves that feed it.

A group placed on `device` is read once and stays. A group placed on `host` is read into
host RAM once (into an exact page-locked block on CUDA: pinned.py) and copied to the device per use. A group placed on `disk`
is read per use, through a sliding window of host buffers that the pipeline fills ahead
(paper §6.1), or directly when the window has not reached it. The embedding table is only
gathered from: its rows are looked up where it lives, and only those rows move.

Every transient device copy is reserved in the device `Memory` before its transfer is
submitted and freed when the pipeline releases it; host copies, staged buffers included,
are reserved in the host `Memory`. A group the pipeline is computing with is held
(`hold`) and never chosen for eviction, so what the accounts say is what exists. Transfers
run on channels handed in by the engine (objects with `submit(fn, name=, nbytes=, link=)`
and `to_device(t)`); this package never imports them.
"""
from __future__ import annotations

import functools

import torch

from placement import pinned
from placement.tiers import DEVICE, DISK, HOST, Memory

DISK_TO_HOST = "disk_to_host"


class WeightCache:
    def __init__(self, store, placement, refs_for, dtype, memory: Memory, *, to_device, host_blocks=None,
                 disk_channel=None, codec=None, host_memory: Memory | None = None):
        self.store, self.placement, self.refs_for, self.dtype = store, placement, refs_for, dtype
        self.memory, self.disk_channel, self.codec = memory, disk_channel, codec
        self.host_memory = host_memory or Memory(float("inf"))
        self.to_device = to_device
        # a codec of a packed checkpoint (MXFP4) knows its decoded size; HQQ's refs are the original
        decoded = getattr(codec, "decoded_nbytes", None)
        self.full = {k: decoded(k) if decoded and self._coded(k) else self._nbytes(k) for k in placement.tiers}
        full = self.full
        # bytes that cross a link (and that a resident group occupies), and device bytes of a
        # transient copy (packed + decoded)
        self.moved = {k: self.codec.packed_nbytes(k) if self._coded(k) else full[k] for k in full}
        self.sizes = {k: self.moved[k] + full[k] if self._coded(k) else full[k] for k in full}
        # temporaries a codec's decode holds while it runs (MXFP4's slabs): reserved for the call only
        work = getattr(codec, "workspace_nbytes", None)
        self.workspace = {k: work(k) for k in full if work and self._coded(k)}
        self.decoded: set = set()
        self.unpacked: dict = {}   # resident quantized groups decoded for the current use
        self.resident: dict = {}   # device-placed groups
        self.host: dict = {}       # host-placed groups
        self.loaded: dict = {}     # transient device copies: key -> tensors
        self.pending: dict = {}    # key -> Ticket of a transfer in flight
        self.staging: dict = {}    # key -> Ticket of a disk->host read in flight
        self.held: set = set()     # groups being computed with: never evicted
        for key, tier in placement.tiers.items():
            if tier == DEVICE:  # quantized groups stay packed, as the planner sized them
                memory.reserve(self.moved[key], f"resident {key}")
                self.resident[key] = {n: to_device(t) for n, t in self._read(key).items()}
            elif tier == HOST:
                tensors = self._read(key)
                if host_blocks is None:
                    self.host_memory.reserve(self.moved[key], f"host copy of {key}")
                    self.host[key] = tensors
                else:  # charged what the locked block really takes
                    self.host_memory.reserve(pinned.charge(pinned.group_nbytes(tensors.values())), f"host copy of {key}")
                    self.host[key] = host_blocks.copy(tensors)
        self.host_blocks = host_blocks

    def close(self) -> None:
        """Unlock the host tier's blocks (every copy reading them has finished)."""
        if self.host_blocks is not None:
            self.host_blocks.close()

    def _nbytes(self, key) -> int:
        item = self.dtype.itemsize
        return sum(self.store.nbytes(r.name, r.index, r.rows) // self.store.entries[r.name].dtype.itemsize * item
                   for r in self.refs_for(key).values())

    def _coded(self, key) -> bool:
        return self.codec is not None and self.codec.covers(key)

    def _read(self, key) -> dict:
        """Host tensors of `key` as stored: packed parts when quantized."""
        if self._coded(key):
            return self.codec.read(key)
        return {n: self.store.read_ref(r).to(self.dtype) for n, r in self.refs_for(key).items()}

    # ---- state --------------------------------------------------------------------------
    def ready(self, key) -> bool:
        """On the device now (resident, or a finished transfer)."""
        return key in self.resident or key in self.loaded or (key in self.pending and self.pending[key].done())

    def present(self, key) -> bool:
        """On the device or on its way there."""
        return key in self.resident or key in self.loaded or key in self.pending

    def fits(self, key) -> bool:
        return self.memory.fits(self.sizes[key])

    # ---- moves --------------------------------------------------------------------------
    def start(self, key, channel) -> bool:
        """Begin moving `key` to the device on `channel`; False if the device has no room yet."""
        if self.present(key):
            return True
        if not self.memory.fits(self.sizes[key]):
            return False
        self.memory.reserve(self.sizes[key], str(key))
        source, owned = self._source(key)
        self.pending[key] = channel.submit(lambda: {n: channel.to_device(t, owned) for n, t in source().items()},
                                           name=_label(key), nbytes=self.moved[key])
        return True

    def _source(self, key):
        """A callable giving host tensors for `key`, run on the transfer's worker, and whether
        those tensors are this copy's own (a fresh read nobody else holds) or the host tier's.

        A staged buffer is handed over to this one copy: once the device copy exists the host
        buffer is garbage, so the window holds only layers not yet copied (what the planner
        charged to the host budget). A disk group that was not staged is read now, still on
        the disk channel, so every disk byte is on the disk lane and in its counters."""
        if key in self.host:
            tensors = self.host[key]
            return (lambda: tensors), False
        if self.placement.tiers.get(key) == DISK and self.disk_channel:
            self.stage([key])
            ticket = self.staging.pop(key)
            self.host_memory.free(self.moved[key])  # handed over: counted on the device from now
            return ticket.wait, True
        return (lambda: self._read(key)), True

    def get(self, key) -> dict:
        """Device tensors of `key`, waiting for its transfer if needed (the caller times the wait)."""
        if key in self.resident:
            return self.unpacked.get(key, self.resident[key])
        if key not in self.loaded:
            self.loaded[key] = self.pending.pop(key).wait()
        return self.loaded[key]

    def hold(self, key) -> None:
        """The pipeline computes with `key` now: it is not evicted until `unhold`/`release`."""
        self.held.add(key)

    def unhold(self, key) -> None:
        self.held.discard(key)

    def needs_decode(self, key) -> bool:
        return self._coded(key) and (key in self.loaded or key in self.resident) and key not in self.decoded

    def decode_nbytes(self, key) -> int:
        """Device bytes `decode` will reserve: the decoded copy of a resident group (a transient
        copy's reservation already covers it) and the codec's temporaries while it runs."""
        return (self.full[key] if key in self.resident else 0) + self.workspace.get(key, 0)

    @functools.cached_property
    def largest_use(self) -> int:
        """Device bytes computing with one group can take beyond what is resident: the largest
        group fetched from another tier, or the largest resident one decoded for its use (fixed
        once the tiers are filled; the pipeline asks every layer)."""
        moved = max((size + self.workspace.get(key, 0) for key, size in self.sizes.items() if key not in self.resident),
                    default=0)
        return max(moved, max((self.decode_nbytes(key) for key in self.resident if self._coded(key)), default=0))

    def decode(self, key) -> dict:
        """Dequantize `key` on the device for this use, its codec's temporaries reserved meanwhile."""
        self.decoded.add(key)
        work = self.workspace.get(key, 0)
        self.memory.reserve(work, f"decoding {key}")
        try:
            if key in self.resident:
                self.memory.reserve(self.full[key], f"decoded {key}")
                self.unpacked[key] = self.codec.decode(self.resident[key])
                return self.unpacked[key]
            self.loaded[key] = self.codec.decode(self.loaded[key])
            return self.loaded[key]
        finally:
            self.memory.free(work)

    def release(self, key) -> None:
        """The pipeline is done with `key` for now: drop a transient copy and free its bytes."""
        self.held.discard(key)
        if key in self.resident:
            if self.unpacked.pop(key, None) is not None:
                self.decoded.discard(key)
                self.memory.free(self.full[key])
            return
        if key in self.pending:  # prefetched but never used: let it land, then drop it
            self.pending.pop(key).wait()
        elif key not in self.loaded:
            return
        self.loaded.pop(key, None)
        self.decoded.discard(key)
        self.memory.free(self.sizes[key])

    def transient(self) -> list:
        """What `release` could free to make room: every transient copy not being computed with."""
        return [k for k in (*self.unpacked, *self.loaded, *self.pending) if k not in self.held]

    # ---- computing where a group lives (host compute) -----------------------------------
    def host_copy_available(self, key) -> bool:
        """Whether `key` sits in host RAM, or is being staged there from disk, so it could be
        computed with on the host without crossing the host->device link."""
        return key in self.host or key in self.staging

    def host_weights(self, key) -> dict:
        """Host tensors of `key` to compute with on the host: the host tier's copy, or the staged
        disk read (waited for), decoded on the host when packed (HQQ, MXFP4). A decoded copy is
        reserved in the host account until `drop_host_weights`."""
        tensors = self.host[key] if key in self.host else self.staging[key].wait()
        if not self._coded(key):
            return tensors
        self.host_memory.reserve(self.full[key], f"decoded {key} on the host")
        return self.codec.decode(tensors)

    def drop_host_weights(self, key) -> None:
        if self._coded(key):
            self.host_memory.free(self.full[key])

    # ---- the embedding: gathered where it lives ----------------------------------------
    def embedding_rows(self, ids: torch.Tensor):
        """(rows, index) such that rows[index] are the embeddings of `ids`: the whole table
        where it is in memory, else just the distinct rows read from disk."""
        key = ("embed",)
        if key in self.resident:
            return self.resident[key]["embed"], ids
        if key in self.host:
            return self.host[key]["embed"], ids
        ref = self.refs_for(key)["embed"]
        unique, index = torch.unique(ids, return_inverse=True)
        rows = torch.stack([self.store.read(ref.name, None, (r, r + 1))[0] for r in unique.tolist()])
        return rows.to(self.dtype), index

    # ---- disk -> host window ------------------------------------------------------------
    def stage(self, keys) -> None:
        """Read disk-placed `keys` into host buffers ahead of use (on the disk channel)."""
        for key in keys:
            if self.placement.tiers.get(key) == DISK and key not in self.staging and self.disk_channel:
                self.host_memory.reserve(self.moved[key], f"staged {key}")
                self.staging[key] = self.disk_channel.submit(lambda key=key: self._read(key), name=_label(key),
                                                             nbytes=self.moved[key], link=DISK_TO_HOST)

    def unstage(self, keys) -> None:
        for key in keys:
            if self.staging.pop(key, None) is not None:
                self.host_memory.free(self.moved[key])


def _label(key) -> str:
    return ".".join(str(p) for p in key)
