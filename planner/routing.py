"""Routing statistics: how often each expert is chosen, and samples of who chose what.

Two views of the same thing. *Marginals* m_e = P(a token selects expert e), summing to
top_k, are all the solver needs (expected tokens per expert, expected distinct experts).
The simulator needs *samples*: for one layer and one batch, how many tokens went to each
expert — drawn from a popularity distribution (Zipf-like, the hot-expert skew of the
paper's Figure 5).
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np


def zipf_weights(num_experts: int, skew: float, *, seed: int | None = None) -> list[float]:
    """First-choice weights ∝ 1/rank^skew (skew 0 = uniform), ranks permuted by `seed` so
    that different layers have different hot experts."""
    w = [1.0 / (r + 1) ** skew for r in range(num_experts)]
    if seed is not None:
        random.Random(seed).shuffle(w)
    s = sum(w)
    return [x / s for x in w]


def marginals_from_weights(weights: Sequence[float], top_k: int) -> list[float]:
    """Per-token selection probability of each expert when a token takes top_k distinct
    experts by successive draws ∝ weights (Plackett-Luce, which is what top-k of a noisy
    softmax amounts to). Exact by enumeration when small, else a seeded Monte Carlo."""
    E = len(weights)
    w = [max(0.0, float(x)) for x in weights]
    if top_k >= E:
        return [1.0] * E
    if E ** top_k <= 50_000:
        m = [0.0] * E
        for seq in itertools.permutations(range(E), top_k):
            p, left = 1.0, sum(w)
            for e in seq:
                if left <= 0:
                    p = 0.0
                    break
                p *= w[e] / left
                left -= w[e]
            for e in seq:
                m[e] += p
        return m
    rng = np.random.default_rng(0)
    draws = 20_000
    keys = np.log(np.maximum(np.asarray(w), 1e-300)) + rng.gumbel(size=(draws, E))
    top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return (np.bincount(top.ravel(), minlength=E) / draws).tolist()


def marginals_from_sample(tokens: Sequence[Sequence[int]], num_experts: int) -> list[float]:
    """Empirical marginals from a routing sample: one collection of expert ids per token."""
    counts = [0] * num_experts
    for chosen in tokens:
        for e in set(chosen):
            counts[e] += 1
    n = max(1, len(tokens))
    return [c / n for c in counts]


def marginals_from_counts(counts, top_k: int) -> list[float] | None:
    """Marginals in expert order from picks counted per layer and expert ([layers, experts]: a
    run's routing), each layer's as the share of its picks times top_k, averaged over the layers
    that routed anything; None where none did. (One vector for every layer, as the solver takes
    it: an expert's index is its place in the placement, so the order is kept.)"""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c.sum(axis=1) > 0]
    if not len(c):
        return None
    m = (c / c.sum(axis=1, keepdims=True) * top_k).mean(axis=0)
    return np.minimum(m, 1.0).tolist()  # a token picks an expert once: at most 1 (but for rounding)


class RoutingSample:
    """Per-layer routing for the simulator: `counts(step, layer, batch, tokens)` gives the
    number of tokens sent to each expert; `marginals(layer)` what a prefetcher would know."""

    # Drawing more tokens than this per (layer, batch) only sharpens counts that are already
    # proportional; larger requests are scaled from a draw of this size.
    MAX_DRAW = 2048

    def __init__(self, num_experts: int, top_k: int, *, weights: list[list[float]], seed: int = 0):
        self.num_experts, self.top_k, self.seed = num_experts, top_k, seed
        self._weights = weights
        self._marg = [marginals_from_weights(w, top_k) for w in weights]

    @classmethod
    def synthetic(cls, num_layers: int, num_experts: int, top_k: int, *, skew: float = 0.0,
                  seed: int = 0) -> "RoutingSample":
        """Zipf-like popularity per layer (skew 0 = uniform), a different hot set per layer."""
        weights = [zipf_weights(num_experts, skew, seed=seed * 100_003 + layer) for layer in range(num_layers)]
        return cls(num_experts, top_k, weights=weights, seed=seed)

    @property
    def num_layers(self) -> int:
        return len(self._marg)

    def marginals(self, layer: int) -> list[float]:
        return self._marg[layer % len(self._marg)]

    def counts(self, step: int, layer: int, batch: int, tokens: int) -> list[int]:
        E = self.num_experts
        if tokens <= 0:
            return [0] * E
        draw = min(tokens, self.MAX_DRAW)
        rng = np.random.default_rng((self.seed, step, layer, batch))
        w = np.asarray(self._weights[layer % len(self._weights)])
        keys = np.log(np.maximum(w, 1e-300)) + rng.gumbel(size=(draw, E))
        k = min(self.top_k, E)
        top = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        c = np.bincount(top.ravel(), minlength=E).astype(float)
        if draw == tokens:
            return [int(x) for x in c]
        scaled = c * tokens / draw
        out = [int(x) for x in np.floor(scaled)]
        # Largest remainders keep the total at tokens * top_k.
        short = tokens * k - sum(out)
        for e in np.argsort(-(scaled - np.floor(scaled)))[:max(0, short)]:
            out[int(e)] += 1
        return out
