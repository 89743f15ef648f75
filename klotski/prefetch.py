"""Hot-expert prediction: which K experts of a layer the batch group will use most.

Three predictors share one interface (`begin_step`, `predict`, `observe`, `report`):

* `CorrelationPredictor` (paper §6.2): a table of counts "experts chosen at the previous
  `path` layers -> expert chosen at this layer", learned online from real gate decisions
  (and saved back to the cache as the job goes: klotski/correlate.py). For layer j it
  looks up every token of the group by its own expert path, sums the tendencies over all
  tokens of all batches and returns the top K.
* `NextGatePredictor` (AdapMoE / ProMoE-style speculation, training-free): layer j's router
  applied to the hidden state entering layer j-1's MoE.
* `FrequencyPredictor`: how often each expert was chosen at that layer so far.

Predictions only decide what is fetched early; they never change which experts compute,
so outputs are exact whatever they say. Ties go to the lower expert id, so runs repeat.
"""
from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path

import torch

from klotski.writes import describe, replace_atomically

TABLE_VERSION = 1


def _top(scores: torch.Tensor, k: int) -> list[int]:
    order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
    return order[:k]


class _Metrics:
    """Figure 13 of the paper: precision, hot-expert accuracy, share served by prefetched experts."""

    def __init__(self, num_layers: int):
        self.rows = [{"predicted": 0, "used": 0, "hot_hits": 0, "served": 0, "assignments": 0}
                     for _ in range(num_layers)]
        self.groups: list[dict] = []  # per finished batch group: its counts and how the predictor stood
        self._at_group_start = self._total()

    def _total(self) -> dict:
        return {k: sum(r[k] for r in self.rows) for k in self.rows[0]}

    def end_group(self, predictor: str) -> None:
        """Close a batch group: its own precision, so a report shows the statistics warming up."""
        total = self._total()
        self.groups.append({"predictor": predictor,
                            **self._summary({k: total[k] - self._at_group_start[k] for k in total})})
        self._at_group_start = total

    def score(self, layer: int, predicted: list[int], per_expert: torch.Tensor) -> None:
        row = self.rows[layer]
        used = {e for e in range(len(per_expert)) if per_expert[e] > 0}
        true_top = set(_top(per_expert, len(predicted)))
        row["predicted"] += len(predicted)
        row["used"] += sum(e in used for e in predicted)
        row["hot_hits"] += sum(e in true_top for e in predicted)
        row["served"] += int(sum(per_expert[e] for e in predicted))
        row["assignments"] += int(per_expert.sum())

    @staticmethod
    def _summary(row) -> dict:
        p, a = row["predicted"], row["assignments"]
        return {"precision": round(row["used"] / p, 4) if p else None,
                "hot_accuracy": round(row["hot_hits"] / p, 4) if p else None,
                "served_share": round(row["served"] / a, 4) if a else None}

    def report(self) -> dict:
        return {**self._summary(self._total()), "per_layer": [self._summary(r) for r in self.rows],
                "per_group": self.groups}


class FrequencyPredictor:
    def __init__(self, num_layers: int, num_experts: int):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self.metrics = _Metrics(num_layers)
        self.predicted: dict[int, list[int]] = {}
        self.group_state: str | None = None  # state() when the current group began

    def begin_step(self) -> None:
        self.predicted = {}
        if self.group_state is None:
            self.group_state = self.state()

    def predict(self, layer: int, k: int) -> list[int]:
        if layer not in self.predicted:
            self.predicted[layer] = _top(self.counts[layer], k) if k > 0 else []
        return self.predicted[layer]

    def observe(self, layer: int, experts: list[torch.Tensor], **_) -> None:
        """Real routing of one layer: `experts` is one [N, k] tensor per batch."""
        per_expert = torch.bincount(torch.cat([e.flatten() for e in experts]), minlength=self.counts.shape[1])
        self.metrics.score(layer, self.predicted.get(layer, []), per_expert)
        self.counts[layer] += per_expert

    def report(self) -> dict:
        return self.metrics.report()

    def state(self) -> str:
        """What predicts, and from how much history (for the per-group report)."""
        seen = int(self.counts[0].sum())
        return f"running counts of {seen} routing decisions" if seen else "cold running counts"

    def end_group(self) -> None:
        """Called after every batch group: score it, with the state it started in."""
        self.metrics.end_group(self.group_state or self.state())
        self.group_state = None

    def persist(self) -> None:
        """Save what was learned, where that is kept (called after every batch group)."""


