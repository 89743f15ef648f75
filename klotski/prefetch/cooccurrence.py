"""The per-expert co-occurrence table: the correlation table for fine-grained MoE.

With 64-128 experts and top-8 routing a token's whole expert set almost never repeats
(C(128, 8) is about 1.4e12), so a table keyed by that set mostly looks up sets it has never
seen. This one keys by single experts instead: counts[layer][i][j] is how often a token
that chose expert i at layer-1 chose expert j at `layer`, an E x E matrix per layer that
every token fills k x k cells of. A token's tendency at `layer` is the mean of the
normalised rows of its k previous experts; a group's is the sum over its tokens, which is
one [E] x [E, E] product however many tokens there are.
"""
from __future__ import annotations

import torch

from klotski.prefetch.predictors import SavedTable


class CooccurrenceTable(SavedTable):
    kind, name = "co-occurrence", "co-occurrence table"
    path = 1  # a pair of consecutive layers, by construction

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        super().__init__(num_layers, num_experts, top_k)
        # integer counts, so a long job never loses increments to float rounding
        self.first = torch.zeros(num_experts, dtype=torch.long)
        self.counts = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.long)

    def describe(self) -> str:
        return "co-occurrence table (per-expert, previous layer -> this layer)"

    def paths(self, history: list[torch.Tensor], layer: int) -> torch.Tensor | None:
        """[N, k]: every token's experts at the previous layer."""
        return history[layer - 1] if 0 < layer <= len(history) else None

    def update(self, layer: int, previous: torch.Tensor | None, experts: torch.Tensor) -> None:
        E = self.num_experts
        if layer == 0 or previous is None:
            self.first += torch.bincount(experts.flatten(), minlength=E)
            return
        pairs = (previous[:, :, None] * E + experts[:, None, :]).flatten()  # every (i, j) of every token
        self.counts[layer] += torch.bincount(pairs, minlength=E * E).view(E, E)

    def picks(self, layer: int) -> torch.Tensor:
        """How often each expert of `layer` was picked (in proportion: a token's picks count once
        for each of its picks at the layer before)."""
        return (self.first if layer == 0 else self.counts[layer].sum(0)).double()

    def tendency(self, layer: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Sum over tokens of each token's expected use of every expert at `layer`."""
        if layer == 0:
            return self.first.double()
        rows = self.counts[layer].double()
        marginal = rows.sum(0)
        if previous is None or previous.numel() == 0:
            return marginal
        # an expert never seen at layer-1 tells nothing: its tokens count the layer's popularity
        marginal = marginal / marginal.sum().clamp(min=1)
        totals = rows.sum(1, keepdim=True)
        conditional = torch.where(totals > 0, rows / totals.clamp(min=1), marginal)
        uses = torch.bincount(previous.flatten(), minlength=self.num_experts).double()
        return uses @ conditional / self.top_k

    def _body(self) -> dict:
        return {"first_layer": self.first.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def _from_body(cls, shape, data) -> "CooccurrenceTable":
        table = cls(*shape)
        first = torch.tensor(data["first_layer"], dtype=torch.long)
        counts = torch.tensor(data["counts"], dtype=torch.long)
        if first.shape != table.first.shape or counts.shape != table.counts.shape:
            raise ValueError(f"co-occurrence counts of shape {tuple(counts.shape)}, "
                             f"expected {tuple(table.counts.shape)}")
        table.first, table.counts = first, counts
        return table
