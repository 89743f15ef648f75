"""Family: what a model family module (mixtral.py, qwen3_moe.py, ...) provides. spec.py finds
the module by config.json's `model_type` (spec.FAMILIES); the spec, the pipeline and the
profile's ops call these hooks on it, and only these. Every family defines every one, taking
those it does not change from defaults.py; tests/test_families.py checks each module
against this Protocol.

Groups and their group-local weight names are ModelSpec's (spec.py): `w` of a math hook is
one group's tensors by those names."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from klotski.models.grouped import Groups
from klotski.models.refs import TensorRef


class Family(Protocol):
    MODEL_TYPE: str
    """The config.json `model_type` this module runs."""
    QUANTIZATION: tuple[str, ...]
    """The `quantization_config` quant_methods read as published; any other is refused."""
    HOST_ATTENTION: bool
    """Whether attention_block's core can run beside a host KV cache, handed it through `attend_at`."""
    SHARED_PREFIX: bool
    """Whether attention_block takes `prefix`: the keys/values of a prompt prefix every row shares."""
    LINEAR_WEIGHTS: dict[str, tuple[str, ...]]
    """Per group kind, the group-local weights read only as projections (layers.linear,
    layers.logits): on a CPU in bf16 the resident ones may be held reordered for oneDNN
    (models/prepacked.py), a form nothing else can read."""
    SPARSE_ATTENTION: bool
    """Whether attention_block stays exact when `--attention sink:S,window:W` drops keys from its mask
    (not where it reads positions from the mask: Llama 4)."""

    # ---- config.json ----------------------------------------------------------------------
    def check_config(self, cfg: dict) -> None:
        """Refuse the family's own config fields the math cannot use (raises fields.BadField)."""

    def check_quantization(self, quant: dict) -> None:
        """Refuse a `quantization_config` of a QUANTIZATION method whose format details it cannot read."""

    def options(self, cfg: dict) -> dict:
        """The family's ModelSpec options from its config (router renormalisation, router weight dtype)."""

    # ---- tensor names ---------------------------------------------------------------------
    def attention_names(self, spec, layer: int) -> dict[str, str]:
        """Checkpoint tensor name of each attention weight of `layer`, by group-local name (no biases)."""

    def gate_names(self, spec, layer: int) -> dict[str, str]:
        """Checkpoint tensor name of each weight of `layer`'s gate group (norm, router, shared or dense MLP)."""

    def expert_names(self, spec, layer: int, expert: int) -> dict[str, str]:
        """Checkpoint tensor name of each weight of one expert in the family's published layout."""

    def expert_refs(self, spec, layer: int, expert: int) -> dict[str, TensorRef]:
        """Where each weight of one expert lives (a whole tensor or its slice of a fused one)."""

    def group_refs(self, spec, key: tuple) -> dict[str, TensorRef]:
        """Where each weight of the group `key` lives, by group-local name."""

    def local_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """Shapes of the group-local weight names this family adds to those every family shares."""

    # ---- math -----------------------------------------------------------------------------
    def attention_block(self, h: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                        cache_write: Callable, spec, max_scores: int | None = None,
                        attend_at: Callable | None = None, prefix: tuple | None = None) -> torch.Tensor:
        """Residual attention sub-layer of one batch; `attend_at` moves its core beside a host KV cache;
        `prefix` (keys, values [kvh, P, D]) is a shared prompt prefix attended before the batch's own keys."""

    def recurrent_block(self, h: torch.Tensor, w: dict, state: tuple, valid: torch.Tensor,
                        spec) -> tuple[torch.Tensor, tuple]:
        """Residual linear-attention sub-layer of one batch (the layers `spec.shape.is_linear` names):
        (h + output, new state) from `state`, the layer's recurrent state of the batch's rows (its
        tensors are the family's: gated_deltanet.py), and `valid` [B, T] (False: a pad, an identity
        step for the state)."""

    def route(self, x: torch.Tensor, gate: dict, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """The router over normalised tokens x [N, H]: (weights [N, k], experts [N, k])."""

    def shared_ffn(self, x: torch.Tensor, gate: dict, spec) -> torch.Tensor | None:
        """The output every token gets beside its routed experts (shared experts, a dense MLP), or None."""

    def expert_ffn(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        """One expert over tokens x [N, H], its constants at their defaults."""

    def bind_expert_ffn(self, spec) -> Callable[[torch.Tensor, dict], torch.Tensor]:
        """expert_ffn(x, w) with the constants this checkpoint's config.json sets."""

    def bind_grouped_expert_ffn(self, spec) -> Callable[[torch.Tensor, dict, Groups], torch.Tensor]:
        """expert_ffn over many experts at once: w's tensors stacked along a first dimension (one
        expert each), x's rows in contiguous runs, one per expert (`Groups`); bit for bit
        expert_ffn on each run."""
