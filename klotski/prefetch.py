"""Hot-expert prediction: which K experts of a layer the group is likely to use most.

`FrequencyPredictor` ranks experts by how many tokens chose them at that layer in earlier
steps of this run (ties go to the lower id, so runs are reproducible). Predictions only
decide what is fetched early; they never change which experts compute, so outputs are
exact whatever they say.
"""
from __future__ import annotations

import torch


class FrequencyPredictor:
    def __init__(self, num_layers: int, num_experts: int):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self.stats = {"predicted": 0, "used": 0, "hot_hits": 0}

    def predict(self, layer: int, k: int) -> list[int]:
        if k <= 0:
            return []
        counts = self.counts[layer]
        # stable sort: ties -> lower expert id first
        order = sorted(range(len(counts)), key=lambda e: (-int(counts[e]), e))
        return order[:k]

    def observe(self, layer: int, experts: torch.Tensor, predicted: list[int]) -> None:
        """Record a layer's real routing (all tokens of the group) and score the prediction."""
        per_expert = torch.bincount(experts.flatten(), minlength=self.counts.shape[1])
        self.counts[layer] += per_expert
        used = set(torch.nonzero(per_expert).flatten().tolist())
        true_top = set(sorted(used, key=lambda e: (-int(per_expert[e]), e))[:len(predicted)])
        self.stats["predicted"] += len(predicted)
        self.stats["used"] += sum(e in used for e in predicted)
        self.stats["hot_hits"] += sum(e in true_top for e in predicted)

    def report(self) -> dict:
        p = self.stats["predicted"]
        return {"precision": round(self.stats["used"] / p, 4) if p else None,
                "hot_accuracy": round(self.stats["hot_hits"] / p, 4) if p else None}
