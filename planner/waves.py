"""How many grouped calls a layer's expert phase makes, as the engine runs it
(klotski/execute/experts.py `LayerExperts`, klotski/execute/pipeline.py `_experts`/`_waves`):
counted once here for the time model (planner/layer.py, planner/step_ops.py) and the kernel
count (planner/decode_ops.py).

A wave is one grouped call (or a few) over every expert whose weights are on the device: the
layer's resident experts first (their stack), then, as transferred experts land, every one
landed. A call takes at most as many (token, slot) pairs as the group has tokens (and
PREFILL_EXPERT_CHUNK), so a wave of p pairs is ceil(p / rows) calls. Packed experts (HQQ,
MXFP4, GGUF blocks) moved to the device land in the pool and are counted alike; resident ones
decode for their use and each computes as a wave of its own."""
from __future__ import annotations

import math

PREFILL_EXPERT_CHUNK = 4096  # pairs one expert call takes at most (bounds the FFN intermediate)


def call_rows(tokens: float) -> float:
    """Pairs one grouped call takes at most: the group's tokens, at most PREFILL_EXPERT_CHUNK."""
    return max(1.0, min(tokens, PREFILL_EXPERT_CHUNK))


def resident_calls(tokens: float, top_k: int, resident: int) -> float:
    """Calls of the wave over a layer's `resident` stacked experts. It is launched before the
    routing reaches the host, so it computes every row the resident experts could take:
    tokens·min(k, R) (a token picks an expert once), in calls of `call_rows(tokens)`."""
    if tokens <= 0 or resident <= 0:
        return 0.0
    return float(math.ceil(tokens * min(top_k, resident) / call_rows(tokens)))


def wave_calls(pairs: float, tokens: float, waves: float) -> float:
    """Expected calls of `waves` waves sharing `pairs` pairs: the pairs in calls of
    `call_rows(tokens)`, each wave's last call part-filled (half a call on average), and at
    least one call a wave."""
    if waves <= 0 or pairs <= 0:
        return 0.0
    return max(waves, pairs / call_rows(tokens) + 0.5 * waves)


def landing_waves(count: float, fetch: float, call: float, expert: float) -> float:
    """Expected waves over `count` transferred experts landing one after another, `fetch`
    seconds apart (the link's time per expert), when a wave takes every expert landed and
    costs `call` plus `expert` each. While a wave of one ends before the next expert lands
    (fetch ≥ call + expert) each is a wave of its own; while the compute of an expert outruns
    its transfer, a wave takes m = call / (fetch − expert) in steady state (those landed while
    the last one ran); where the link is faster still, everything has landed by the first
    wave. The pool does not bound a wave: what its slots cannot take lands beside it (its
    overflow) and is computed in the same pass (a call per landing, not counted here)."""
    if count <= 1:
        return max(0.0, count)
    if fetch >= call + expert:
        return count
    if fetch <= expert:
        return 1.0
    return max(1.0, count * (fetch - expert) / call)
