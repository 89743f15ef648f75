"""The recurrent-state cache kind: per batch, each linear-attention layer's fixed-size state
(Gated DeltaNet: the causal conv's last kernel - 1 inputs [B, conv channels, kernel - 1] in the
compute dtype, and the delta rule's matrix [B, value heads, key dim, value dim] in fp32). It sits
beside the attention kind (`BatchKV`, which then holds keys and values of the full-attention
layers only) in the same cache: the `CacheManager` makes both, charges both to the KV tier's
budget (the state as a constant per row: it does not grow with the text) and applies every row
operation to each.

Row operations, as continuous batching and shared prefixes need them:
- adopt: a row takes another row's state (a newcomer prefilled elsewhere, a live row moved);
- scrub: a row's state zeroed (its sequence went non-finite);
- realign: nothing (a state has no slots);
- reset: every row zeroed (a spare cache used once more);
- mark_prefix: a row that starts from shared segments starts from the state at the end of its
  chain's last segment (that segment's row of its own cache: prefilled once, copied here).
Pads are identity steps in the math (models/gated_deltanet.py), so a row's state is its own
tokens' whatever the padding beside it.

On the host tier the state lives in host memory (page-locked blocks on CUDA: `host_zeros`) and a
linear layer's rows go up before its compute and back after it on the kv_load and kv_store
channels, as attention's keys and values do (`load`/`store`, the pipeline submits them);
`stored[layer]` is the last store's ticket, which the next load of that layer follows and every
row operation waits for (`settle`).
"""
from __future__ import annotations

import torch


class RecurrentState:
    """Rows' recurrent states of the linear-attention `layers` (a dict per layer: conv, matrix)."""

    def __init__(self, layers, batch: int, conv: tuple[int, int], matrix: tuple[int, int, int], dtype: torch.dtype,
                 *, device="cpu", on_host: bool = False, host_zeros=None):
        def plain(shape, dt):
            return torch.zeros(shape, dtype=dt, device="cpu" if on_host else device)
        zeros = host_zeros if on_host and host_zeros else plain
        self.on_host, self.dtype = on_host, dtype
        self.conv = {j: zeros((batch, *conv), dtype) for j in layers}
        self.matrix = {j: zeros((batch, *matrix), torch.float32) for j in layers}
        self.rows = batch
        self.filled = self.capacity = 0  # no slots: a state is the same size whatever it has read
        self.stored: dict = {}  # layer -> the ticket of its last store home (host tier)

    @staticmethod
    def nbytes_for(layers: int, batch: int, conv: tuple[int, int], matrix: tuple[int, int, int],
                   dtype: torch.dtype) -> int:
        """Every layer's state of `batch` rows (known before allocating): a constant per row."""
        return layers * sum(RecurrentState.tensor_nbytes(batch, conv, matrix, dtype))

    @staticmethod
    def tensor_nbytes(batch: int, conv: tuple[int, int], matrix: tuple[int, int, int],
                      dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of one layer's conv tensor and of its matrix tensor."""
        return batch * conv[0] * conv[1] * dtype.itemsize, batch * matrix[0] * matrix[1] * matrix[2] * 4

    @property
    def batch(self) -> int:
        return next(iter(self.matrix.values())).shape[0] if self.matrix else 0

    def layer_nbytes(self) -> int:
        """One layer's state of the computed rows: what goes up and back on the host tier."""
        if not self.matrix:
            return 0
        conv, matrix = next(iter(self.conv.values())), next(iter(self.matrix.values()))
        return self.rows * (conv[0].numel() * conv.element_size() + matrix[0].numel() * 4)

    # ---- a step -------------------------------------------------------------------------
    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The computed rows' (conv, matrix) of `layer`, where they live (the device tier)."""
        return self.conv[layer][:self.rows], self.matrix[layer][:self.rows]

    def put(self, layer: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The computed rows' new state of `layer`, written in place (the device tier)."""
        self.conv[layer][:self.rows].copy_(state[0])
        self.matrix[layer][:self.rows].copy_(state[1])

    def load(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The host tier's rows of `layer` on `device` (run on the kv_load channel, after the
        layer's last store): contiguous page-locked rows, so on CUDA the copies are
        asynchronous on the channel's stream; a CPU "device" reads the rows where they are."""
        conv, matrix = self.layer(layer)
        if torch.device(device).type == "cpu":
            return conv, matrix
        up = []
        for src in (conv, matrix):
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)
            dst.copy_(src, non_blocking=True)
            up.append(dst)
        return up[0], up[1]

    def store(self, layer: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The new state of `layer` home from the device (run on the kv_store channel, after
        the compute that made it)."""
        self.conv[layer][:self.rows].copy_(state[0], non_blocking=True)
        self.matrix[layer][:self.rows].copy_(state[1], non_blocking=True)

    # ---- row operations (caches.CacheKind) ----------------------------------------------
    def row_lengths(self) -> list[int]:
        return [0] * self.batch

    def use_rows(self, rows: int) -> None:
        self.rows = rows

    def adopt(self, row: int, src: "RecurrentState", src_row: int, length: int) -> None:
        """Row `row` takes `src`'s row `src_row` state (whatever `length` of its slots the
        attention kind moves: the state stands for them all)."""
        self.settle()
        src.settle()
        for mine, theirs in ((self.conv, src.conv), (self.matrix, src.matrix)):
            for j in mine:
                mine[j][row] = theirs[j][src_row]

    def scrub(self, row: int) -> None:
        self.settle()
        for t in (*self.conv.values(), *self.matrix.values()):
            t[row] = 0

    def realign(self, keep: int, filled: int, room=None) -> None:
        """Nothing moves: a state has no slots."""

    def reset(self, rows: int) -> None:
        self.settle()
        self.stored = {}
        for t in (*self.conv.values(), *self.matrix.values()):
            t.zero_()
        self.use_rows(rows)

    def mark_prefix(self, chains: list) -> None:
        """Each row with a chain of shared segments starts from the state at its last segment's
        end: that segment's row of its group's cache (`SegmentKV.kv.state`, settled when shared)."""
        for row, chain in enumerate(chains):
            if chain:
                last = chain[-1]
                self.adopt(row, last.kv.state, last.row, last.length)

    def settle(self) -> None:
        """Block until every store home has landed (before the host reads or rewrites a row)."""
        for ticket in self.stored.values():
            ticket.landed()

    def release(self) -> None:
        self.conv, self.matrix = {}, {}
