"""The pieces every supported family's decoder layer is built from, as pure functions over
tensors. A family file (mixtral.py, qwen3_moe.py, ...) composes them into its own
`attention_block`, `route` and `shared_ffn`; the pipeline calls the family piecewise:
attention per batch, the router per batch, each expert over tokens gathered from every
batch of a group. No module state, no device or tier logic: weights come in as tensors
(dicts keyed by the group-local names of `ModelSpec.group_refs`).

Numerics follow transformers where it matters for greedy equality: RMSNorm in fp32 then
cast; router softmax in fp32 over all experts, then top-k; each expert output times its
router weight in the promoted dtype, summed over the top-k slots in slot order and cast
once (what transformers' default `grouped_mm` experts do).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from klotski.models import int4, prepacked


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm scaled by `weight`, or by `offset + weight` in fp32 (Qwen3-Next's and Qwen3.5's
    norms scale by 1 + w, as transformers computes it)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        weight = offset + weight.float()
    if weight.dtype == torch.float32:  # weights kept in fp32 (gpt-oss): scaled in fp32, cast once
        return (weight * xf).to(x.dtype)
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
    """x: [B, heads, T, D]; cos/sin: [B, T, R], R <= D. With R < D (partial rotary: GLM-4.5,
    MiniMax-M2) the first R dimensions of each head turn and the rest pass as they are."""
    cos, sin = cos[:, None], sin[:, None]
    turned = cos.shape[-1]
    if turned == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    part = x[..., :turned]
    return torch.cat((part * cos + _rotate_half(part) * sin, x[..., turned:]), dim=-1)


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


def split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, heads * D] -> [B, T, heads, D]."""
    return x.view(*x.shape[:2], heads, head_dim)


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    """Projection `name` of the group, with its bias where the checkpoint has one."""
    return int4.linear(x, w, name, w.get(name + "_bias"))  # F.linear, or a weight held as int4 codes


def attend(q, keys, values, mask) -> torch.Tensor:
    """Scaled dot-product attention of q [B, h, T, D] over keys/values [B, kvh, S, D] -> [B, T, h * D]."""
    B, heads, T, D = q.shape
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    # Grouped-query attention: each kv head serves `rep` query heads. Their queries go
    # side by side against the one kv head, rather than the KV copied rep-fold: at decode
    # the copy would be the whole cost, a cliff past the last-level cache (docs/benchmarks.md).
    scores = grouped_scores(q.reshape(B, kv_heads, rep * T, D), keys).reshape(B, heads, T, -1)
    # A finite minimum rather than -inf: rows that are all padding stay finite, so no NaN
    # reaches a cache slot that real tokens later attend past.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(B, kv_heads, rep * T, -1), values).view(B, heads, T, -1)
    return out.transpose(1, 2).reshape(B, T, -1)


# Queries a kv head serves at most, for the keys-first product below (past it, a prefill's
# queries-first product is the faster: docs/benchmarks.md).
KEYS_FIRST_ROWS = 32


