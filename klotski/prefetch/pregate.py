"""A pre-gate fitted on the run (Pre-gated MoE, ISCA'24, without its training): for every MoE
layer m after the first layer, a least-squares map from the hidden state entering layer m-1
to layer m's router scores, learned online from activations the run computes anyway.

Pre-gated MoE trains a pre-gate per layer; here the map is fitted while the job runs. Each
pair keeps the normal equations AᵀA and AᵀY (A: the features of layer m-1's input, Y: layer
m's router scores `x·routerᵀ` over the same tokens), refitted with a small ridge every
`REFIT_TOKENS` new tokens. The features are the hidden state RMS-normalised without a weight
(the router's own norm, up to its weight, so the map is scale-free), then, where the hidden
size is over `PREGATE_RANK`, a fixed random projection to that many columns (so a pair holds
O(rank²) numbers, not O(H²): 256² against 4096² for Mixtral's width, a coarser map), and a
constant column. Layer m's picks are then known from layer m-1's input, before that layer's
attention, where next-gate speculation knows them only after layer m-1's gate, and they need
no next gate on the device.

`PregatePredictor` is the correlation predictor with the map in front: where a pair is fitted
its picks predict the layer, elsewhere (layer 0, the first tokens, a pair not fitted yet, a
step whose features did not fit the budget) the correlation table does. Asked to compare
(`--prefetch-compare`: `ComparedPregatePredictor`), next-gate speculation runs beside it and is
scored on the same layer-steps (`alongside` in the report), so one run gives both precisions;
not asked, no next gate is fetched ahead nor computed, so the run's time is the pre-gate's own.
Predictions only move bytes: outputs are exact whatever they say.

The runtime never names a family: the one weight read is the gate group's `router` (every
family's router matrix, ModelSpec's shared name), and only its linear scores are fitted.
"""
from __future__ import annotations

import torch

from klotski.prefetch.predictors import CorrelationPredictor, SavedTable, PrefetchMetrics, top_experts

PREGATE_RANK = 256    # feature columns a map reads at most (beside the constant one)
REFIT_TOKENS = 1024   # new tokens a pair sees between two fits
MIN_TOKENS = 64       # tokens a pair sees before its first fit (the ridge keeps a small fit tame)
RIDGE = 1e-3          # the ridge, as a share of AᵀA's mean diagonal
PROJECTION_SEED = 0   # the random projection is the same on every run of a model


def maps_nbytes(shape, rank: int = PREGATE_RANK) -> int:
    """Device bytes the maps of a model of `shape` hold (PregateMaps.place), before any is made."""
    moe = sum(shape.experts_in(j) > 0 for j in range(shape.num_layers))
    d, E, H = min(shape.hidden_size, rank) + 1, shape.num_experts, shape.hidden_size
    return 4 * ((H * (d - 1) if H > d - 1 else 0) + moe * (d * d + 2 * d * E))


class PregateMaps:
    """The fitted maps of every MoE layer (by MoE index), their accumulators on the device."""

    def __init__(self, hidden: int, num_experts: int, moe_layers: int, eps: float, rank: int = PREGATE_RANK):
        self.hidden, self.num_experts, self.moe_layers, self.eps = hidden, num_experts, moe_layers, eps
        self.width = min(hidden, rank) + 1  # the features and a constant column
        self.seen = [0] * moe_layers        # tokens learned from, per pair (counted on the host)
        self.fitted_at = [0] * moe_layers   # `seen` at the last fit (0: never fitted)
        self.projection = self.gram = self.cross = self.maps = None

    def place(self, device: torch.device) -> int:
        """Make the accumulators and maps on `device`; the bytes they hold (the caller charges them)."""
        d, E, M = self.width, self.num_experts, self.moe_layers
        if self.hidden > d - 1:  # Gaussian columns scaled to keep a feature's size
            g = torch.Generator().manual_seed(PROJECTION_SEED)
            self.projection = (torch.randn(self.hidden, d - 1, generator=g) / (d - 1) ** 0.5).to(device)
        self.gram = torch.zeros(M, d, d, device=device)
        self.cross = torch.zeros(M, d, E, device=device)
        self.maps = torch.zeros(M, d, E, device=device)
        return sum(t.nbytes for t in (self.projection, self.gram, self.cross, self.maps) if t is not None)

    def feature_nbytes(self, tokens: int) -> int:
        return tokens * self.width * 4

    def features(self, hs: list[torch.Tensor], keeps: list) -> torch.Tensor:
        """[N, width] fp32 features of every batch's real tokens, batch after batch (the rows the
        router of the next layer sees, in its order)."""
        parts = []
        for h, keep in zip(hs, keeps):
            x = h.reshape(-1, h.shape[-1])
            parts.append(x if keep is None else x.index_select(0, keep))
        x = torch.cat(parts).float() if len(parts) > 1 else parts[0].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.projection is not None:
            x = x @ self.projection
        return torch.cat([x, torch.ones(len(x), 1, device=x.device)], dim=1)

    def fitted(self, m: int) -> bool:
        return self.fitted_at[m] > 0

    def picks(self, m: int, feats: torch.Tensor, k: int) -> torch.Tensor:
        """[N, k] experts of MoE layer m each token's fitted scores rank highest."""
        return torch.topk(feats @ self.maps[m], k, dim=-1).indices

    def learn(self, m: int, feats: torch.Tensor, x: torch.Tensor, router: torch.Tensor) -> None:
        """Layer m's router scores over its normalised inputs `x` (the rows `feats` describe),
        added to pair m's normal equations; refitted when enough new tokens came."""
        y = torch.nn.functional.linear(x.float(), router.float())
        self.gram[m] += feats.T @ feats
        self.cross[m] += feats.T @ y
        self.seen[m] += len(feats)
        if self.seen[m] >= max(MIN_TOKENS, self.fitted_at[m] + (REFIT_TOKENS if self.fitted_at[m] else 0)):
            self._fit(m)

    def _fit(self, m: int) -> None:
        a = self.gram[m]
        ridge = RIDGE * a.diagonal().mean() + 1e-6
        eye = torch.eye(len(a), device=a.device)
        # solve_ex checks nothing on the host: no device sync on CUDA
        self.maps[m] = torch.linalg.solve_ex(a + ridge * eye, self.cross[m], check_errors=False)[0]
        self.fitted_at[m] = self.seen[m]

    def describe(self) -> str:
        cols = self.width - 1
        how = f"a random projection to {cols} columns" if self.hidden > cols else "the whole hidden state"
        return f"pre-gate fitted on the run (least squares from the previous layer's input, {how})"


