"""The tensor work of a step's MoE phase, apart from its schedule (pipeline.py), for every
batch of a group at once: the batches' real tokens routed together, one sort by expert, and
experts computed in *waves*: every expert whose weights are on the device in one grouped call
(models/grouped.py: gather, up/gate, activation, down, router weight, scatter into the top-k
slots), a handful of kernels whatever the number of experts or batches (a GPU launches a
kernel per op; docs/benchmarks.md has the count). Outputs wait in their slots and are summed
in slot order, so the order, the grouping (and the place: device or host) experts compute in
never changes a bit of the result."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from klotski.models import layers as L
from klotski.models.grouped import Groups, runs_grouped, wave_runner
from planner.workingset import PREFILL_EXPERT_CHUNK


@dataclass
class Routed:
    """Router decisions of one layer for a group's real tokens, batch after batch."""
    x: torch.Tensor        # normalised MoE input [N, H] of every batch's real tokens
    weights: torch.Tensor  # [N, k] (fp32 or the activation dtype, as the family routes)
    experts: torch.Tensor  # [N, k]
    shared: torch.Tensor | None  # the shared expert's output [N, H], for families with one
    sizes: list[int]       # each batch's real tokens (their rows of x, in order)
    keeps: list            # per batch, which of its B*T tokens are real (None: all of them)
    weigh_inputs: bool = False  # the weights scale each expert's input, not its output (Llama 4)
    skipped: torch.Tensor | None = None  # [N, k] pairs adaptive gating skipped (execute/gating.py)


def route_group(family, spec, hs: list[torch.Tensor], gate: dict, keeps: list, shared: bool = True) -> Routed:
    """The router's choice for every batch's real tokens at once and, where the family has one,
    the shared expert's output (it lives in the gate group, so it computes while that is held;
    batch by batch, as the activation reserve counts it). Left padding is not routed: a padded
    prefill computes no expert (nor loads one) for tokens nobody reads, and the predictor
    learns from real tokens only."""
    parts = []
    for h, keep in zip(hs, keeps):
        x = h.reshape(-1, h.shape[-1])
        parts.append(x if keep is None else x.index_select(0, keep))
    sizes = [len(p) for p in parts]
    x = L.rms_norm(torch.cat(parts) if len(parts) > 1 else parts[0], gate["post_norm"], spec.rms_norm_eps,
                    spec.norm_offset)
    weights, experts = family.route(x, gate, spec)
    out = None
    if shared:
        pieces = [family.shared_ffn(p, gate, spec) for p in x.split(sizes)]
        out = None if pieces[0] is None else torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return Routed(x, weights, experts, out, sizes, list(keeps), spec.weigh_expert_inputs)


