"""Per-batch KV cache, on the device or offloaded to host.

One `BatchKV` per batch of a group: keys/values per layer, slot-major
[capacity, B, kv_heads, head_dim], so that a batch's prefix and a step's new slots are each
one contiguous block (one copy per direction, from and into pinned host memory); attention
reads them as [B, kv_heads, slots, head_dim] views. A validity mask over cache slots
(False = left padding; kept on the host, where masks are built) and the number of slots
filled. Only the first `rows` rows take part in a step (`use_rows`): continuous batching
keeps a batch's live sequences in front and computes no row whose sequence has finished.
Keys and values may differ in width (`value_dim`): MLA caches its latent as the
"keys" and its rotary key as the "values". Sequences in a batch share slot indices; left padding keeps every sequence's newest
token in the same slot.

On the device tier attention writes straight into the cache. On the host tier the
pipeline asks for `load(layer)` (on `kv_load`: a device buffer holding the prefix plus room
for this step) ahead of the batch's attention, and `store(layer, buf)` (on `kv_store`:
only this step's new slots go back) after it. `stored[layer]` is the last store's ticket,
which the next load of that layer waits for. A load's host->device copies read page-locked
memory only, contiguous: the host cache's own slots when they are one block, else the
staging ring of the channel the load runs on (kv_load's `staging.StagedCopies`: the run's,
charged to its host account) that they are gathered into, chunk by chunk.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from klotski.execute.staging import StagedCopies

REALIGN_BLOCK_BYTES = 16 << 20  # the most a realign's scratch block takes (at least one slot)


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A KV load's host->device copy: `src` is a contiguous view of page-locked memory (the
    host cache or a channel's staging ring), so the copy is asynchronous on the channel's stream."""
    dst.copy_(src, non_blocking=True)


def _heads(slot_major: torch.Tensor) -> torch.Tensor:
    """[slots, B, kvh, D] -> the [B, kvh, slots, D] view attention reads."""
    return slot_major.permute(1, 2, 0, 3)


