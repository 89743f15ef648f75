"""Hot-expert prediction: which K experts of a layer the batch group will use most.

Three predictors share one interface (`begin_step`, `predict`, `observe`, `report`):

* `CorrelationPredictor` (paper §6.2): a table of counts "experts chosen at the previous
  `path` layers -> expert chosen at this layer", learned online from real gate decisions
  (and saved back to the cache as the job goes: klotski/prefetch/correlate.py). For layer j it
  looks up every token of the group by its own expert path, sums the tendencies over all
  tokens of all batches and returns the top K. The table is keyed by whole expert sets
  (`CorrelationTable`) for coarse MoE, or by single experts (`CooccurrenceTable`,
  klotski/prefetch/cooccurrence.py) for fine-grained MoE, whose sets rarely repeat;
  klotski.prefetch.correlate.table_class picks one from the model's shape.
* `NextGatePredictor` (AdapMoE / ProMoE-style speculation, training-free): layer j's router
  applied to the hidden state entering layer j-1's MoE.
* `FrequencyPredictor`: how often each expert was chosen at that layer so far.

Predictions only decide what is fetched early; they never change which experts compute,
so outputs are exact whatever they say. Ties go to the lower expert id, so runs repeat.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from klotski.util.writes import describe, replace_atomically

TABLE_VERSION = 2  # 2: a set is keyed by its expert ids (1: by its index among C(E, k)); files carry a kind


def top_experts(scores: torch.Tensor, k: int) -> list[int]:
    # a stable sort keeps equal scores in id order: ties go to the lower id
    return torch.sort(scores, descending=True, stable=True).indices[:k].tolist()


class PrefetchMetrics:
    """Figure 13 of the paper: precision, hot-expert accuracy, share served by prefetched experts;
    and recall: the share of the experts a layer-step used that were predicted."""

    def __init__(self, num_layers: int):
        self.rows = [{"predicted": 0, "used": 0, "hot_hits": 0, "served": 0, "assignments": 0, "distinct": 0}
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
        row["assignments"] += int(per_expert.sum())
        row["distinct"] += int((per_expert > 0).sum())
        if not predicted:  # (nothing predicted: nothing to score)
            return
        mine = per_expert[torch.tensor(predicted, dtype=torch.long)]
        row["predicted"] += len(predicted)
        row["used"] += int((mine > 0).sum())
        row["hot_hits"] += len(set(predicted) & set(top_experts(per_expert, len(predicted))))
        row["served"] += int(mine.sum())

    @staticmethod
    def _summary(row) -> dict:
        p, a, d = row["predicted"], row["assignments"], row["distinct"]
        return {"precision": round(row["used"] / p, 4) if p else None,
                "recall": round(row["used"] / d, 4) if p and d else None,
                "hot_accuracy": round(row["hot_hits"] / p, 4) if p else None,
                "served_share": round(row["served"] / a, 4) if a else None}

    def report(self) -> dict:
        return {**self._summary(self._total()), "per_layer": [self._summary(r) for r in self.rows],
                "per_group": self.groups}


class FrequencyPredictor:
    def __init__(self, num_layers: int, num_experts: int, name: str = "frequency"):
        self.name = name  # what predicts, for the report
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self.metrics = PrefetchMetrics(num_layers)
        self.predicted: dict[int, list[int]] = {}
        self.group_state: str | None = None  # state() when the current group began

    def begin_step(self) -> None:
        self.predicted = {}
        if self.group_state is None:
            self.group_state = self.state()

    def predict(self, layer: int, k: int) -> list[int]:
        if layer not in self.predicted:
            self.predicted[layer] = top_experts(self.counts[layer], k) if k > 0 else []
        return self.predicted[layer]

    def observe(self, layer: int, experts: list[torch.Tensor], **_) -> None:
        """Real routing of one layer: `experts` is one [N, k] tensor per batch."""
        per_expert = torch.bincount(torch.cat([e.flatten() for e in experts]), minlength=self.counts.shape[1])
        self.metrics.score(layer, self.predicted.get(layer, []), per_expert)
        self.counts[layer] += per_expert

    def report(self) -> dict:
        return {"predictor": self.name, **self.metrics.report()}

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


class SavedTable:
    """What every correlation table shares: its shape, and its JSON file (versioned, tagged
    with its kind, replaced atomically). A subclass adds `kind`, `name`, `update`, `tendency`,
    `_body` and `_from_body`."""

    kind = name = ""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k

    def describe(self) -> str:
        return self.name

    def tokens_seen(self) -> int:
        return int(self.first.sum()) // max(1, self.top_k)

    def to_json(self, model_key: str) -> dict:
        return {"version": TABLE_VERSION, "kind": self.kind, "model": model_key, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k, **self._body()}

    def save(self, path: Path, model_key: str) -> None:
        """Atomically: a reader (or a run killed mid-write) sees the old table or the new one."""
        replace_atomically(path, json.dumps(self.to_json(model_key)).encode())

    @classmethod
    def load(cls, path: Path, model) -> "SavedTable":
        """The table saved at `path` for a model of shape `model` (its num_layers, num_experts
        and top_k); ValueError when it is of another version, kind or shape."""
        data = json.loads(Path(path).read_text())
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"{path}: correlation table version {data.get('version')}, expected {TABLE_VERSION}")
        if data.get("kind") != cls.kind:
            raise ValueError(f"{path}: table kind {data.get('kind')!r}, this model uses {cls.kind!r}")
        shape = (data["num_layers"], data["num_experts"], data["top_k"])
        if shape != (model.num_layers, model.num_experts, model.top_k):
            raise ValueError(f"{path}: table is for layers/experts/top-k {shape}, the model has "
                             f"{(model.num_layers, model.num_experts, model.top_k)}; "
                             "rebuild it with `klotski correlate`")
        return cls._from_body(shape, data)


class CorrelationTable(SavedTable):
    """counts[layer][path] -> [E] expert counts; layer 0 keeps plain popularity.

    A token's path at layer j is its expert sets at layers j-path..j-1, each set as its
    sorted expert ids, so the key is a tuple of tuples and nothing is enumerated up front.
    A whole group collapses to its few unique paths before any lookup (for 8 experts top-2
    there are only 28 sets); with fine-grained experts nearly every token's set is new, which
    is what `CooccurrenceTable` is for."""

    kind, name = "exact-path", "correlation table"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, path: int = 1):
        super().__init__(num_layers, num_experts, top_k)
        self.path = path
        self.first = torch.zeros(num_experts)
        self.counts: list[dict[tuple, torch.Tensor]] = [dict() for _ in range(num_layers)]

    def describe(self) -> str:
        return f"exact-path correlation table (expert sets of the previous {self.path} layer(s))"

    def paths(self, history: list[torch.Tensor], layer: int) -> torch.Tensor | None:
        """[N, p*k]: every token's sorted expert sets at the p previous layers, side by side."""
        if layer == 0 or len(history) < layer:
            return None
        return torch.cat(history[max(0, layer - self.path):layer], dim=1)

    def _keys(self, rows: torch.Tensor) -> list[tuple]:
        k = self.top_k
        return [tuple(tuple(r[i:i + k]) for i in range(0, len(r), k)) for r in rows.tolist()]

    def update(self, layer: int, paths: torch.Tensor | None, experts: torch.Tensor) -> None:
        E = self.num_experts
        if layer == 0 or paths is None:
            self.first += torch.bincount(experts.flatten(), minlength=E)
            return
        unique, inverse = torch.unique(paths, dim=0, return_inverse=True)
        # one bincount over (path, expert) pairs instead of a mask per unique path
        pairs = (inverse[:, None] * E + experts).flatten()
        rows = torch.bincount(pairs, minlength=len(unique) * E).view(len(unique), E).float()
        for key, row in zip(self._keys(unique), rows):
            have = self.counts[layer].get(key)
            self.counts[layer][key] = row if have is None else have + row

    def picks(self, layer: int) -> torch.Tensor:
        """How often each expert of `layer` was picked."""
        if layer == 0:
            return self.first.double()
        return sum(self.counts[layer].values(), torch.zeros(self.num_experts)).double()

    def tendency(self, layer: int, paths: torch.Tensor | None) -> torch.Tensor:
        """Sum over tokens of each token's normalised expert tendency at `layer`."""
        if layer == 0 or paths is None or paths.numel() == 0:
            return self.first.clone()
        unique, counts = torch.unique(paths, dim=0, return_counts=True)
        total = torch.zeros(self.num_experts)
        for key, n in zip(self._keys(unique), counts.tolist()):
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

    # A key in the file: "1,5/0,3" is sets {1,5} then {0,3} (oldest layer first).
    def _body(self) -> dict:
        text = lambda key: "/".join(",".join(map(str, s)) for s in key)
        return {"path": self.path, "first_layer": self.first.tolist(),
                "layers": [{text(k): v.tolist() for k, v in layer.items()} for layer in self.counts]}

    @classmethod
    def _from_body(cls, shape, data) -> "CorrelationTable":
        table = cls(*shape, path=data["path"])
        table.first = torch.tensor(data["first_layer"], dtype=torch.float32)
        parse = lambda text: tuple(tuple(int(x) for x in s.split(",")) for s in text.split("/"))
        for layer, rows in enumerate(data["layers"]):
            table.counts[layer] = {parse(k): torch.tensor(v, dtype=torch.float32) for k, v in rows.items()}
        return table


