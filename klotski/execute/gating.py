"""Adaptive gating (AdapMoE, issue 64; `--adaptive-gating`): a token whose top-1 router weight
dominates its layer's threshold skips its other experts, so they are neither loaded nor
computed for it. Off by default: without it the routing is the family's, exact.

The family's `route` stays pure; this is a step after it, on the device. A skipped pair keeps
its place in the [N, k] routing (the top-k slots stay [N, k]) with weight 0 and expert id
`E + e` (E = the layer's experts): the sort by expert puts it after every real expert, so no
wave, count, load or host compute sees it, and the host still reads which expert it skipped
(`skipped_experts`) from the one routing read. Its slot is zeroed before the slots are summed
(a wave's rows past its last pair may write there). The kept weight is renormalised to the
row's whole top-k mass (`w_top * sum(w) / w_top`): for a family that normalises its top-k
weights (Mixtral) that is weight 1, the top-1 model's own output; for one that does not, the
token's MoE output keeps its scale.

A threshold is the top-1 share (w_top / sum(w)) at or above which the others are skipped; one
per MoE layer, from its sensitivity (klotski/schedule/gating.py calibrates them). While
recording (thresholds None: the calibration's exact run), every token's share and the
perturbation skipping would have made are kept per layer instead."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch


class AdaptiveGating:
    """Per-MoE-layer thresholds applied to a layer's routing, and what they saved."""

    def __init__(self, thresholds: list[float] | None):
        self.thresholds = thresholds  # None: record only (exact routing)
        self.pairs = 0                # routed (token, expert) pairs, before skipping
        self.skipped = 0              # of those, skipped
        self.experts_not_loaded = 0   # (layer, expert) demand loads only skipped pairs wanted
        self.bytes_not_loaded = 0     # their bytes
        # recording: per MoE layer, [shares], [relative perturbations] of every routed token
        self.shares: dict[int, list] = {}
        self.costs: dict[int, list] = {}
        self.calibration: dict | None = None  # how the thresholds were found (schedule/gating.py), for the report

    @property
    def recording(self) -> bool:
        return self.thresholds is None

    def apply(self, routed, moe_layer: int, num_experts: int):
        """`routed` (execute/experts.Routed) with this layer's dominated tokens' other pairs
        skipped: weight 0, expert id + num_experts, the kept weight renormalised; the same
        object while recording."""
        if self.recording or routed.weights.shape[1] < 2:
            return routed
        w = routed.weights
        total = w.sum(dim=1, keepdim=True)
        top = w.argmax(dim=1, keepdim=True)
        first = torch.zeros_like(w, dtype=torch.bool).scatter_(1, top, True)
        skip = (w.gather(1, top) >= self.thresholds[moe_layer] * total) & ~first
        kept = torch.where(skip, torch.zeros_like(w), w)
        # rows that skip nothing keep their weights bit for bit
        weights = torch.where(skip.any(dim=1, keepdim=True), kept * (total / kept.sum(dim=1, keepdim=True)), w)
        experts = torch.where(skip, routed.experts + num_experts, routed.experts)
        return dataclasses.replace(routed, weights=weights, experts=experts, skipped=skip)

    def count(self, ids: torch.Tensor, num_experts: int) -> np.ndarray:
        """Count a layer's routing as read on the host; the experts only skipped pairs chose."""
        flat = ids.numpy().ravel()
        self.pairs += flat.size
        skipped = flat >= num_experts
        self.skipped += int(skipped.sum())
        return np.setdiff1d(flat[skipped] - num_experts, flat[~skipped])

    def not_loaded(self, nbytes: int) -> None:
        """An expert no kept pair wanted, not on the device nor on its way: a load saved."""
        self.experts_not_loaded += 1
        self.bytes_not_loaded += nbytes

    def record(self, moe_layer: int, moe, hs: list[torch.Tensor]) -> None:
        """While recording, after the layer's experts (`moe`: execute/experts.LayerExperts) and
        before their sum: each routed token's top-1 share and how far skipping its other experts
        would have moved its hidden state, relative to it (||O' - O||² / ||h||², O the MoE
        output, O' the top-1 expert's renormalised), both kept on the host."""
        slots, w = moe.slots, moe.routed.weights.float()
        if w.shape[1] < 2:
            return
        residual = torch.cat([h.reshape(-1, h.shape[-1]) if k is None else h.reshape(-1, h.shape[-1]).index_select(0, k)
                              for h, k in zip(hs, moe.routed.keeps)])
        total = w.sum(dim=1)
        top = w.argmax(dim=1)
        rows = torch.arange(len(w), device=w.device)
        out = slots.float().sum(dim=1)
        alone = slots[rows, top].float() * (total / w[rows, top])[:, None]
        cost = (alone - out).pow(2).sum(dim=1) / residual.float().pow(2).sum(dim=1).clamp_min(1e-12)
        self.shares.setdefault(moe_layer, []).append((w[rows, top] / total).cpu().numpy())
        self.costs.setdefault(moe_layer, []).append(cost.cpu().numpy())

    def report(self) -> dict:
        return {"pairs": self.pairs, "pairs_skipped": self.skipped,
                "skipped_share": round(self.skipped / self.pairs, 4) if self.pairs else 0.0,
                "experts_not_loaded": self.experts_not_loaded, "link_bytes_not_loaded": self.bytes_not_loaded,
                "calibration": self.calibration}


def exact_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The routing before skipping (a skipped pair's id back to its expert): what the predictors learn."""
    return torch.where(ids >= num_experts, ids - num_experts, ids)