class BatchKV:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, *, device="cpu", on_host: bool = False,
                 host_zeros=None, value_dim: int | None = None, linear=()):
        shape = (capacity, batch, kv_heads, head_dim)
        vshape = (capacity, batch, kv_heads, value_dim or head_dim)
        # host copies live in exact page-locked blocks on CUDA (`host_zeros`: placement/pinned.py);
        # loads gather into a persistent staging ring, never a fresh copy
        plain = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device="cpu" if on_host else device)  # noqa: E731
        zeros = host_zeros if on_host and host_zeros else plain
        # a hybrid's linear-attention layers (`linear`) keep no keys or values: zero-width
        # tensors there, so every row operation stays one loop over layers and moves no byte
        empty = (capacity, batch, kv_heads, 0)
        self.keys = [plain(empty, dtype) if j in linear else zeros(shape, dtype) for j in range(num_layers)]
        self.values = [plain(empty, dtype) if j in linear else zeros(vshape, dtype) for j in range(num_layers)]
        self.kv_layer = next((j for j in range(num_layers) if j not in linear), 0)  # one that holds keys
        self.state = None  # the linear layers' recurrent state (execute/recurrent.py), made beside
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool)
        self.on_host = on_host
        self.filled = 0
        self.new = 0
        self.capacity = capacity
        self.rows = batch  # rows a step computes: the first `rows` of the batch
        self.old_slots = None
        self.first = 0  # the oldest slot a step loads: before it, no computed row has a token
        self._columns = {}  # device -> this step's columns there
        self.stored: dict = {}
        # the ring strided slots are gathered into on their way up: on CUDA the kv_load channel's
        # (given by execute/caches.KVSpace); none on a CPU "device", which copies straight
        self.staging: StagedCopies | None = None
        # per row, the shared prompt segments its sequence starts from (schedule/prefix.py),
        # outermost first: not in this cache's slots, attended before them (positions here
        # count after them); () for a row that starts from none
        self.chains: list[tuple] = [()] * batch

    @staticmethod
    def nbytes_for(num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                   dtype: torch.dtype, value_dim: int | None = None) -> int:
        """The whole cache of a batch, every layer, at full capacity (known before allocating)."""
        return num_layers * sum(BatchKV.tensor_nbytes(batch, kv_heads, head_dim, capacity, dtype, value_dim))

    @staticmethod
    def tensor_nbytes(batch: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                      value_dim: int | None = None) -> tuple[int, int]:
        """Bytes of one layer's keys tensor and of its values tensor."""
        per_slot = capacity * batch * kv_heads * dtype.itemsize
        return per_slot * head_dim, per_slot * (value_dim or head_dim)

    @property
    def batch(self) -> int:
        """Rows the cache holds (a step may compute fewer: `rows`)."""
        return self.valid.shape[0]

    def use_rows(self, rows: int) -> None:
        """Steps compute only the first `rows` rows (their slots are views: nothing moves)."""
        if not 0 < rows <= self.valid.shape[0]:
            raise ValueError(f"{rows} rows of a {self.valid.shape[0]}-row cache")
        self.rows = rows

    def begin_step(self, valid_new: torch.Tensor, sink: int | None = None, recent: int | None = None):
        """Reserve slots for this step's tokens ([B, T] validity); return the validity of
        every slot so far. With StreamingLLM-style sparsity (`sink` first tokens and the
        `recent` last ones of each sequence) only old slots some sequence can still see are
        loaded from the host: `self.old_slots`."""
        t, r = valid_new.shape[1], self.rows
        if valid_new.shape[0] != r:
            raise RuntimeError(f"{valid_new.shape[0]} rows of input for a cache computing {r}")
        if self.filled + t > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.filled}+{t} > {self.capacity} slots")
        self.valid[:r, self.filled:self.filled + t] = valid_new
        self.new = t
        self.old_slots = None
        self._columns = {}
        old = self.valid[:r, :self.filled]
        if recent is not None:  # the kept slots, absolute
            rank = old.long().cumsum(-1) - 1
            last_query = self.filled + t - 1
            keep = old & ((rank < sink) | (torch.arange(self.filled) > last_query - recent))
            self.old_slots = torch.nonzero(keep.any(0)).flatten()
            self.first = 0
        else:
            # Slots before the computed rows' oldest token are padding to every one of them (a
            # continuous batch's finished rows left them behind): neither loaded nor attended.
            used = torch.nonzero(old.any(0))
            self.first = int(used[0]) if len(used) else self.filled
        return self.valid[:r, self.first:self.filled + t]

    def step_columns(self, device="cpu") -> torch.Tensor | None:
        """Cache slots this step attends over, in buffer order (None = all of them)."""
        if self.old_slots is None:
            return None
        key = str(device)
        if key not in self._columns:
            cols = torch.cat([self.old_slots, torch.arange(self.filled, self.filled + self.new)])
            self._columns[key] = cols.to(device)
        return self._columns[key]

    def step_slots(self) -> int:
        """Slots this step attends over: the visible old ones and its own."""
        return self._old_count() + self.new

    def _old_count(self) -> int:
        return self.filled - self.first if self.old_slots is None else len(self.old_slots)

    def end_step(self) -> None:
        self.filled += self.new
        self.new = 0

    # ---- continuous batching: rows change hands (klotski/schedule/batching.py) --------------------
    def settle(self) -> None:
        """Block until every store into the host copy has landed (before the host rewrites it)."""
        for layer in self.stored:
            self.landed(layer)

    def landed(self, layer: int) -> None:
        """Block until the last store of `layer` has landed: its own event, not the device."""
        ticket = self.stored.get(layer)
        if ticket is not None:
            ticket.landed()

    def row_lengths(self) -> list[int]:
        """Per row, how many of the newest slots its tokens reach back (a row's tokens are
        contiguous and end at the newest slot; 0: none)."""
        used = self.valid[:, :self.filled]
        first = used.int().argmax(dim=1)  # the first True (0 where there is none)
        return torch.where(used.any(dim=1), self.filled - first, 0).tolist()

    def realign(self, keep: int, filled: int, room=None) -> None:
        """Move the newest `keep` slots (fewer if there are not that many) to end at slot
        `filled`, every slot before them invalid: the cache makes room at its end (keep <=
        filled) or in front (a newcomer's prompt longer than the slots so far). Positions are
        the rows' own, so moving slots changes no number. Overlapping ranges move through a
        scratch block of at most REALIGN_BLOCK_BYTES; `room(nbytes)` is a context holding
        that many bytes of the caches' budget while the block lives."""
        self.settle()
        m = min(keep, self.filled)
        if m and filled != self.filled:
            self._move_slots(self.filled - m, filled - m, m, room or (lambda nbytes: nullcontext()))
        valid = self.valid[:, self.filled - m:self.filled].clone()
        self.valid.zero_()
        self.valid[:, filled - m:filled] = valid
        self.filled = filled

    def _move_slots(self, src: int, dst: int, m: int, room) -> None:
        tensors = self.keys + self.values
        if abs(dst - src) >= m:  # apart: one copy each
            for t in tensors:
                t[dst:dst + m].copy_(t[src:src + m])
            return
        # Block by block, in the order that reads every source block before a write lands on
        # it: from the front moving back, from the end moving forward.
        per_slot = max(t[0].numel() for t in tensors)
        size = tensors[0].element_size()
        block = max(1, min(m, REALIGN_BLOCK_BYTES // (per_slot * size)))
        starts = list(range(0, m, block))
        if dst > src:
            starts.reverse()
        with room(block * per_slot * size):
            scratch = torch.empty(block * per_slot, dtype=tensors[0].dtype, device=tensors[0].device)
            for t in tensors:
                for a in starts:
                    n = min(block, m - a)
                    buf = scratch[:n * t[0].numel()].view(n, *t.shape[1:])
                    buf.copy_(t[src + a:src + a + n])
                    t[dst + a:dst + a + n].copy_(buf)
            del scratch, buf  # dropped before its bytes go back to the budget

    def adopt(self, row: int, src: "BatchKV", src_row: int, length: int) -> None:
        """Row `row` takes the newest `length` slots of `src`'s row `src_row` (a prompt
        prefilled elsewhere), ending at this cache's newest slot; its older slots go invalid.
        Only the adopted slots are written: the older ones keep what earlier sequences of
        the row left, which a step may attend over masked, and a probability of exactly 0
        times a finite value adds exactly 0 (a row whose sequence went non-finite was
        `scrub`bed when it left); slots past the newest are written by each step before
        it reads them."""
        self.settle()
        src.settle()
        dst, frm = slice(self.filled - length, self.filled), slice(src.filled - length, src.filled)
        for mine, theirs in ((self.keys, src.keys), (self.values, src.values)):
            for a, b in zip(mine, theirs):
                a[dst, row] = b[frm, src_row]
        self.valid[row] = False
        self.valid[row, dst] = src.valid[src_row, frm]
        self.chains[row] = src.chains[src_row]

    def mark_prefix(self, chains: list) -> None:
        """Which shared segments each row starts from (its sequence's chain)."""
        self.chains[:len(chains)] = list(chains)

    def segments(self) -> list:
        """The segments the computed rows read, each once, in the order first met."""
        return list({id(p): p for chain in self.chains[:self.rows] for p in chain}.values())

    def prefix_mask(self) -> torch.Tensor | None:
        """[rows, columns of `segments()` side by side]: True where a computed row reads that
        segment; None when every row reads every one (or there are none)."""
        layout = self.segments()
        reads = torch.tensor([[any(p is q for q in chain) for p in layout] for chain in self.chains[:self.rows]],
                             dtype=torch.bool).reshape(self.rows, len(layout))
        if not layout or bool(reads.all()):
            return None
        return reads.repeat_interleave(torch.tensor([p.length for p in layout]), dim=1)

    def with_prefix_columns(self, masks: dict, new_tokens: int) -> dict:
        """A step's masks, widened by the shared segments' columns first where the computed rows
        do not all read every one (`layers.attend_shared` masks the others' columns)."""
        reads = self.prefix_mask()
        if reads is None:
            return masks
        head = reads[:, None, None, :].expand(-1, 1, new_tokens, -1)
        return {w: torch.cat([head, m], dim=-1) for w, m in masks.items()}

    def scrub(self, row: int) -> None:
        """Zero row `row`'s slots in every layer: its sequence went non-finite, and a later
        one in this row may attend over them masked (0 times NaN is NaN)."""
        self.settle()
        for t in self.keys + self.values:
            t[:, row] = 0

    def reset(self, rows: int) -> None:
        """Empty again, for `rows` new prompts (a newcomer cache used once more): the old
        slots stay, since a prefill writes every slot before a step reads it."""
        self.settle()
        self.valid.zero_()
        self.filled = self.new = self.first = 0
        self.old_slots, self._columns, self.stored = None, {}, {}
        self.use_rows(rows)

    def release(self) -> None:
        """Drop the cache's tensors, before its budget account is given back (so the account
        never says less than what is alive)."""
        self.keys, self.values = [], []

    # ---- device-resident use ------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, buf=None):
        """Store this step's k, v [B, kvh, T, D]; return every key/value attended over, as
        [B, kvh, slots, D]. `buf` is the (keys, values, offset) slot-major device buffer from
        `load` when the cache lives on the host."""
        if buf is None:
            keys, values, offset = self.keys[layer][:, :self.rows], self.values[layer][:, :self.rows], self.filled
        else:
            keys, values, offset = buf
        end = offset + k.shape[2]
        keys[offset:end] = k.permute(2, 0, 1, 3)
        values[offset:end] = v.permute(2, 0, 1, 3)
        if buf is None and self.old_slots is not None:
            cols = self.step_columns(keys.device)
            return _heads(keys.index_select(0, cols)), _heads(values.index_select(0, cols))
        start = self.first if buf is None else 0  # a loaded buffer starts at the first slot
        return _heads(keys[start:end]), _heads(values[start:end])

    # ---- host-tier moves (run on channels) ----------------------------------------------
    def _bytes(self, slots: int) -> int:
        k, v = self.keys[self.kv_layer], self.values[self.kv_layer]  # [capacity, B, kv_heads, dim]: a row's slot
        return slots * self.rows * (k.shape[2] * k.shape[3] + v.shape[2] * v.shape[3]) * k.element_size()

    def step_nbytes(self) -> int:
        """Device bytes of one layer's loaded buffer for this step."""
        return self._bytes(self.step_slots())

    def prefix_nbytes(self) -> int:
        """Bytes a load moves: the old slots this step can see."""
        return self._bytes(self._old_count())

    def new_nbytes(self) -> int:
        return self._bytes(self.new)

    def load(self, layer: int, device):
        """Slot-major device buffer with the visible old slots of `layer`, and room for this
        step's tokens. On CUDA every copy reads page-locked memory, contiguous: the host
        slots themselves when they are one block (all the rows, no sparsity), else a staging
        ring they are gathered into; on a CPU "device" one copy straight from the slots."""
        old = self._old_count()
        k, v = self.keys[layer][:, :self.rows], self.values[layer][:, :self.rows]
        keys = torch.empty((old + self.new, *k.shape[1:]), dtype=k.dtype, device=device)
        values = torch.empty((old + self.new, *v.shape[1:]), dtype=v.dtype, device=device)
        staging = self.staging
        for dst, src in ((keys[:old], k), (values[:old], v)):
            part = src[self.first:self.filled] if self.old_slots is None else None
            if staging is None:
                if part is None:
                    torch.index_select(src, 0, self.old_slots, out=dst)
                else:
                    dst.copy_(part)
            elif part is not None and part.is_contiguous():
                upload(dst, part)  # stream-ordered behind the last store (the channel waits on it)
            else:
                self.landed(layer)  # the host reads these slots now: the last store must have landed
                staging.gather(dst, src if part is None else part, self.old_slots, send=upload)
        return keys, values, old

    def store(self, layer: int, buf) -> None:
        """Copy this step's new slots of `layer` from the device buffer back home (contiguous)."""
        keys, values, offset = buf
        new, src = slice(self.filled, self.filled + self.new), slice(offset, offset + self.new)
        self.keys[layer][new, :self.rows].copy_(keys[src], non_blocking=True)
        self.values[layer][new, :self.rows].copy_(values[src], non_blocking=True)
