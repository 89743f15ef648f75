"""The tensor work of a step's MoE phase, apart from its schedule (pipeline.py): routing a
batch's real tokens, gathering each expert's tokens from every batch of a group, running an
expert over them in chunks, and putting its outputs into their top-k slots. The outputs
wait in their slots and are summed in slot order at the end, so the order (and the place:
device or host) experts compute in never changes a bit of the result."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from klotski.models import layers as L
from planner.workingset import PREFILL_EXPERT_CHUNK


@dataclass
class Routed:
    """Router decisions of one batch at one layer, flattened over its B*T tokens."""
    x: torch.Tensor        # normalised MoE input [N, H] of the batch's real tokens
    weights: torch.Tensor  # [N, k] (fp32 or the activation dtype, as the family routes)
    experts: torch.Tensor  # [N, k]
    shared: torch.Tensor | None  # the shared expert's output [N, H], for families with one
    chosen: torch.Tensor | None = None  # `experts` on the host (one copy per layer for all batches)
    keep: torch.Tensor | None = None    # which of the B*T tokens are real (None: all of them)


def route_batch(family, spec, h: torch.Tensor, gate: dict, keep: torch.Tensor | None,
                shared: bool = True) -> Routed:
    """The router's choice for one batch's real tokens and, where the family has one, the
    shared expert's output (it lives in the gate group, so it computes while that is held).
    Left padding is not routed: a padded prefill computes no expert (nor loads one) for
    tokens nobody reads, and the predictor learns from real tokens only."""
    x = h.reshape(-1, h.shape[-1])
    if keep is not None:
        x = x.index_select(0, keep)
    x = L.rms_norm(x, gate["post_norm"], spec.rms_norm_eps)
    return Routed(x, *family.route(x, gate, spec), family.shared_ffn(x, gate, spec) if shared else None, keep=keep)


def real_tokens(valid: torch.Tensor, device) -> torch.Tensor | None:
    """Flat indices of a step's real (not left-padding) tokens; None when all are real (decode)."""
    if bool(valid.all()):
        return None
    return valid.flatten().nonzero().flatten().to(device)


def ids_on_host(experts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Expert ids of several batches on the host, in one copy (one sync on CUDA)."""
    flat = torch.cat([e.flatten() for e in experts]).cpu()
    return [part.view(e.shape) for part, e in zip(flat.split([e.numel() for e in experts]), experts)]


def chosen_experts(routed: list[Routed]) -> list[int]:
    """The experts any batch of the group chose, in id order (from the host copies)."""
    return sorted(set(torch.cat([r.chosen.flatten() for r in routed]).tolist()))


def tokens_by_expert(r: Routed, num_experts: int):
    """`pick(e)`: the (token, slot) pairs of one batch routed to expert `e`, in token order,
    as device indices (what `torch.where(experts == e)` gives) without a host sync per
    expert: one stable sort on the device, counts from the host copy of the ids."""
    k = r.experts.shape[1]
    order = torch.argsort(r.experts.flatten(), stable=True)
    counts = torch.bincount(r.chosen.flatten(), minlength=num_experts).tolist()
    starts = [0, *accumulate(counts)]

    def pick(e: int):
        flat = order[starts[e]:starts[e + 1]]
        return flat // k, flat % k

    return pick


class LayerExperts:
    """The expert phase of one layer over every batch of a group: the batches' routed tokens,
    the top-k slots their expert outputs wait in, and which of them each expert takes."""

    def __init__(self, routed: list[Routed], top_k: int, num_experts: int):
        self.routed = routed
        self.slots = [L.slots(len(r.x), top_k, r.x, r.weights) for r in routed]
        self.chosen = chosen_experts(routed)
        self._pickers = [tokens_by_expert(r, num_experts) for r in routed]

    def picks(self, e: int) -> list:
        """Expert `e`'s (token, slot) pairs of each batch."""
        return [pick(e) for pick in self._pickers]

    def inputs(self, picks) -> torch.Tensor:
        """The picked tokens of every batch, one after the other: one matmul over all of them
        shares the expert's weight n*bs ways."""
        return torch.cat([r.x[tok] for r, (tok, _) in zip(self.routed, picks)])

    def put(self, picks, y: torch.Tensor) -> None:
        """The expert's outputs y of the picked tokens into their slots, times their router weight."""
        for r, out, (tok, slot), y_k in zip(self.routed, self.slots, picks, y.split([len(p[0]) for p in picks])):
            L.put_weighted(out, tok, slot, y_k, r.weights)

    def hidden_states(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each batch's hidden states after the layer: its slots summed in top-k order plus the
        shared expert's output, added to the residual."""
        return [residual(h, L.combine(out, h.dtype, r.shared), r.keep)
                for h, out, r in zip(hs, self.slots, self.routed)]


def run_expert(expert_ffn, x: torch.Tensor, w: dict) -> torch.Tensor:
    """`expert_ffn` over tokens x in PREFILL_EXPERT_CHUNK pieces, so a long prefill does not
    blow the activation reserve."""
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
    bad = ~torch.isfinite(h).flatten(1).all(dim=1)
    return torch.where((broken < 0) & bad, layer, broken)
