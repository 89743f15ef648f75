"""Mixtral math as pure functions over tensors.

Each function computes one piece of a decoder layer so that the pipeline can call them
piecewise: attention per batch, the router per batch, each expert over tokens gathered
from every batch of a group. No module state, no device or tier logic: weights come in
as tensors (dicts keyed like `ModelSpec.*_refs`), results go out as tensors.

Numerics follow transformers' Mixtral exactly where it matters for greedy equality:
RMSNorm in fp32 then cast, router softmax in fp32 over all experts then top-k and
renormalise, router weight applied in fp32 then cast before the sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos, sin of shape [B, T, head_dim] for integer `positions` [B, T], from the inverse
    frequencies [head_dim / 2] and attention scaling of the checkpoint's RoPE type (ModelSpec)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def attention_mask(valid: torch.Tensor, new_tokens: int, window: int | None,
                   sink: int | None = None, recent: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, new, total] mask: query i sees key j iff j <= i, key j is a real token
    (not left padding) and, with a sliding window W, i - W < j. Indices are slots in the
    padded cache, as transformers counts them. StreamingLLM sparsity (`sink`, `recent`)
    further keeps only a sequence's first `sink` tokens and keys with i - recent < j."""
    total = valid.shape[1]
    i = torch.arange(total - new_tokens, total)[:, None]
    j = torch.arange(total)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    allowed = allowed[None] & valid[:, None, :]
    if recent is not None:
        rank = valid.long().cumsum(-1) - 1  # position of key j within its own sequence
        allowed &= (rank < sink)[:, None, :] | (j > i - recent)[None]
    return allowed[:, None]


def qkv(x, w: dict, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """Project normalised hidden states x [B, T, H] to rotated q [B, h, T, D], k, v [B, kvh, T, D]."""
    B, T, _ = x.shape
    q = F.linear(x, w["q"]).view(B, T, num_heads, head_dim).transpose(1, 2)
    k = F.linear(x, w["k"]).view(B, T, num_kv_heads, head_dim).transpose(1, 2)
    v = F.linear(x, w["v"]).view(B, T, num_kv_heads, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q, keys, values, mask, w_o) -> torch.Tensor:
    """Scaled dot-product attention of q [B, h, T, D] over keys/values [B, kvh, S, D], then o_proj."""
    B, heads, T, D = q.shape
    rep = heads // keys.shape[1]
    if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
        keys = keys[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, heads, -1, D)
        values = values[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, heads, -1, D)
    scores = torch.matmul(q, keys.transpose(2, 3)) * D ** -0.5
    # A finite minimum rather than -inf: rows that are all padding stay finite, so no NaN
    # reaches a cache slot that real tokens later attend past.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values).transpose(1, 2).reshape(B, T, heads * D)
    return F.linear(out, w_o)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """Router over normalised tokens x [N, H]: (weights [N, k] fp32, experts [N, k])."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def expert_ffn(x: torch.Tensor, w: dict) -> torch.Tensor:
    """SwiGLU expert over tokens x [N, H]: w2(silu(w1 x) * w3 x)."""
    return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])


def weighted(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Scale expert outputs by their fp32 router weight and cast back, as transformers does."""
    return (y * weight[:, None]).to(y.dtype)


def attention_block(h, w: dict, cos, sin, mask, cache_write, spec, max_scores: int | None = None) -> torch.Tensor:
    """Residual attention sub-layer for one batch. `cache_write(k, v)` stores this step's
    keys/values and returns every key/value the batch has so far. Queries are taken in
    chunks so that at most `max_scores` attention scores exist at once (a long prefill
    would otherwise hold B x heads x T x S of them); each query row's result is unchanged."""
    x = rms_norm(h, w["input_norm"], spec.rms_norm_eps)
    q, k, v = qkv(x, w, cos, sin, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    keys, values = cache_write(k, v)
    B, heads, T, _ = q.shape
    step = T if max_scores is None else max(1, max_scores // (B * heads * keys.shape[2]))
    if step >= T:
        return h + attend(q, keys, values, mask, w["o"])
    return h + torch.cat([attend(q[:, :, i:i + step], keys, values, mask[:, :, i:i + step], w["o"])
                          for i in range(0, T, step)], dim=1)


def embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def logits(h: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float) -> torch.Tensor:
    return F.linear(rms_norm(h, norm, eps), head).float()