class CorrelationPredictor(FrequencyPredictor):
    """Predicts from the routing of the current step's earlier layers with either table;
    learns online from every gate. `save_to` = (path, model key) saves the table there on
    `persist`."""

    def __init__(self, table: SavedTable, save_to: tuple[Path, str] | None = None):
        super().__init__(table.num_layers, table.num_experts, name=table.describe())
        self.table, self.save_to = table, save_to
        self.history: list[torch.Tensor] = []  # per layer: [N_group, k] sorted expert ids this step

    def begin_step(self) -> None:
        super().begin_step()
        self.history = []

    def predict(self, layer: int, k: int) -> list[int]:
        if layer not in self.predicted:
            scores = self.table.tendency(layer, self.table.paths(self.history, layer))
            self.predicted[layer] = top_experts(scores, k) if k > 0 else []
        return self.predicted[layer]

    def observe(self, layer: int, experts: list[torch.Tensor], **kw) -> None:
        super().observe(layer, experts)
        flat = torch.cat(experts).sort(dim=1).values
        self.table.update(layer, self.table.paths(self.history, layer), flat)
        self.history.append(flat)

    def state(self) -> str:
        seen = self.table.tokens_seen()
        return f"{self.table.name} learned from {seen} tokens" if seen else f"cold {self.table.name}"

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
        super().__init__(num_layers, num_experts, name="next-gate")
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
            self.predicted[layer] = top_experts(self.speculated[layer], k) if k > 0 else []
        return super().predict(layer, k)
