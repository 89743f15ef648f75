"""The schedule: in what order one forward step of a batch group touches weights.

A step takes every batch of the group through the model layer by layer (the zig-zag
order of FlexGen/Klotski): attention batch by batch, the router batch by batch, then each
expert once over the tokens of *all* batches that chose it. This module orders work and
calls the model math; it never does arithmetic on weights itself, and it gets weights
only through `weights.get(key)` / `weights.release(key)`, so where the bytes live is the
placement's business.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from klotski.kvcache import BatchKV
from klotski.models import mixtral as M


@dataclass
class StepInput:
    """One batch's new tokens for this step: ids, validity (False = left padding), positions."""
    ids: torch.Tensor        # [B, T]
    valid: torch.Tensor      # [B, T] bool
    positions: torch.Tensor  # [B, T]


@dataclass
class _Routed:
    """Router decisions of one batch at one layer, flattened over its B*T tokens."""
    x: torch.Tensor        # normalised MoE input [N, H]
    weights: torch.Tensor  # [N, k] fp32
    experts: torch.Tensor  # [N, k]


class Pipeline:
    def __init__(self, spec, weights, config):
        self.spec, self.weights, self.config = spec, weights, config

    def forward(self, kvs: list[BatchKV], inputs: list[StepInput]) -> list[torch.Tensor]:
        """Run one step for the group; return each batch's next-token logits [B, V] (fp32)."""
        spec, W = self.spec, self.weights
        outer = W.get(("outer",))
        hs, ctx = [], []
        for kv, inp in zip(kvs, inputs):
            h = M.embed(inp.ids, outer["embed"])
            cos, sin = M.rope_tables(inp.positions, spec.head_dim, spec.rope_theta, h.dtype)
            mask = M.attention_mask(kv.begin_step(inp.valid), inp.ids.shape[1], spec.sliding_window)
            hs.append(h)
            ctx.append((cos, sin, mask))
        for layer in range(spec.num_layers):
            attn = W.get(("attn", layer))
            for k, kv in enumerate(kvs):
                cos, sin, mask = ctx[k]
                hs[k] = M.attention_block(hs[k], attn, cos, sin, mask,
                                          lambda kk, vv, kv=kv: kv.write(layer, kk, vv), spec)
            W.release(("attn", layer))
            gate = W.get(("gate", layer))
            routed = [self._route(h, attn["post_norm"], gate["router"]) for h in hs]
            W.release(("gate", layer))
            hs = self._experts(layer, hs, routed)
        for kv, inp in zip(kvs, inputs):
            kv.end_step(inp.ids.shape[1])
        return [M.logits(h[:, -1], outer["norm"], outer["lm_head"], spec.rms_norm_eps) for h in hs]

    def _route(self, h, post_norm, router) -> _Routed:
        x = M.rms_norm(h, post_norm, self.spec.rms_norm_eps).reshape(-1, h.shape[-1])
        weights, experts = M.route(x, router, self.spec.top_k)
        return _Routed(x, weights, experts)

    def _experts(self, layer: int, hs, routed: list[_Routed]):
        """Each selected expert once, over its tokens from every batch of the group."""
        outs = [torch.zeros_like(r.x) for r in routed]
        chosen = torch.unique(torch.cat([r.experts.flatten() for r in routed])).tolist()
        for e in self.expert_order(layer, chosen):
            picks = [torch.where(r.experts == e) for r in routed]
            w = self.weights.get(("expert", layer, e))
            # One matmul over the tokens of all batches: the weight is shared n*bs ways.
            y = M.expert_ffn(torch.cat([r.x[tok] for r, (tok, _) in zip(routed, picks)]), w)
            self.weights.release(("expert", layer, e))
            for r, out, (tok, slot), y_k in zip(routed, outs, picks, y.split([len(p[0]) for p in picks])):
                out.index_add_(0, tok, M.weighted(y_k, r.weights[tok, slot]))
        return [h + out.view_as(h) for h, out in zip(hs, outs)]

    def expert_order(self, layer: int, chosen: list[int]) -> list[int]:
        return sorted(chosen)