def real_tokens(valid: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of a step's real (not left-padding) tokens, on the host where `valid` is
    (the pipeline sends them up through pinned memory); None when all are real (decode)."""
    if bool(valid.all()):
        return None
    return valid.flatten().nonzero().flatten()


def pairs_per_expert(ids: torch.Tensor, num_experts: int) -> np.ndarray:
    """How many of the (token, slot) pairs each expert takes, counted from the ids on the host
    (an id past the experts is a pair adaptive gating skipped: execute/gating.py)."""
    return np.bincount(ids.numpy().ravel(), minlength=num_experts)[:num_experts]


@dataclass
class SortKeys:
    """Where each expert's pairs go in a layer's sort: its resident experts (the rows of its
    stack, in id order) first, then the others in id order, so the resident ones' pairs lead
    the sort and a wave over them needs no count from the host. `rank` maps expert -> key
    (None: the identity, when every expert or none is resident); `bounds` = 0..resident-1,
    both on the device."""
    resident: int
    rank_host: np.ndarray | None
    rank: torch.Tensor | None
    bounds: torch.Tensor
    experts: np.ndarray | None = None  # the stack's experts, row by row (on the host)

    @classmethod
    def of(cls, stack_experts: list[int], num_experts: int, upload) -> "SortKeys":
        n = len(stack_experts)
        rank = None
        if 0 < n < num_experts:
            rank = np.full(num_experts, -1, dtype=np.int64)
            rank[stack_experts] = np.arange(n)
            others = rank < 0
            rank[others] = np.arange(n, num_experts)
        # on the device, ids past the experts (pairs adaptive gating skipped) keep their order after them
        device_rank = None if rank is None else np.concatenate([rank, np.arange(num_experts, 2 * num_experts)])
        return cls(n, rank, None if rank is None else upload(torch.from_numpy(device_rank)),
                   upload(torch.arange(n, dtype=torch.int64)), np.asarray(stack_experts, dtype=np.int64))


class LayerExperts:
    """The expert phase of one layer over a group: the top-k slots the outputs wait in, and
    which of the group's routed tokens each expert takes (a contiguous range of one sort).
    Made from the routing on the device; `count` adds the host's side once the ids are there."""

    def __init__(self, routed: Routed, top_k: int, keys: SortKeys | None = None):
        self.routed, self.k, self.keys = routed, top_k, keys
        self.slots = L.slots(len(routed.x), top_k, routed.x, routed.weights)
        flat = routed.experts.flatten()
        rank = None if keys is None else keys.rank
        # flat (token·k + slot) positions in key order (expert order, resident experts first),
        # token order within an expert (what `torch.where(experts == e)` gives, for every e at once)
        self._keys, self._order = torch.sort(flat if rank is None else rank.index_select(0, flat), stable=True)
        self._tokens = self._order // top_k
        self._weights = routed.weights.flatten().index_select(0, self._order)
        self.ids = self.counts = self.chosen = None
        self.resident_done = False  # the resident experts' wave ran before the ids reached the host

    def count(self, ids: torch.Tensor, num_experts: int) -> None:
        """The host's side, from the routing ids on the host: pairs per expert, the chosen
        experts, where each one's run of the sort starts."""
        counts = pairs_per_expert(ids, num_experts)
        self.ids, self.counts, self.chosen = ids, counts.tolist(), np.flatnonzero(counts).tolist()
        rank = None if self.keys is None else self.keys.rank_host
        by_key = np.arange(num_experts) if rank is None else np.argsort(rank)
        self._first = np.empty(num_experts, dtype=np.int64)
        self._first[by_key] = np.cumsum(counts[by_key]) - counts[by_key]
        self._counts = counts.astype(np.int64)

    def resident_wave(self, ffn, stack, upload) -> None:
        """The layer's resident experts in one wave over their stack (placement.cache.ExpertStack):
        before the routing ids reach the host (`run_resident`), or from the host counts where
        they are in already (the grouped kernel does not run here: its fallback needs them)."""
        if self.counts is None:
            self.run_resident(ffn, stack.tensors)
        else:
            self.run_wave(ffn, stack.tensors, stack.experts, upload)

    def run_resident(self, ffn, w: dict) -> None:
        """The resident experts (keys 0..R-1, the rows of w's stacks) over their pairs, which lead
        the sort, with no count from the host: the groups' ends are found in the sorted keys on
        the device, so this launches before the routing ids reach the host and nothing here
        waits for the device. A token picks an expert once, so they take at most
        tokens·min(k, R) pairs: that many rows are computed, in calls of the group's tokens as
        run_wave's; rows past the last resident pair compute to nothing anyone reads (their
        slots belong to experts computed in a later wave, which overwrites them).

        On a CPU the routing ids are on the host already (no device to run ahead of them):
        the resident experts' pairs are counted from them as `count` does and the wave runs as
        run_wave's, each call over only the run of experts its rows reach (every call over the
        whole stack passed ~900 empty groups a decode layer on 128 experts: issue 60)."""
        keys = self.keys
        n = len(self.routed.x)
        if self._keys.device.type == "cpu" and keys.experts is not None:
            num_experts = keys.resident if keys.rank_host is None else len(keys.rank_host)
            counts = pairs_per_expert(self.routed.experts, num_experts)[keys.experts]
            picks = slice(0, int(counts.sum()))
            self._calls(ffn, w, counts, self._order[picks], self._tokens[picks], self._weights[picks], lambda t: t)
            self.resident_done = True
            return
        total = n * min(self.k, keys.resident)
        ends = torch.searchsorted(self._keys, keys.bounds, right=True, out_int32=True)
        flat, step = self.slots.view(-1, self.slots.shape[-1]), min(n, PREFILL_EXPERT_CHUNK)
        # every call's offsets at once: its groups' ends less its first row, within its rows (the
        # last call's rows run to `total`, past every resident pair, so `step` bounds it too)
        starts = torch.arange(0, total, step, dtype=torch.int32, device=ends.device)
        offsets = (ends[None, :] - starts[:, None]).clamp_(0, step)
        for call, start in enumerate(range(0, total, step)):
            stop = min(start + step, total)
            x = self._input(self._tokens[start:stop], self._weights[start:stop])
            y = ffn(x, w, Groups(None, offsets[call]))
            flat.index_copy_(0, self._order[start:stop], self._output(y, self._weights[start:stop]))
        self.resident_done = True

    def run_wave(self, ffn, w: dict, experts, upload) -> None:
        """`ffn` (the family's grouped expert FFN) over the tokens of `experts`, whose weights are
        the rows of `w`'s stacked tensors in that order (-1, or an expert no token chose, is an
        empty group); outputs into their slots. One call takes at most as many pairs as the
        group has tokens (and PREFILL_EXPERT_CHUNK): no more than one expert's call could hold,
        so the activation reserve (planner.workingset) bounds a wave as it bounded an expert.
        `upload` moves a small host tensor to the device (the row index, the group offsets)."""
        ids = np.asarray(experts, dtype=np.int64)
        counts = np.where(ids >= 0, self._counts[ids], 0)
        total = int(counts.sum())
        if total == 0:
            return
        first = self._first[ids[counts > 0]]
        if bool(np.all(first[1:] == first[:-1] + counts[counts > 0][:-1])):
            # one run of the sorted pairs (experts in id order with none between): views, no gather
            picks = slice(int(first[0]), int(first[0]) + total)
            order, tokens, weights = self._order[picks], self._tokens[picks], self._weights[picks]
        else:  # each expert's run of the sorted pairs, in the wave's order
            rows = np.repeat(self._first[ids] - np.cumsum(counts) + counts, counts) + np.arange(total)
            rows = upload(torch.from_numpy(rows))
            order, tokens, weights = (t.index_select(0, rows) for t in (self._order, self._tokens, self._weights))
        self._calls(ffn, w, counts, order, tokens, weights, upload)

    def _calls(self, ffn, w: dict, counts: np.ndarray, order, tokens, weights, upload) -> None:
        """A wave's calls over its pairs (`order`, `tokens`, `weights`: the wave's run of the
        sort, expert after expert, `counts` pairs each in the order of w's rows)."""
        total = int(counts.sum())
        ends, flat = np.cumsum(counts), self.slots.view(-1, self.slots.shape[-1])
        per_group = not runs_grouped(self.routed.x.device.type, self.routed.x.dtype)
        calls = call_rows(counts, min(len(self.routed.x), PREFILL_EXPERT_CHUNK), per_group)
        wave = None if self.routed.weigh_inputs else wave_runner(ffn, self.routed.x, w)
        if wave is not None:  # the whole wave in one go (fp32 SwiGLU experts on a CPU: models/grouped.py)
            wave(self.routed.x, counts, calls, tokens, order, weights, flat)
            return
        for start, stop in calls:
            part = np.clip(ends, start, stop) - np.clip(ends - counts, start, stop)
            # the call's rows span a run of groups: only their weights (views) and offsets go in
            lo, hi = int(np.argmax(ends > start)), int(np.searchsorted(ends, stop, side="left")) + 1
            part = part[lo:hi]
            offsets = upload(torch.from_numpy(np.cumsum(part, dtype=np.int64).astype(np.int32)))
            whole = start == 0 and stop == total
            x = self._input(tokens if whole else tokens[start:stop], weights if whole else weights[start:stop])
            ws = w if lo == 0 and hi == len(counts) else {n: t[lo:hi] for n, t in w.items()}
            y = ffn(x, ws, Groups(part.tolist(), offsets))
            rows = slice(start, stop)
            flat.index_copy_(0, order if whole else order[rows], self._output(y, weights if whole else weights[rows]))

    def picks(self, e: int) -> slice:
        """Expert `e`'s range of the sorted (token, slot) pairs."""
        first = int(self._first[e])
        return slice(first, first + int(self._counts[e]))

    def tokens(self, picks: slice) -> torch.Tensor:
        """Indices into the group's routed tokens of the picked pairs (for tests and tools)."""
        return self._tokens[picks]

    def inputs(self, picks: slice) -> torch.Tensor:
        """The picked tokens of every batch: one matmul over them shares the expert's weight
        n·bs ways."""
        return self._input(self._tokens[picks], self._weights[picks])

    def put(self, picks: slice, y: torch.Tensor) -> None:
        """The expert's outputs y of the picked tokens into their slots, times their router weight."""
        flat = self.slots.view(-1, self.slots.shape[-1])
        flat.index_copy_(0, self._order[picks], self._output(y, self._weights[picks]))

    def _input(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed tokens as an expert takes them: as they are, or scaled by their router weight
        where it weighs the input (Routed.weigh_inputs)."""
        x = self.routed.x.index_select(0, tokens)
        return x * weights[:, None] if self.routed.weigh_inputs else x

    def _output(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """An expert's outputs as their slots hold them: times their router weight, unless it
        weighed the input."""
        return y if self.routed.weigh_inputs else y * weights[:, None]

    def hidden_states(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each batch's hidden states after the layer: its slots summed in top-k order plus the
        shared expert's output, added to the residual."""
        r = self.routed
        if r.skipped is not None:  # a skipped pair's slot: a resident wave's rows past its last pair may write there
            self.slots.masked_fill_(r.skipped[..., None], 0)
        out = L.combine(self.slots, hs[0].dtype, r.shared)
        parts = out.split(r.sizes) if len(hs) > 1 else (out,)
        return [residual(h, o, keep) for h, o, keep in zip(hs, parts, r.keeps)]


def call_rows(counts: np.ndarray, step: int, whole_experts: bool = True) -> list[tuple[int, int]]:
    """A wave's calls as row ranges of at most `step` rows over its experts' runs (`counts`, in
    the wave's order). `whole_experts`: cut only between experts or where an expert's own rows
    reach a multiple of `step`, so each expert's products are the same (the pieces `run_expert`
    takes) whichever experts share its wave: a GPU picks a product's kernel, and so its bits, by
    its rows, and waves differ with the placement (resident stack, landing stacks). That is for
    the per-group products (fp32 on a GPU: models/grouped.py); one grouped kernel a call, whose
    bits are not promised across placements (16-bit), takes the fewest calls: every `step` rows."""
    if not whole_experts:
        total = int(counts.sum())
        return [(start, min(start + step, total)) for start in range(0, total, step)]
    pieces = [c for c in counts.tolist() if c]
    if pieces and max(pieces) > step:  # an expert over one call's rows: cut within it at multiples of step
        pieces = [p for c in pieces for p in [step] * (c // step) + ([c % step] if c % step else [])]
    ends = list(accumulate(pieces))
    calls, start, total = [], 0, ends[-1] if ends else 0
    while start < total:  # each call: the most whole pieces from `start` that fit in `step` rows
        stop = ends[bisect_right(ends, start + step) - 1]
        calls.append((start, stop))
        start = stop
    return calls


def run_expert(expert_ffn, x: torch.Tensor, w: dict) -> torch.Tensor:
    """`expert_ffn` over tokens x in PREFILL_EXPERT_CHUNK pieces, so a long prefill does not
    blow the activation reserve."""
    if len(x) <= PREFILL_EXPERT_CHUNK:
        return expert_ffn(x, w)
    return torch.cat([expert_ffn(c, w) for c in x.split(PREFILL_EXPERT_CHUNK)])


def residual(h: torch.Tensor, moe_out: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """h plus the MoE output of its real tokens; padding keeps h (its keys are masked out, and
    its own row is never read)."""
    if keep is None:
        return h + moe_out.view_as(h)
    flat = h.reshape(-1, h.shape[-1])
    return flat.index_copy(0, keep, flat.index_select(0, keep) + moe_out).view_as(h)


def first_broken(broken: torch.Tensor, layer: int, h: torch.Tensor) -> torch.Tensor:
    """Record `layer` for sequences whose hidden states [B, T, H] turned non-finite here. It
    stays on the device and travels with the logits, so the check adds no host sync."""
    # the largest magnitude of a row is inf or NaN exactly when one of its values is (amax keeps
    # NaN): half the cost of isfinite over every value on a CPU in bf16
    bad = ~torch.isfinite(h.flatten(1).abs().amax(dim=1))
    return torch.where((broken < 0) & bad, layer, broken)
