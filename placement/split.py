"""The device's resident expert slots divided among layers by what each layer's hits are worth
(AdapMoE's adaptive caching), instead of evenly.

A layer's hit curve is what its k most picked experts, resident, save per step, for k = 0..E
(from the routing a learned correlation table saw: prefetch/correlate.learned_routing): each
expert is worth the chance that a step's `tokens` (the plan's rows a layer routes at once) use
it, since a used expert not resident is one transfer; for one token with top-1 routing that is
its share of the layer's picks (AdapMoE's hit rate). A layer whose picks crowd onto few experts
gains little from a tenth resident expert; a layer that spreads them gains a lot. A step of many
tokens uses nearly every expert, whatever its share: then every layer's curve is nearly a line
and the division stays near even. `divide_slots` gives each layer its count so that the expected hits,
summed over layers, are the largest any division of the same total reaches (a dynamic program
over layers and slots); ties go to the most even division, so uniform routing keeps the even
split. Only device and host slots trade between layers (each layer's disk count stays as
planned): the same number of experts stay resident, so the same bytes.
"""
from __future__ import annotations

import numpy as np

from placement.placement import Placement
from placement.tiers import DEVICE, DISK, HOST

# A tie-break far below any difference of measured hit shares: among divisions with equal hits,
# the one with the smallest sum of squared counts (the most even) wins.
EVEN_TIE = 1e-12


def use_chance(row, tokens: int = 1, top_k: int = 1) -> np.ndarray:
    """Per expert of a layer (`row`: its picks counted per expert), the chance a step of `tokens`
    tokens, each routed to `top_k` experts, uses it: 1 - (1 - min(1, top_k * share))^tokens, its
    share of the picks for one token at top-1. A layer with no picks counted is taken as uniform."""
    row = np.asarray(row, dtype=np.float64)
    total = row.sum()
    share = row / total if total > 0 else np.full(len(row), 1.0 / len(row))
    return 1.0 - (1.0 - np.minimum(1.0, top_k * share)) ** max(1, int(tokens))


def hit_curves(picks, tokens: int = 1, top_k: int = 1) -> list[np.ndarray]:
    """Per layer (rows of `picks`), the transfers its k most used experts, resident, save a step
    of `tokens` tokens (use_chance summed), k = 0..E."""
    return [np.concatenate([[0.0], np.cumsum(np.sort(use_chance(row, tokens, top_k))[::-1])]) for row in picks]


def divide_slots(curves, total: int) -> list[int]:
    """Counts per layer, each at most its curve's last index and summing to `total` (or to every
    slot there is, if fewer), maximising the sum of curves[l][counts[l]]. Dynamic program: best[s]
    after layers 0..l is the most hits s slots give them; O(layers x total x slots a layer), each
    layer one numpy pass per count it may take."""
    caps = [len(c) - 1 for c in curves]
    total = max(0, min(int(total), sum(caps)))
    best = np.full(total + 1, -np.inf)
    best[0] = 0.0
    choices = []
    for curve, cap in zip(curves, caps):
        value = np.asarray(curve, dtype=np.float64) - EVEN_TIE * np.arange(cap + 1) ** 2
        new, pick = np.full(total + 1, -np.inf), np.zeros(total + 1, dtype=np.int64)
        for k in range(min(cap, total) + 1):
            cand = np.full(total + 1, -np.inf)
            cand[k:] = best[:total + 1 - k] + value[k]
            better = cand > new
            new[better], pick[better] = cand[better], k
        best = new
        choices.append(pick)
    counts, s = [], total
    for pick in reversed(choices):
        counts.append(int(pick[s]))
        s -= counts[-1]
    return counts[::-1]


def expected_hits(curves, counts) -> float:
    """The hits (summed shares) a division gives."""
    return float(sum(c[k] for c, k in zip(curves, counts)))


def divide_experts(placement: Placement, picks, layers, tokens: int = 1, top_k: int = 1) -> Placement:
    """`placement` with its resident experts divided among `layers` (the MoE layers, in the order
    of `picks`' rows) by divide_slots over their hit curves at `tokens` tokens a step: layer l
    keeps its counts[l] most picked experts on the device, its least picked as many on disk as
    `placement` had there (the disk reads each layer waits for stay as planned), the rest on the
    host. Only device and host slots trade between layers: each tier holds as many experts as
    before, so as many bytes (a layer's experts are alike)."""
    picks = np.asarray(picks, dtype=np.float64)
    experts = {layer: sorted(k[2] for k in placement.tiers if k[0] == "expert" and k[1] == layer) for layer in layers}
    on_disk = {layer: sum(1 for e in experts[layer] if placement.tiers["expert", layer, e] == DISK) for layer in layers}
    on_device = sum(1 for layer in layers for e in experts[layer] if placement.tiers["expert", layer, e] == DEVICE)
    rows = [picks[i][experts[layer]] for i, layer in enumerate(layers)]
    curves = [c[:len(c) - on_disk[layer]] for c, layer in zip(hit_curves(rows, tokens, top_k), layers)]
    counts = divide_slots(curves, on_device)
    tiers = dict(placement.tiers)
    for row, layer, k in zip(rows, layers, counts):
        order = np.argsort(-use_chance(row), kind="stable")  # by picks: ties of a full chance kept apart
        host_end = len(order) - on_disk[layer]
        for rank, i in enumerate(order):
            tiers["expert", layer, experts[layer][i]] = DEVICE if rank < k else HOST if rank < host_end else DISK
    return Placement(tiers, placement.kv)


def resident_hit_rates(routed, resident) -> list[float | None]:
    """Per layer, the share of its routed picks (`routed[l][e]`) that found their expert resident
    (`resident[l][e]` true); None for a layer nothing was routed to."""
    routed = np.asarray(routed, dtype=np.float64)
    hits = (routed * np.asarray(resident, dtype=bool)).sum(axis=1)
    totals = routed.sum(axis=1)
    return [round(float(h / t), 4) if t else None for h, t in zip(hits, totals)]