class CorrelationTable:
    """counts[layer][path code] -> [E] expert counts; layer 0 keeps plain popularity.

    A token's path at layer j is its expert sets at layers j-path..j-1; each set of top-k
    experts is coded as its index among the C(E, k) combinations, so a path is a tuple of
    small ints and the whole group collapses to a few unique paths before any lookup."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, path: int = 1):
        self.num_layers, self.num_experts, self.top_k, self.path = num_layers, num_experts, top_k, path
        self.combo = {c: i for i, c in enumerate(combinations(range(num_experts), top_k))}
        self.first = torch.zeros(num_experts)
        self.counts: list[dict[tuple, torch.Tensor]] = [dict() for _ in range(num_layers)]

    def codes(self, experts: torch.Tensor) -> torch.Tensor:
        """[N, k] expert ids -> [N] combination codes."""
        return torch.tensor([self.combo[tuple(sorted(r))] for r in experts.tolist()], dtype=torch.long)

    def paths(self, history: list[torch.Tensor], layer: int) -> torch.Tensor:
        """[N, p] path codes of every token at `layer` (p = path layers available)."""
        start = max(0, layer - self.path)
        return torch.stack(history[start:layer], dim=1)

    def update(self, layer: int, paths: torch.Tensor | None, experts: torch.Tensor) -> None:
        if layer == 0 or paths is None:
            self.first += torch.bincount(experts.flatten(), minlength=self.num_experts)
            return
        unique, inverse = torch.unique(paths, dim=0, return_inverse=True)
        for i, key in enumerate(map(tuple, unique.tolist())):
            chosen = experts[inverse == i].flatten()
            row = self.counts[layer].setdefault(key, torch.zeros(self.num_experts))
            row += torch.bincount(chosen, minlength=self.num_experts)

    def tendency(self, layer: int, paths: torch.Tensor | None) -> torch.Tensor:
        """Sum over tokens of each token's normalised expert tendency at `layer`."""
        if layer == 0 or paths is None or paths.numel() == 0:
            return self.first.clone()
        unique, counts = torch.unique(paths, dim=0, return_counts=True)
        total = torch.zeros(self.num_experts)
        for key, n in zip(map(tuple, unique.tolist()), counts.tolist()):
            row = self._lookup(layer, key)
            if row is not None and row.sum() > 0:
                total += n * row / row.sum()
        return total

    def _lookup(self, layer: int, key: tuple):
        """Back off to shorter paths (most recent layers) when a long path was never seen."""
        while key:
            row = self.counts[layer].get(key)
            if row is not None:
                return row
            matches = [r for k, r in self.counts[layer].items() if k[-len(key) + 1:] == key[1:]] if len(key) > 1 else []
            key = key[1:]
            if matches and not key:
                break
            if matches:
                return sum(matches)
        return None

    # ---- persistence -------------------------------------------------------------------
    def to_json(self, model_key: str) -> dict:
        return {"version": TABLE_VERSION, "model": model_key, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k, "path": self.path,
                "first_layer": self.first.tolist(),
                "layers": [{",".join(map(str, k)): v.tolist() for k, v in layer.items()} for layer in self.counts]}

    def save(self, path: Path, model_key: str) -> None:
        """Atomically: a reader (or a run killed mid-write) sees the old table or the new one."""
        replace_atomically(path, json.dumps(self.to_json(model_key)).encode())

    @classmethod
    def load(cls, path: Path, spec) -> "CorrelationTable":
        data = json.loads(Path(path).read_text())
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"{path}: correlation table version {data.get('version')}, expected {TABLE_VERSION}")
        shape = (data["num_layers"], data["num_experts"], data["top_k"])
        if shape != (spec.num_layers, spec.num_experts, spec.top_k):
            raise ValueError(f"{path}: table is for layers/experts/top-k {shape}, the model has "
                             f"{(spec.num_layers, spec.num_experts, spec.top_k)}; rebuild it with `klotski correlate`")
        table = cls(*shape, path=data["path"])
        table.first = torch.tensor(data["first_layer"])
        for layer, rows in enumerate(data["layers"]):
            table.counts[layer] = {tuple(int(x) for x in k.split(",")): torch.tensor(v) for k, v in rows.items()}
        return table


class CorrelationPredictor(FrequencyPredictor):
    """Predicts from the token paths of the current step; learns online from every gate.
    `save_to` = (path, model key) saves the table there on `persist`."""

    def __init__(self, table: CorrelationTable, save_to: tuple[Path, str] | None = None):
        super().__init__(table.num_layers, table.num_experts)
        self.table, self.save_to = table, save_to
        self.history: list[torch.Tensor] = []  # per layer: [N_group] combination codes this step

    def begin_step(self) -> None:
        super().begin_step()
        self.history = []

    def predict(self, layer: int, k: int) -> list[int]:
        if layer not in self.predicted:
            paths = self.table.paths(self.history, layer) if layer > 0 and len(self.history) >= layer else None
            scores = self.table.tendency(layer, paths)
            self.predicted[layer] = _top(scores, k) if k > 0 else []
        return self.predicted[layer]

    def observe(self, layer: int, experts: list[torch.Tensor], **kw) -> None:
        super().observe(layer, experts)
        flat = torch.cat(experts)
        paths = self.table.paths(self.history, layer) if layer > 0 and len(self.history) >= layer else None
        self.table.update(layer, paths, flat)
        self.history.append(self.table.codes(flat))

    def state(self) -> str:
        seen = int(self.table.first.sum()) // max(1, self.table.top_k)
        return f"correlation table learned from {seen} tokens" if seen else "cold correlation table"

    def persist(self) -> None:
        """Save what was learned; a cache that cannot be written costs the next run a warm
        start, never this run: say so once and go on."""
        if not self.save_to:
            return
        try:
            self.table.save(*self.save_to)
        except OSError as e:
            then = "the run goes on; the next run learns the table again"
            print(f"klotski: warning: {describe(e, self.save_to[0], 'the expert-correlation table', then=then)}",
                  file=sys.stderr)
            self.save_to = None


class NextGatePredictor(FrequencyPredictor):
    """Layer j's router on the hidden state entering layer j-1's MoE; frequency for layer 0."""

    def __init__(self, num_layers: int, num_experts: int):
        super().__init__(num_layers, num_experts)
        self.speculated: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        super().begin_step()
        self.speculated = {}

    def state(self) -> str:
        return f"next-gate speculation ({super().state()} for layer 0)"

    def speculate(self, layer: int, experts: list[torch.Tensor]) -> None:
        """Experts the next layer's router picks for the current hidden states (computed by the pipeline)."""
        self.speculated[layer] = torch.bincount(torch.cat([e.flatten() for e in experts]),
                                                minlength=self.counts.shape[1])

    def predict(self, layer: int, k: int) -> list[int]:
        if layer in self.speculated and layer not in self.predicted:
            self.predicted[layer] = _top(self.speculated[layer], k) if k > 0 else []
        return super().predict(layer, k)
