"""Gated DeltaNet (the linear attention of Qwen3-Next and Qwen3.5/3.6-MoE) as pure functions,
written once for both families; each family gives only its input projection (`project`).

A linear-attention layer keeps, per sequence, a fixed-size state instead of keys and values: the
causal depthwise conv's last `kernel - 1` inputs ([B, channels, kernel - 1], the compute dtype)
and the delta rule's matrix per value head ([B, value heads, key dim, value dim], fp32). A step
reads the state and returns the new one (the caller keeps it: execute/recurrent.py).

Padding: a batch's rows are left-padded (a row's pads come before its tokens in a step). A pad
is an identity step for the state: the conv's window for a row's first real token is the state
followed by its real inputs (the pads are skipped, not shifted in), and at a pad the delta rule
has no decay (g = 0), no update (k = 0, beta = 0) and reads nothing (q = 0).

Numerics follow transformers' torch path (`torch_chunk_gated_delta_rule` for a step of more than
one token, `torch_recurrent_gated_delta_rule` for one): q and k L2-normalised in fp32, q scaled
by key_dim^-1/2, chunks of 64 tokens, the rule in fp32, the output cast back; the gated RMSNorm
scales by w and silu(z) in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from klotski.models import layers as L

CHUNK = 64  # tokens a chunk of the chunked rule covers (transformers' chunk_size)


def sizes(spec) -> tuple[int, int, int, int]:
    """(key heads, value heads, key dim, value dim) of the checkpoint's linear attention."""
    s = spec.shape
    return s.linear_key_heads, s.linear_value_heads, s.linear_key_dim, s.linear_value_dim