def grouped_scores(grouped_q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled scores [B, kvh, R, S] of queries grouped per kv head [B, kvh, R, D] against keys
    [B, kvh, S, D]. On a CPU in 16 bits with few queries (decode), as keys times queries and
    transposed back: the cache's slot-major views (each key's D values contiguous, rows of a
    batch interleaved) go to the BLAS as they are that way, where q·kᵀ over them fell back to
    a loop over elements several times slower. The same products (bit for bit on the machine
    measured, docs/benchmarks.md; tests/test_attention_layout.py holds them to an fp64 reference)."""
    B, kv_heads, R, D = grouped_q.shape
    if keys.device.type != "cpu" or keys.dtype == torch.float32 or R > KEYS_FIRST_ROWS:
        return torch.matmul(grouped_q, keys.transpose(2, 3)) * D ** -0.5
    flat_q = grouped_q.reshape(B * kv_heads, R, D).transpose(1, 2).contiguous()
    scores_t = torch.matmul(keys.flatten(0, 1), flat_q) * D ** -0.5
    return scores_t.transpose(1, 2).reshape(B, kv_heads, R, -1)


def attend_shared(q, keys, values, mask, prefix_keys, prefix_values) -> torch.Tensor:
    """`attend` over a prefix every row shares (prefix_keys/values [kvh, P, D], one copy
    broadcast over the rows' queries: every query sees all of it) followed by each row's own
    keys/values [B, kvh, S, D] under `mask`. The softmax runs over the two parts' scores side
    by side, i.e. over the concatenation, so the probabilities are those of one attention
    over prefix + own keys; the two weighted sums are added. A `mask` wider than the rows'
    own keys covers the prefix's columns first: rows that do not start from the prefix (an
    online request beside a batch's lines) have them masked, as if it were not there."""
    B, heads, T, D = q.shape
    kv_heads, P = keys.shape[1], prefix_keys.shape[1]
    rep = heads // kv_heads
    grouped = q.reshape(B, kv_heads, rep * T, D)
    shared = torch.matmul(grouped, prefix_keys.transpose(1, 2)).view(B, heads, T, P) * D ** -0.5
    if mask.shape[-1] > keys.shape[2]:
        shared = shared.masked_fill(~mask[..., :P], torch.finfo(shared.dtype).min)
        mask = mask[..., P:]
    own = grouped_scores(grouped, keys).reshape(B, heads, T, -1)
    own = own.masked_fill(~mask, torch.finfo(own.dtype).min)
    probs = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    probs = probs.view(B, kv_heads, rep * T, -1)
    out = torch.matmul(probs[..., :P], prefix_values) + torch.matmul(probs[..., P:], values)
    return out.view(B, heads, T, -1).transpose(1, 2).reshape(B, T, -1)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, *, renormalise: bool, cast: bool):
    """Router over normalised tokens x [N, H]: (weights [N, k], experts [N, k]). Softmax in
    fp32 over all experts, top-k, optionally renormalised over the k; `cast` brings the
    weights to the activation dtype (Qwen, OLMoE) instead of keeping fp32 (Mixtral)."""
    scores = F.linear(x, router)
    weights, experts = torch.topk(torch.softmax(scores.float(), dim=-1), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(scores.dtype) if cast else weights), experts