class PregatePredictor(CorrelationPredictor):
    """The fitted pre-gate's picks where its pair is fitted, the correlation table's elsewhere."""

    def __init__(self, table: SavedTable, maps: PregateMaps, save_to=None):
        super().__init__(table, save_to)
        self.maps = maps
        self.name = f"{maps.describe()}; else the {table.describe()}"
        self.ahead: dict[int, torch.Tensor] = {}       # MoE layer -> the pre-gate's picks per expert
        self.k = 0
        self.by_pregate = self.predictions = 0

    def begin_step(self) -> None:
        super().begin_step()
        self.ahead = {}

    def pregated(self, layer: int, experts: list[torch.Tensor]) -> None:
        """The pre-gate's picks for MoE layer `layer` (computed by the pipeline a layer ahead)."""
        self.ahead[layer] = torch.bincount(torch.cat([e.flatten() for e in experts]), minlength=self.counts.shape[1])

    def predict(self, layer: int, k: int) -> list[int]:
        self.k = k
        if layer not in self.predicted:
            self.predictions += 1
            if layer in self.ahead:
                self.by_pregate += 1
                self.predicted[layer] = top_experts(self.ahead[layer], k) if k > 0 else []
        return super().predict(layer, k)

    def state(self) -> str:
        fitted = sum(self.maps.fitted(m) for m in range(self.maps.moe_layers))
        return f"pre-gate with {fitted} of {self.maps.moe_layers} layers fitted; {super().state()}"

    def report(self) -> dict:
        return {**super().report(), "pregated_share": round(self.by_pregate / self.predictions, 4)
                if self.predictions else None}


class ComparedPregatePredictor(PregatePredictor):
    """The pre-gate, with next-gate speculation run beside it (the pipeline fetches the next gate
    ahead and computes its picks because this predictor has `speculate`) and both scored on the
    layer-steps where both predicted; next-gate's picks are never used."""

    def __init__(self, table: SavedTable, maps: PregateMaps, save_to=None):
        super().__init__(table, maps, save_to)
        self.speculated: dict[int, torch.Tensor] = {}  # MoE layer -> next-gate's picks per expert
        self.alongside = {"pre-gate": PrefetchMetrics(table.num_layers), "next-gate": PrefetchMetrics(table.num_layers)}

    def begin_step(self) -> None:
        super().begin_step()
        self.speculated = {}

    def speculate(self, layer: int, experts: list[torch.Tensor]) -> None:
        """Next-gate speculation's picks for `layer`: scored beside the pre-gate, never used."""
        self.speculated[layer] = torch.bincount(torch.cat([e.flatten() for e in experts]),
                                                minlength=self.counts.shape[1])

    def observe(self, layer: int, experts: list[torch.Tensor], **kw) -> None:
        if self.k and layer in self.ahead and layer in self.speculated:
            per_expert = torch.bincount(torch.cat([e.flatten() for e in experts]), minlength=self.counts.shape[1])
            self.alongside["pre-gate"].score(layer, top_experts(self.ahead[layer], self.k), per_expert)
            self.alongside["next-gate"].score(layer, top_experts(self.speculated[layer], self.k), per_expert)
        super().observe(layer, experts, **kw)

    def report(self) -> dict:
        both = {name: {k: v for k, v in m.report().items() if k != "per_group"} for name, m in self.alongside.items()}
        return {**super().report(), "alongside": both}


def pregate_predictor(ckpt, compare: bool = False) -> PregatePredictor:
    """The pre-gate over the checkpoint's correlation table (loaded, learned and saved as
    `--prefetch correlation` does), its maps made on the device by the pipeline; with `compare`,
    next-gate speculation scored beside it."""
    from klotski.prefetch.correlate import learning_predictor
    base, shape = learning_predictor(ckpt), ckpt.spec.shape
    moe_layers = sum(shape.experts_in(j) > 0 for j in range(shape.num_layers))
    maps = PregateMaps(shape.hidden_size, shape.num_experts, moe_layers, ckpt.spec.rms_norm_eps)
    return (ComparedPregatePredictor if compare else PregatePredictor)(base.table, maps, base.save_to)