def leading_pads(valid: torch.Tensor) -> torch.Tensor:
    """[B] pads before each row's first real token in this step (a row's pads lead it)."""
    return valid.shape[1] - valid.sum(dim=1)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor):
    """The causal depthwise conv with its state, then silu: x [B, T, C], state [B, C, K - 1], weight
    [C, 1, K] -> (out [B, T, C], new state). Each row's window reads its state immediately
    before its first real input: its pads are dropped from the sequence, not shifted in."""
    B, T, C = x.shape
    K = weight.shape[-1]
    seq = torch.cat([state.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, K-1+T]
    # row b: its pads (at K-1 .. K-1+p) move in front, the state next to its first real input;
    # made whatever the pads (exact with none): asking whether there are any would stop the host
    u = torch.arange(K - 1 + T, device=x.device)[None, :]
    p = leading_pads(valid).to(x.device)[:, None]
    src = torch.where(u >= K - 1 + p, u, u - p).clamp(min=0)
    seq = seq.gather(2, src[:, None, :].expand(B, C, -1)) * (u >= p)[:, None, :].to(seq.dtype)
    out = F.silu(F.conv1d(seq, weight, groups=C))  # [B, C, T]: window t is seq[t : t + K]
    return out.transpose(1, 2).to(x.dtype), seq[:, :, T:].contiguous()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(q, k, v, g, beta, state, valid):
    """The gated delta rule over one step's tokens: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta
    [B, T, Hv], state [B, Hv, Dk, Dv] fp32 -> (out [B, T, Hv, Dv] in v's dtype, new state fp32).
    One token: the recurrent form; more: the chunked form (transformers picks the same way)."""
    dtype = v.dtype
    Hk, Hv = k.shape[2], v.shape[2]
    if Hk != Hv:  # each key head serves Hv / Hk consecutive value heads
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    pad = ~valid.to(q.device)[:, :, None]  # [B, T, 1]: a pad's q, k, v, g and beta are 0
    q, k, v = (t.masked_fill(pad[..., None], 0).transpose(1, 2).float().contiguous() for t in (q, k, v))
    g, beta = (t.masked_fill(pad, 0).transpose(1, 2).float().contiguous() for t in (g, beta))
    q, k = l2norm(q), l2norm(k)  # 0 stays 0
    q = q / (q.shape[-1] ** 0.5)
    rule = recurrent if q.shape[2] == 1 else chunked
    out, state = rule(q, k, v, g, beta, state.float())
    return out.transpose(1, 2).to(dtype), state


def recurrent(q, k, v, g, beta, state):
    """Token by token: S <- S exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q. [B, H, T, D] each."""
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        remembered = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out, state


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same rule a chunk at a time (the WY form): within a chunk the updates are one
    triangular solve and a few products; across chunks the state carries. Trailing zeros pad
    the last chunk: identity steps. [B, H, T, D] each."""
    T = q.shape[2]
    extra = (-T) % chunk
    if extra:
        q, k, v = (F.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
        g, beta = F.pad(g, (0, extra)), F.pad(beta, (0, extra))
    B, H, total, Dk = k.shape
    n = total // chunk
    q, k, v = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)  # log decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    # (I + strictly lower(diag(beta) K K^T * decay))^-1: the chunk's updates folded together
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    fold = torch.linalg.solve_triangular(lower + eye, eye.expand_as(lower), upper=False, unitriangular=True)
    values = fold @ v_beta
    keys_decayed = fold @ (k_beta * cum.exp()[..., None])
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(values)
    for i in range(n):
        fresh = values[:, :, i] - keys_decayed[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + inner[:, :, i] @ fresh
        state = state * cum[:, :, i, -1].exp()[..., None, None] + k[:, :, i].transpose(-1, -2) @ fresh
    return out.reshape(B, H, total, -1)[:, :, :T], state


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each value head's output, times silu of its gate z, in fp32; cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def block(h, w: dict, state: tuple, valid: torch.Tensor, spec, project):
    """The residual linear-attention sub-layer of one batch: h [B, T, H], `state` = (conv [B, C,
    K - 1], matrix [B, Hv, Dk, Dv] fp32) of this layer, `valid` [B, T] (False: a pad). `project(x,
    w, spec)` is the family's input projection -> (q|k|v [B, T, C], z [B, T, Hv, Dv], b, a [B, T,
    Hv]). Returns (h + the layer's output, (new conv state, new matrix))."""
    Hk, Hv, Dk, Dv = sizes(spec)
    B, T, _ = h.shape
    x = L.rms_norm(h, w["input_norm"], spec.rms_norm_eps, spec.norm_offset)
    mixed, z, b, a = project(x, w, spec)
    mixed, conv = causal_conv(mixed, state[0], w["conv"], valid)
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    beta = b.sigmoid()
    g = -w["A_log"].float().exp() * F.softplus(a.float() + w["dt_bias"])
    out, matrix = delta_rule(q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv), g, beta,
                             state[1], valid)
    out = gated_rms_norm(out, w["norm_gate"], z, spec.rms_norm_eps).reshape(B, T, Hv * Dv)
    return h + F.linear(out, w["out"]), (conv, matrix)


def local_shapes(spec, projections: dict) -> dict[str, tuple[int, ...]]:
    """The linear layers' weights by group-local name: the family's `projections`, the conv,
    the decay's constants, the gated norm and the output projection."""
    Hk, Hv, Dk, Dv = sizes(spec)
    C = spec.shape.linear_conv_dim
    return {**projections, "conv": (C, 1, spec.shape.linear_conv_kernel), "dt_bias": (Hv,), "A_log": (Hv,),
            "norm_gate": (Dv,), "out": (spec.shape.hidden_size, Hv * Dv)}


def names(prefix: str, projections: dict) -> dict[str, str]:
    """A linear layer's checkpoint names under `prefix` (`model.layers.{j}.`): the family's
    projections (local name -> module under linear_attn) and the rest, alike in both families."""
    p = prefix + "linear_attn."
    return {"input_norm": prefix + "input_layernorm.weight",
            **{n: p + f"{m}.weight" for n, m in projections.items()},
            "conv": p + "conv1d.weight", "dt_bias": p + "dt_bias", "A_log": p + "A_log",
            "norm_gate": p + "norm.weight", "out": p + "out_proj.weight"}