def group_mask(group_scores: torch.Tensor, keep: int, num_experts: int) -> torch.Tensor:
    """[N, E] bool: the experts of each token's `keep` best groups, the E experts split into
    equal groups scored by `group_scores` [N, groups] (DeepSeek's group-limited routing)."""
    idx = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, idx, 1)
    return mask.unsqueeze(-1).expand(-1, -1, num_experts // group_scores.shape[1]).reshape(-1, num_experts).bool()


def swiglu(x: torch.Tensor, w: dict, prefix: str = "") -> torch.Tensor:
    """SwiGLU FFN over tokens x [N, H]: w2(silu(w1 x) * w3 x), weights named prefix + w1/w2/w3."""
    up = F.silu(int4.linear(x, w, prefix + "w1")) * int4.linear(x, w, prefix + "w3")
    return int4.linear(up, w, prefix + "w2")


def slots(tokens: int, top_k: int, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The [tokens, k, H] buffer of weighted expert outputs of a MoE layer, in the dtype the
    product of an output and its router weight promotes to."""
    dtype = torch.promote_types(x.dtype, weights.dtype)
    return torch.zeros(tokens, top_k, x.shape[-1], dtype=dtype, device=x.device)


def combine(buffer: torch.Tensor, dtype: torch.dtype, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the slots in top-k order, cast once; then add the shared expert's output, if any."""
    out = buffer.sum(dim=1).to(dtype)
    return out if shared is None else out + shared


def attention_block(h, w: dict, cos, sin, mask, cache_write, spec, qkv, max_scores: int | None = None,
                    attend=None, attend_at=None, prefix=None):
    """Residual attention sub-layer for one batch. `qkv(x, w, spec)` is the family's projection
    to q [B, T, h, D], k, v [B, T, kvh, D] before RoPE. `cache_write(k, v)` stores this step's
    keys/values and returns every key/value the batch has so far. Queries are taken in
    chunks so that at most `max_scores` attention scores exist at once (a long prefill
    would otherwise hold B x heads x T x S of them); each query row's result is unchanged.
    `attend` is the family's attention over (q, keys, values, mask) where it is not plain;
    `attend_at(attend)` runs it elsewhere (the host, beside a host KV cache: the caller moves
    q in and the output back; the math is the same function). `prefix` = (keys, values)
    [kvh, P, D] of a prompt prefix every row shares, attended before the rows' own keys
    (`attend_shared`; plain attention only)."""
    # `attend` looked up per call: the profile's tests count the calls
    attend, shared = attention_core(attend or globals()["attend"], prefix, attend_at)
    x = rms_norm(h, w["input_norm"], spec.rms_norm_eps)
    q, k, v = (t.transpose(1, 2) for t in qkv(x, w, spec))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache_write(k, v)
    return h + linear(in_blocks(attend, q, keys, values, mask, max_scores, shared), w, "o")


def attention_core(attend, prefix=None, attend_at=None):
    """(the attention a block calls, the shared prefix's key count): `attend` over the rows' own
    keys, or `attend_shared` where a prefix every row shares is attended first (plain attention
    only); moved by `attend_at` beside a host KV cache."""
    shared = 0
    if prefix is not None:
        attend = functools.partial(attend_shared, prefix_keys=prefix[0], prefix_values=prefix[1])
        shared = prefix[0].shape[1]
    if attend_at is not None:
        attend = attend_at(attend)
    return attend, shared


def in_blocks(attend, q, keys, values, mask, max_scores: int | None, shared: int = 0) -> torch.Tensor:
    """`attend(q, keys, values, mask)` -> [B, T, ...], computed in blocks of rows and queries
    (score_blocks), each written into its place: beside the result only one block's scores
    and output exist at a time. `shared`: keys of a shared prefix each query scores too."""
    B, heads, T, _ = q.shape
    rows, step = score_blocks(B, heads, T, keys.shape[2] + shared, max_scores, cpu=q.device.type == "cpu")
    if rows >= B and step >= T:
        return attend(q, keys, values, mask)
    out = None
    for b in range(0, B, rows):
        for i in range(0, T, step):
            y = attend(q[b:b + rows, :, i:i + step], keys[b:b + rows], values[b:b + rows], mask[b:b + rows, :, i:i + step])
            if out is None:
                out = y.new_empty(B, T, *y.shape[2:])
            out[b:b + rows, i:i + step] = y
    return out


# On a CPU, scores past the last-level cache cost their passes (scale, mask, softmax, the
# weighted sum) at memory speed, so they go in blocks that fit it (same results bit for bit;
# figures in docs/benchmarks.md). A GPU keeps whole batches.
CACHE_SCORES = 1 << 20


def score_blocks(B: int, heads: int, T: int, S: int, max_scores: int | None, cpu: bool) -> tuple[int, int]:
    """(rows, queries) of one block of an attention whose scores are B x heads x T x S: at most
    `max_scores` scores at once (memory), and on a CPU at most CACHE_SCORES (speed). Every row
    and query attends over all its keys in any block, so each result is unchanged."""
    whole, row = B * heads * T * S, heads * T * S
    cap = min(max_scores or whole, CACHE_SCORES if cpu else whole)
    return max(1, min(B, cap // row)), T if row <= cap else max(1, cap // (heads * S))


def embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def logits(h: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    return prepacked.linear(rms_norm(h, norm, eps, offset), head).float()
