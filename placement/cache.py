"""WeightCache: the device-side view of every tensor group, and the moves that feed it.

A group placed on `device` is read once and stays. A group placed on `host` is read into
host RAM once (into an exact page-locked block on CUDA: pinned.py) and copied to the device per use. A group placed on `disk`
is read per use, through a sliding window of host buffers that the pipeline fills ahead
(paper §6.1), or directly when the window has not reached it. The embedding table is only
gathered from: its rows are looked up where it lives, and only those rows move.

Every transient device copy is reserved in the device `Memory` before its transfer is
submitted and freed when the pipeline releases it, except a transferred expert landing in a
slot of the run's `ExpertPool` (pool.py), whose bytes were reserved once when it was opened (a
packed one lands packed beside its slot and is decoded into it, a run in few codec calls);
host copies, staged buffers included, are reserved in the host `Memory`. A group the pipeline
is computing with is held (`hold`) and never chosen for eviction, so what the accounts say is
what exists. Transfers run on channels handed in by the engine (objects with
`submit(fn, name=, nbytes=, link=, speculative=)` and `to_device(t)`); this package never imports them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from placement import pinned
from placement.pool import ExpertPool, FlatLayout, Landing
from placement.tiers import DEVICE, DISK, HOST, Memory

DISK_TO_HOST = "disk_to_host"


class WeightCache:
    def __init__(self, store, placement, refs_for, dtype, memory: Memory, *, to_device, host_blocks=None,
                 disk_channel=None, codec=None, host_memory: Memory | None = None, kept=frozenset(),
                 stack_form=None, linear_form=None):
        self.store, self.placement, self.refs_for, self.dtype = store, placement, refs_for, dtype
        self.memory, self.disk_channel, self.codec = memory, disk_channel, codec
        self.host_memory = host_memory or Memory(float("inf"))
        self.to_device = to_device
        # device-placed packed groups decoded once and kept so (a placement choice the plan made:
        # klotski/planning.decoded_copies): the decoded copy is charged to the host account, the
        # packed bytes stay charged on the device as planned, and the group computes as a plain one
        self.kept = frozenset(k for k in kept if placement.tiers.get(k) == DEVICE and codec is not None
                              and codec.covers(k))
        # a codec of a packed checkpoint (MXFP4) knows its decoded size; HQQ's refs are the original
        decoded = getattr(codec, "decoded_nbytes", None)
        self.full = {k: decoded(k) if decoded and self.coded(k) else self._nbytes(k) for k in placement.tiers}
        full = self.full
        # bytes that cross a link (and that a resident group occupies), and device bytes of a
        # transient copy (packed + decoded)
        self.moved = {k: self.codec.packed_nbytes(k) if self.coded(k) else full[k] for k in full}
        self.sizes = {k: self.moved[k] + full[k] if self.coded(k) else full[k] for k in full}
        # temporaries a codec's decode holds while it runs (MXFP4's slabs): reserved for the call only
        work = getattr(codec, "workspace_nbytes", None)
        self.workspace = {k: work(k) for k in full if work and self.coded(k)}
        self.decoded: set = set()
        self.unpacked: dict = {}   # resident quantized groups decoded for the current use
        self.resident: dict = {}   # device-placed groups
        self.host: dict = {}       # host-placed groups
        self.flat: dict = {}       # host-placed packed expert -> (its parts in one row of bytes, FlatLayout)
        self.loaded: dict = {}     # transient device copies: key -> tensors
        self.pending: dict = {}    # key -> Ticket of a transfer in flight
        self.pool: ExpertPool | None = None  # slots transferred experts land in (open_pool)
        self._pooled: set = set()  # the experts that land in it
        self.landings: dict = {}   # key -> the Landing it arrives (or arrived) stacked in: the pool's overflow
        self.packed_runs: dict = {}  # pooled packed key not decoded yet -> the keys moved with it
        self.experts_landed_stacked = 0  # experts moved in a shared submission (start_many)
        self.staging: dict = {}    # key -> Ticket of a disk->host read in flight
        self.held: set = set()     # groups being computed with: never evicted
        # a layer's resident experts (16-bit or fp32: packed ones decode per use) live stacked,
        # one tensor per weight name, so one grouped call computes them all; each expert's
        # tensors are views of its row. Filled once, never re-stacked. `stack_form`: on a CPU,
        # the form the family's grouped FFN reads reordered rows in (the same bytes; models/prepacked.py);
        # `linear_form(kind, tensors)`: another resident group's tensors as they are held there
        self.stacks: dict[int, ExpertStack] = {}
        for key, tier in placement.tiers.items():
            if tier == DEVICE and key[0] == "expert" and not self.packed_here(key):
                self.stacks.setdefault(key[1], ExpertStack()).experts.append(key[2])
        for stack in self.stacks.values():
            stack.experts.sort()
            stack.row = {e: i for i, e in enumerate(stack.experts)}
        device = to_device(torch.empty(0)).device if self.stacks else None
        for key, tier in placement.tiers.items():
            if tier == DEVICE:  # quantized groups stay packed, as the planner sized them
                memory.reserve(self.moved[key], f"resident {key}")
                if key in self.kept and self.moved[key] != full[key]:  # (stored floats: the same tensors)
                    self.host_memory.reserve(full[key], f"kept decoded copy of {key}")
                tensors = codec.kept_copy(key) if key in self.kept else self._read(key)
                stack = self.stacks.get(key[1]) if key[0] == "expert" else None
                if stack is not None and key[2] in stack.row:
                    self.resident[key] = stack.put(key[2], tensors, device, stack_form)
                else:
                    self.resident[key] = {n: to_device(t) for n, t in tensors.items()}
                    if linear_form is not None:
                        self.resident[key] = linear_form(key[0], self.resident[key])
            elif tier == HOST:
                tensors = self._read(key)
                layout = FlatLayout.of(tensors) if self.coded(key) and key[0] == "expert" else None
                if layout is not None:  # one row of bytes: it moves in one copy (its parts are views)
                    tensors = {"flat": layout.flatten(tensors)}
                if host_blocks is None:
                    self.host_memory.reserve(self.moved[key], f"host copy of {key}")
                    self.host[key] = tensors
                else:  # charged what the locked block really takes
                    self.host_memory.reserve(pinned.charge(pinned.group_nbytes(tensors.values())), f"host copy of {key}")
                    self.host[key] = host_blocks.copy(tensors)
                if layout is not None:
                    self.flat[key] = (self.host[key]["flat"], layout)
                    self.host[key] = layout.views(self.flat[key][0])
        self.host_blocks = host_blocks

    def close(self) -> None:
        """Unlock the host tier's blocks (every copy reading them has finished)."""
        if self.host_blocks is not None:
            self.host_blocks.close()

    def _nbytes(self, key) -> int:
        item = self.dtype.itemsize
        return sum(self.store.nbytes(r.name, r.index, r.rows) // self.store.entries[r.name].dtype.itemsize * item
                   for r in self.refs_for(key).values())

    def coded(self, key) -> bool:
        """Whether `key` is stored packed (HQQ, MXFP4, GGUF blocks): its sizes are the packed form's."""
        return self.codec is not None and self.codec.covers(key)

    def packed_here(self, key) -> bool:
        """Whether `key` is held packed and decoded per use (a kept decoded copy is not)."""
        return self.coded(key) and key not in self.kept

    def _read(self, key) -> dict:
        """Host tensors of `key` as stored: packed parts when quantized."""
        if self.coded(key):
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
        return (self.pooled(key) and self.pool.free() > 0) or self.memory.fits(self.sizes[key])

    # ---- moves --------------------------------------------------------------------------
    def start(self, key, channel, speculative: bool = False) -> bool:
        """Begin moving `key` to the device on `channel`; False if the device has no room yet.
        `speculative`: a prefetch (it yields the link to demand loads: the channel's `submit`)."""
        if self.present(key):
            return True
        if self.pooled(key) and self.pool.free() and not self._handed_over(key):
            return self.start_many([key], channel, speculative) > 0
        if not self.memory.fits(self.sizes[key]):
            return False
        self.memory.reserve(self.sizes[key], str(key))
        source, owned = self._source(key)
        self.pending[key] = channel.submit(lambda: {n: channel.to_device(t, owned) for n, t in source().items()},
                                           name=_label(key), nbytes=self.moved[key], speculative=speculative)
        return True

    def promote(self, key) -> None:
        """Compute waits for `key` now: its transfer, if a prefetch still on its way, is carried
        as a demand load from here on."""
        if key in self.pending:
            self.pending[key].promote()

    def open_pool(self, slots: int, *, event=None, decode_workspace=None) -> None:
        """The pool transferred experts land in: `slots` experts (0: none, every expert lands in
        its own copy), their bytes reserved now and held for the run. Experts not resident go
        there; a packed one lands in its slot's packed row and is decoded into the slot, the
        pool keeping `decode_workspace(slots, bytes one expert's decode takes)` bytes for that
        (planner.workingset.decode_workspace). `event`: the device's event factory (CUDA), for
        the fences a reused slot needs."""
        keys = [k for k, tier in self.placement.tiers.items() if k[0] == "expert" and tier != DEVICE]
        if slots <= 0 or not keys:
            return
        # the first host-tier one (its parts' row of bytes is the pool's packed row), else the first
        first, device = next((k for k in keys if k in self.flat), keys[0]), self.to_device(torch.empty(0)).device
        packed, workspace, rows = None, 0, 0
        if self.coded(first):  # one expert decoded here, once: its parts' and its decoded shapes
            parts = self.host[first] if first in self.host else self.codec.read(first)
            packed = self.flat[first][1] if first in self.flat else {n: t.to("meta") for n, t in parts.items()}
            like = {n: t.to("meta") for n, t in self.codec.decode(parts).items()}
            per = self.full[first] + self.workspace.get(first, 0)
            workspace = decode_workspace(slots, per) if decode_workspace else per
            rows = max(1, workspace // per)
        else:  # one expert's shapes from the checkpoint's index (meta tensors: nothing is read)
            like = {n: torch.empty(self.store.entries[r.name].span(r.index, r.rows)[2], dtype=self.dtype,
                                   device="meta") for n, r in self.refs_for(first).items()}
        self.memory.reserve(slots * self.sizes[first] + workspace, f"expert pool x{slots}")
        self.pool = ExpertPool(slots, like, self.sizes[first], device, event=event, packed=packed,
                               workspace=workspace, decode_rows=rows)
        self._pooled = {k for k in keys if self._alike(k, first)}

    def _alike(self, key, other) -> bool:
        """`key` takes the same device rows as `other`: sizes, and a packed one's layout (GGUF
        blocks of one type: a layer's experts may be stored in another)."""
        types = getattr(self.codec, "block_types", None) if self.coded(key) else None
        return (self.sizes[key] == self.sizes[other] and self.coded(key) == self.coded(other)
                and (types is None or types(key) == types(other)))

    def pooled(self, key) -> bool:
        """`key` lands in a pool slot when it is moved to the device."""
        return self.pool is not None and key in self._pooled

    def start_many(self, keys, channel, speculative: bool = False) -> int:
        """Begin moving a run of one layer's experts in one submission: into free pool slots, as
        many as there are (adjacent or not: a wave computes them over the pool's tensors without
        copying them again); with the pool full, host-tier ones into a Landing of their own as
        many as the device has room for; any other alone. Returns how many of `keys` started
        (0: no room)."""
        pool, run = self.pool, 0
        if self.pooled(keys[0]) and pool.free():
            while (run < len(keys) and run < pool.free() and self.pooled(keys[run]) and not self.present(keys[run])
                   and not self._handed_over(keys[run])):
                run += 1
            if run == 0:
                return int(self.start(keys[0], channel, speculative))
            keys = keys[:run]
            slots = [pool.take(k) for k in keys]
            sources = [self._source(k)[0] for k in keys]
            flats = [self._flat(k, pool.layout) for k in keys]
            rows = pool.packed if self.coded(keys[0]) else pool.tensors  # packed: decoded into the slot on use
            for key in keys if pool.packed else ():
                self.packed_runs[key] = keys

            def work():
                for source, flat, s in zip(sources, flats, slots):
                    if flat is not None:  # a packed expert's parts in one row of bytes: one copy
                        channel.copy_into(pool.flat[s], flat)
                        continue
                    for n, t in source().items():
                        channel.copy_into(rows[n][s], t)

            ticket = channel.submit(work, name=_label(keys[0]) + (f"+{run - 1}" if run > 1 else ""),
                                    nbytes=sum(self.moved[k] for k in keys), after=pool.after(slots),
                                    speculative=speculative)
            for key in keys:
                self.pending[key] = ticket
            self.experts_landed_stacked += run if run > 1 else 0
            return run
        size = self.sizes[keys[0]] + self.workspace.get(keys[0], 0)  # packed: its decode's temporaries too
        while (run < len(keys) and keys[run] in self.host and self._alike(keys[run], keys[0])
               and not self.present(keys[run]) and self.memory.fits((run + 1) * size)):
            run += 1
        if run < 2:
            return int(self.start(keys[0], channel, speculative))
        keys = keys[:run]
        landing = Landing(keys, run * size)
        self.memory.reserve(landing.nbytes, f"experts {keys[0][:2]} x{run}")
        sources = [self.host[k] for k in keys]
        layout = self.flat[keys[0]][1] if keys[0] in self.flat else None
        layout = layout if all(self._flat(k, layout) is not None for k in keys) else None

        def work():
            if layout is not None:  # packed experts in rows of bytes: one copy each, parts as views
                flat = channel.empty((run, layout.nbytes), torch.uint8)
                for i, key in enumerate(keys):
                    channel.copy_into(flat[i], self.flat[key][0])
                return layout.views(flat)
            stacks = {n: channel.empty((run, *t.shape), t.dtype) for n, t in sources[0].items()}
            for i, tensors in enumerate(sources):
                for n, t in tensors.items():
                    channel.copy_into(stacks[n][i], t)
            return stacks

        ticket = channel.submit(work, name=_label(keys[0]) + f"+{run - 1}", nbytes=sum(self.moved[k] for k in keys),
                                speculative=speculative)
        for i, key in enumerate(keys):
            self.pending[key], self.landings[key] = landing.row_ticket(ticket, i), landing
        self.experts_landed_stacked += run
        return run

    def _flat(self, key, layout):
        """`key`'s host row of bytes if it is laid out as `layout` (one copy moves it), else None."""
        flat = self.flat.get(key)
        return flat[0] if flat is not None and layout is not None and flat[1] == layout else None

    def _handed_over(self, key) -> bool:
        """A disk read on a CPU device becomes the device copy itself where there is room for it
        (no copy at all: the "device" is the same RAM); a slot of the pool would cost a copy."""
        return (self.pool.tensors_device.type == "cpu" and self.placement.tiers.get(key) == DISK
                and self.disk_channel is not None and self.memory.fits(self.sizes[key]))

    def in_pool(self, key) -> bool:
        """`key` sits (or is landing) in a pool slot."""
        return self.pool is not None and key in self.pool.slot

    def landing(self, key):
        """The Landing `key` arrived stacked in (its `stacks` set once a member was waited for), or None."""
        return self.landings.get(key)

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
        self.land(key)
        if self.loaded[key] is not None:
            return self.loaded[key]
        if self.in_pool(key):
            return self.pool.view(key)
        landing = self.landings[key]
        return {n: t[landing.row[key]] for n, t in landing.stacks.items()}

    def land(self, key) -> None:
        """Wait for `key`'s transfer. One in a pool slot or a Landing is kept as None: its tensors
        are rows of the pool's or the Landing's (views made only when asked for, by `get`)."""
        if key not in self.resident and key not in self.loaded:
            landed = self.pending.pop(key).wait()
            self.loaded[key] = None if self.in_pool(key) or key in self.landings else landed

    def hold(self, key) -> None:
        """The pipeline computes with `key` now: it is not evicted until `unhold`/`release`."""
        self.held.add(key)

    def unhold(self, key) -> None:
        self.held.discard(key)

    def needs_decode(self, key) -> bool:
        return self.packed_here(key) and (key in self.loaded or key in self.resident) and key not in self.decoded

    def decode_nbytes(self, key) -> int:
        """Device bytes `decode` will reserve: the decoded copy of a resident group (a transient
        copy's reservation already covers it) and the codec's temporaries while it runs; none
        for an expert in the pool or a Landing (their reservations hold its decode)."""
        if self.in_pool(key) or key in self.landings:
            return 0
        return (self.full[key] if key in self.resident else 0) + self.workspace.get(key, 0)

    @functools.cached_property
    def largest_use(self) -> int:
        """Device bytes computing with one group can take beyond what is resident: the largest
        group fetched from another tier, or the largest resident one decoded for its use (fixed
        once the tiers and the pool are made; the pipeline asks every layer). A pooled expert
        takes a slot, no byte beyond the pool's; the embedding table never comes whole (its rows
        are gathered where it lives: `embedding_rows`)."""
        moved = max((size + self.workspace.get(key, 0) for key, size in self.sizes.items()
                     if key not in self.resident and not self.pooled(key) and key != ("embed",)), default=0)
        return max(moved, max((self.decode_nbytes(key) for key in self.resident if self.packed_here(key)), default=0))

    def decode(self, key) -> dict:
        """Dequantize `key` on the device for this use, its codec's temporaries reserved meanwhile.
        One in the pool or a Landing is decoded with the experts moved beside it (their copy has
        arrived: one transfer), in codec calls over their stacked rows."""
        if self.in_pool(key):
            return self._decode_run(key)
        if key in self.landings:
            return self._decode_landing(self.landings[key], key)
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

    def _decode_run(self, key) -> dict:
        """`key` and the pooled experts moved with it that are still in their slots, decoded from
        their packed rows into their slots: a codec call and a copy per weight name for each run
        of adjacent slots (ExpertPool.segments), within the pool's workspace."""
        pool, run = self.pool, self.packed_runs[key]
        members = [k for k in run if self.packed_runs.get(k) is run]
        for k in members:
            self.land(k)  # one transfer: its arrival was waited for with key's
        for first, end in pool.segments(pool.slot[k] for k in members):
            decoded = self.codec.decode({n: t[first:end] for n, t in pool.packed.items()})
            for n, t in decoded.items():
                pool.tensors[n][first:end].copy_(t)
            del decoded
        for k in members:
            del self.packed_runs[k]
            self.decoded.add(k)
        return pool.view(key)

    def _decode_landing(self, landing, key) -> dict:
        """The Landing's packed stacks decoded in one codec call (its reservation holds the decoded
        stacks and the codec's temporaries), replacing them; `key`'s rows."""
        if not landing.decoded:
            landing.stacks, landing.decoded = self.codec.decode(landing.stacks), True
        self.decoded.update(k for k in landing.keys if self.landings.get(k) is landing)
        return {n: t[landing.row[key]] for n, t in landing.stacks.items()}

    def release_all(self, keys) -> None:
        """`release` each of `keys`, the pooled ones behind one shared fence (a wave's)."""
        fence = self.pool.fence() if self.pool is not None and any(self.in_pool(k) for k in keys) else None
        for key in keys:
            self.release(key, fence)

    def release(self, key, fence=None) -> None:
        """The pipeline is done with `key` for now: drop a transient copy and free its bytes (a
        pooled expert's slot goes back behind `fence`, or one made for it: ExpertPool.give)."""
        self.held.discard(key)
        if key in self.resident:
            if self.unpacked.pop(key, None) is not None:
                self.decoded.discard(key)
                self.memory.free(self.full[key])
            return
        dropped = None
        if key in self.pending:  # prefetched but never used: dropped once issued (nothing waits on it)
            dropped = self.pending.pop(key)
            dropped.discard()
        elif key not in self.loaded:
            return
        self.loaded.pop(key, None)
        self.decoded.discard(key)
        self.packed_runs.pop(key, None)
        landing = self.landings.pop(key, None)
        if self.in_pool(key):
            self.pool.give(key, dropped if dropped is not None else fence)  # free again; no device byte moves
        elif landing is None:
            self.memory.free(self.sizes[key])
        elif landing.leave():  # its stacks are freed with the last member
            self.memory.free(landing.nbytes)

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
        if not self.coded(key):
            return tensors
        self.host_memory.reserve(self.full[key], f"decoded {key} on the host")
        return self.codec.decode(tensors)

    def drop_host_weights(self, key) -> None:
        if self.coded(key):
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


@dataclass
class ExpertStack:
    """One layer's resident experts, stacked: `tensors[name][row[e]]` is expert e's `name`."""
    experts: list = field(default_factory=list)   # expert ids, ascending (the rows' order)
    row: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)

    # how the rows are held where not stacked tensors: a form (klotski/models/prepacked.py) whose
    # `pack_expert` makes an expert's row, `tensors[name]` being then a list with a row per expert
    form: object = None

    def put(self, expert: int, tensors: dict, device, form=None) -> dict:
        """Copy one expert's host tensors into its row (the stack made on the first); its views.
        `form`: the rows are held in that form where it `packs` the first expert's tensors on a
        CPU (a form made from a host tensor is the CPU's own)."""
        if not self.tensors and form is not None and device.type == "cpu" and form.packs(tensors):
            self.form = form
        if self.form is not None:
            row = self.form.pack_expert(tensors)
            if not self.tensors:
                self.tensors = {n: [None] * len(self.experts) for n in row}
            for n, t in row.items():
                self.tensors[n][self.row[expert]] = t
            return row
        if not self.tensors:
            self.tensors = {n: torch.empty((len(self.experts), *t.shape), dtype=t.dtype, device=device)
                            for n, t in tensors.items()}
        i = self.row[expert]
        for n, t in tensors.items():
            self.tensors[n][i].copy_(t)
        return {n: self.tensors[n][i] for n in tensors}


def _label(key) -> str:
    return ".".join(str(p) for p in key)
