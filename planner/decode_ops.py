"""What a decode layer step issues, predicted for a plan: the kernels (ATen ops that compute or
copy: on a GPU each is a launch the host pays for) and the transfers submitted to the
engine's channels. Counted, never timed: the same on every machine, so a test can check them
against a real run's counts (tests/test_plan_ops.py).

Kernels per decode layer, averaged over the layers, are the sum of

  * the pipeline's own ops (the profile's `launches`, counted by the engine with the model
    math stubbed out: klotski/measure/overhead.py): one `layer` (routing bookkeeping, the
    sort, the top-k slots, their sum), n `batch_layer`s, an `expert_call` per expected
    distinct expert, a `transfer` per group moved to the device (submitting it, the copies
    on a CPU, where they run on the compute thread, the wave over what landed), a `kv_layer`
    per batch whose KV cache comes from the host, and a step's own (`step`: embedding, LM
    head) spread over its layers;
  * the model math (the profile's `kernels`, counted by the engine's ops factory): n
    attention blocks and shared experts, one routing, and the expert FFN calls of the waves:
    a wave's ops do not grow with its experts where the grouped kernel runs (`wave_group` is
    0 there), only with its calls, each over at most as many (token, slot) pairs as the group
    has tokens: min(k, R) for the wave over R resident experts, and for the experts moved,
    their share of the pairs plus half a call per landing (its last call part-filled), at least
    one a landing (planner/waves.py counts them, for the time model too).

Submissions per decode layer (transfers handed to a channel): the attention and the gate
when they are not on the device, the experts moved (a run of one layer's host-tier 16-bit
experts, 16-bit or packed, in one submission, up to MAX_RUN; disk-tier ones one each): the K hot ones
prefetched, then the chosen others after routing: a run into the expert pool's free slots
(`slots` less those the prefetched hold) and, when more were chosen than are free, one more
run landing beside the pool (its overflow); one disk read per disk-tier group (the
disk window stages a layer's groups whether chosen or not); and, per batch whose KV cache is
on the host and attends on the device, one load and one store. Runs are as long as MAX_RUN
allows: with the device at its minimum working set a run holds what fits, and more
submissions carry the same experts. Not counted: host compute (its moves and its ops), and
the decoding of packed groups (HQQ, MXFP4, GGUF blocks): a resident one's at each use, a moved
run's in codec calls over its stacked rows."""
from __future__ import annotations

import math

from planner.waves import resident_calls, wave_calls

# Experts one submission takes at most (a run of one layer's experts; execute/residency.py
# takes it from here).
MAX_RUN = 64


def chosen_probability(marg, tokens: int) -> list[float]:
    """Each expert's probability that at least one of `tokens` tokens picks it."""
    return [1 - (1 - min(1.0, m)) ** tokens for m in marg]


def _more_than(k: int, chances: list[float]) -> float:
    """The probability that more than `k` of independent events with these `chances` happen."""
    at = [1.0] + [0.0] * (k + 1)  # at[j]: exactly j so far (j = k + 1: more than k)
    for p in chances:
        for j in range(k + 1, 0, -1):
            at[j] = at[j] * (1 - p) + at[j - 1] * p if j <= k else at[j] + at[j - 1] * p
        at[0] *= 1 - p
    return at[k + 1]


def _layer(io, cost, bs, n, marg, hot, schedule, host_attention, slots) -> tuple[float | None, float]:
    """(kernels or None where the profile has no counts, submissions) of one decode layer."""
    shape, counts = cost.shape, cost.profile.kernels
    chosen = chosen_probability(marg, n * bs)
    experts = list(io.experts)
    off = [e for e, tier in enumerate(experts) if tier != "device"]
    resident = len(experts) - len(off)
    # the K hot experts the predictor picks, off the device as often as the picks are (the
    # engine's predictor learns its own: in proportion to popularity, not the plan's set);
    # FlexGen-style schedules move the next layer's every expert, chosen or not
    if schedule in ("simple", "multibatch"):
        prefetched = float(len(off))
    else:
        prefetched = len(hot) * sum(marg[e] for e in off) / max(sum(marg[:len(experts)]), 1e-12)
    unfetched = 1 - prefetched / len(off) if off else 0.0  # an off-device expert's chance it was not prefetched
    host_tier = [e for e in off if experts[e] == "host"]
    share = len(host_tier) / len(off) if off else 0.0

    def in_runs(count: float) -> float:  # submissions carrying `count` host-tier experts, certainly moved
        return count if count < 1 else math.ceil(count / MAX_RUN)
    later = [chosen[e] * unfetched for e in host_tier]  # moved after routing, each with this chance
    expected = sum(later)
    # a run into the pool's free slots (those the prefetched experts left), and what does not fit
    # there in one more run beside the pool (its overflow: placement/cache.py)
    free = max(0, round(slots - prefetched))
    after_routing = (1 - math.prod(1 - p for p in later)) + _more_than(free, later)
    later_disk = sum(chosen[e] * unfetched for e in off if experts[e] == "disk")
    expert_subs = in_runs(prefetched * share) + after_routing + later_disk + prefetched * (1 - share)
    moved_experts = prefetched + expected + later_disk
    weights = (io.attn != "device") + (io.gate != "device")
    kv_moves = n * (io.kv == "host" and not host_attention)
    disk_reads = (io.attn == "disk") + (io.gate == "disk") + experts.count("disk")
    subs = weights + expert_subs + 2 * kv_moves + disk_reads
    if not counts:
        return None, subs
    distinct = sum(chosen[:len(experts)])
    launches = cost.launches(batch_layers=n, expert_calls=distinct, transfers=moved_experts + weights,
                             kv_layers=kv_moves, layers=1, steps=1 / shape.num_layers)
    # the resident wave's calls; the moved experts' pairs in calls, half a call more per landing
    tokens = n * bs
    calls = resident_calls(tokens, shape.top_k, resident)
    if off:
        calls += wave_calls(tokens * sum(marg[e] for e in off), tokens, expert_subs)
    math_ops = (n * (counts.get("attention", 0.0) + counts.get("shared", 0.0)) + counts.get("router", 0.0)
                + calls * counts.get("wave", 0.0) + distinct * counts.get("wave_group", 0.0))
    return launches + math_ops, subs


def decode_layer_ops(cost, ios, bs: int, n: int, marg, hot, schedule: str, host_attention: bool = False,
                     head: str = "device", slots: int = 0) -> dict:
    """{"kernels": per decode layer (None: the profile counted none), "submissions": per decode
    layer}, averaged over the layers of `ios` (each layer's tiers), for n batches of bs rows
    with routing marginals `marg` and the `hot` experts prefetched (the module docstring); the
    LM head off the device (`head`: its tier) adds its move once a step, spread over the layers."""
    per = [_layer(io, cost, bs, n, marg, hot, schedule, host_attention, slots) for io in ios]
    head_moves = (head != "device") * (1 + (head == "disk")) / len(per)  # a disk read, then the link
    kernels = None if per[0][0] is None else sum(k for k, _ in per) / len(per) + cost.launches(transfers=head_moves)
    return {"kernels": kernels, "submissions": sum(s for _, s in per) / len(per) + head_moves}
