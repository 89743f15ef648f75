"""Choose batch size, number of batches n and tensor placement for a batch group.

Placement is a small MILP (which groups stay on device, host, disk, minimising the busiest
link's time per decode step under the three budgets, KV cache and working set included).
For each candidate batch size, n is the smallest satisfying inequalities (4)–(7) under the
placement at that n; since a larger n leaves less room for resident weights, the search
re-places at the new n until it stops moving, or memory caps it (then the n with the best
predicted throughput below the cap). The search places greedily by seconds saved per byte
(the MILP's objective) to stay fast; the best few (bs, n) are then placed by the MILP and
re-predicted, and the best of those is the plan. Nothing here allocates or moves a byte.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

from planner.costmodel import popularity_marginals
from planner.layer import (FLEXGEN_INEQUALITIES, INEQUALITIES, SCHEDULES, Phase, flexgen_terms, ineq_terms,
                           layer_time)
from planner.place import (DISK_WINDOW_LAYERS, Budgets, layer_ios, place_greedy, place_milp,
                           working_set)
from planner.report import Plan, format_plan, make_plan
from planner.shapes import as_shape
from planner.units import format_bytes

__all__ = ["solve", "Plan", "Budgets", "Infeasible", "format_plan", "working_set"]


class Infeasible(Exception):
    """No plan fits the budgets; `budget` names the short one, `shortfall` says by how much."""

    def __init__(self, message: str, budget: str, shortfall: float, needed: float, available: float):
        super().__init__(message)
        self.budget, self.shortfall, self.needed, self.available = budget, shortfall, needed, available


# ---- n from the inequalities -----------------------------------------------------------------
def _hot_set(marg, K) -> frozenset:
    return frozenset(sorted(range(len(marg)), key=lambda e: -marg[e])[:K])


def _required_n(cost, ios, bs, P, G, schedule, hot, marg, max_n):
    """Smallest n ≤ max_n meeting every inequality in every (distinct) layer, and for each
    inequality the smallest n meeting it alone (to name the binding one)."""
    if schedule == "simple":
        return 1, [1]
    ctx = P + G // 2
    names = FLEXGEN_INEQUALITIES if schedule == "multibatch" else INEQUALITIES
    need = [None] * len(names)
    for n in range(1, max_n + 1):
        ok = [True] * len(names)
        for io in set(ios):
            ph = Phase(bs, n, ctx, 1)
            if schedule == "multibatch":
                t_a, t_m, io_moe = flexgen_terms(cost, io, ph, marg)
                pairs = [(t_a, io_moe), (t_m, cost.t_fetch(cost.attention_bytes, io.next_attn))]
            else:
                lhs, rhs, _ = ineq_terms(cost, io, ph, marg, hot, schedule)
                pairs = list(zip(lhs, rhs))
            for i, (l, r) in enumerate(pairs):
                ok[i] = ok[i] and l >= r * (1 - 1e-9)
        for i, good in enumerate(ok):
            if good and need[i] is None:
                need[i] = n
        if all(ok):
            return n, need
    return None, need


# ---- prediction ------------------------------------------------------------------------------
def _predict(cost, ios, bs, n, P, G, schedule, hot, marg, layout) -> dict:
    """Analytic times for one batch group: one prefill pass and G−1 decode steps (decode
    evaluated at the mean context, attention cost being linear in it)."""
    groups = Counter(ios)  # layers with the same tiers have the same times

    def step(ph):
        t = bubble = 0.0
        for io, count in groups.items():
            lt, lb = layer_time(cost, io, ph, marg, hot, schedule)
            t, bubble = t + count * lt, bubble + count * lb
        t += ph.n * cost.t_head(ph.bs) + cost.t_fetch(cost.head_bytes, layout.head)
        return t, bubble
    prefill, pb = step(Phase(bs, n, P, P))
    dec, db = step(Phase(bs, n, P + G // 2, 1))
    decode = dec * max(0, G - 1)
    tokens = n * bs * G
    return {"prefill_s": prefill, "decode_s": decode, "tokens_per_s": tokens / max(prefill + decode, 1e-12),
            "prefill_bubble_s": pb, "decode_step_s": dec, "decode_bubble_s": db}


# ---- diagnosis of infeasibility ---------------------------------------------------------------
def _diagnose(cost, bs, n, P, G, budgets: Budgets, schedule, hot) -> Infeasible:
    ws = working_set(cost, bs, n, P, G, schedule, hot)
    dev_min = sum(ws.values())
    what = f"bs={bs}, n={n}"
    if dev_min > budgets.device:
        short = dev_min - budgets.device
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in ws.items() if v)
        return Infeasible(f"device budget {format_bytes(budgets.device)} is {format_bytes(short)} short: "
                          f"the smallest working set ({what}) needs {format_bytes(dev_min)} ({parts})",
                          "device", short, dev_min, budgets.device)
    kv = cost.kv_bytes(n * bs * cost.kv_context(P + G))
    weights = cost.weights_bytes()
    room_dev = budgets.device - dev_min
    staging = DISK_WINDOW_LAYERS * cost.layer_bytes()
    host_room = budgets.host - (staging if weights > room_dev + budgets.host else 0)
    if kv > room_dev + host_room:
        short = kv - room_dev - host_room
        staged = budgets.host - host_room
        return Infeasible(f"host budget {format_bytes(budgets.host)} is {format_bytes(short)} short: the KV cache "
                          f"for {n}×{bs} sequences of {P}+{G} tokens needs {format_bytes(kv)} on host or device"
                          + (f", beside {format_bytes(staged)} of host staging for weights read from disk"
                             if staged else "")
                          + f"; the device has {format_bytes(room_dev)} left after its working set",
                          "host", short, kv + staged, room_dev + budgets.host)
    total = weights + kv
    avail = room_dev + host_room + budgets.disk
    if total > avail:
        # Named after the tier that would take the overflow: disk, unless none is allowed.
        short, name = total - avail, ("disk" if budgets.disk > 0 else "host")
        return Infeasible(f"{name} budget {format_bytes(getattr(budgets, name))} is {format_bytes(short)} short: "
                          f"weights {format_bytes(weights)} + KV {format_bytes(kv)} for {n}×{bs} sequences exceed "
                          f"what device (after its working set), host and disk can hold together",
                          name, short, total, avail)
    return _probe(cost, bs, n, P, G, budgets, schedule, hot)


def _probe(cost, bs, n, P, G, budgets: Budgets, schedule, hot) -> Infeasible:
    """The totals fit but whole groups do not pack: find which single budget, raised by how
    much, makes the greedy placement fit (binary search to a KiB)."""
    marg = [min(1.0, cost.shape.top_k / cost.shape.num_experts)] * cost.shape.num_experts
    fits = lambda b: place_greedy(cost, bs, n, P, G, b, schedule, hot, marg) is not None
    for name in ("host", "device", "disk"):
        have = getattr(budgets, name)
        if not math.isfinite(have) or not fits(dataclasses.replace(budgets, **{name: math.inf})):
            continue
        lo, hi = 0.0, max(1024.0, cost.weights_bytes())
        while not fits(dataclasses.replace(budgets, **{name: have + hi})):
            lo, hi = hi, 2 * hi
        while hi - lo > 1024:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(dataclasses.replace(budgets, **{name: have + mid})) else (mid, hi)
        return Infeasible(f"{name} budget {format_bytes(have)} is {format_bytes(hi)} short at bs={bs}, n={n}: "
                          "the totals fit, but whole tensor groups do not pack into what is left",
                          name, hi, have + hi, have)
    return Infeasible(f"no single budget increase makes bs={bs}, n={n} fit", "device", math.inf, math.inf,
                      budgets.device)


# ---- the solver ------------------------------------------------------------------------------
def solve(shape, cost, budgets, *, prompt_len: int, gen_len: int, batch_sizes=tuple(range(4, 65, 4)),
          max_n: int = 64, schedule: str = "klotski", K: int | None = None, num_batches: int | None = None,
          popularity=None, finalists: int = 3) -> Plan:
    """Best (batch size, n, placement) for generating `gen_len` tokens after `prompt_len`.

    `cost` is a CostModel for `shape`; `budgets` a Budgets or {"device", "host"[, "disk"]}
    in bytes; `K` hot experts prefetched per layer (default top_k); `num_batches` fixes n;
    `popularity` is routing statistics as accepted by `expected_distinct_experts`.
    The search over (bs, n) places tensors greedily (by seconds saved per byte, which is
    what the MILP optimises too); the best `finalists` are then placed by the MILP and
    re-predicted, so the plan's placement is the MILP's. Raises Infeasible naming the short
    budget when nothing fits.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    shape = as_shape(shape)
    budgets = Budgets.of(budgets)
    L, E = shape.num_layers, shape.num_experts
    K = shape.top_k if K is None else max(0, min(K, E))
    hot_n = K if schedule in ("klotski", "hot-prefetch") else 0
    marg = popularity_marginals(E, shape.top_k, popularity)
    hot = _hot_set(marg, hot_n)
    P, G = prompt_len, gen_len
    if schedule == "simple":
        num_batches = 1
    ctx = _Ctx(cost, P, G, budgets, schedule, hot_n, hot, marg, max_n)

    found, first_failure = [], None
    for bs in sorted(batch_sizes):
        if ctx.greedy(bs, num_batches or 1) is None:
            first_failure = first_failure or _diagnose(cost, bs, num_batches or 1, P, G, budgets, schedule, hot_n)
            continue
        if num_batches is not None:
            layout = ctx.greedy(bs, num_batches)
            need = _required_n(cost, ctx.ios(layout), bs, P, G, schedule, hot, marg, num_batches)[1]
            n, binding = num_batches, _binding(schedule, need, fixed=True)
        else:
            n, layout, binding = _choose_n(ctx, bs)
        found.append((ctx.predict(bs, n, layout)["tokens_per_s"], bs, n, binding))
    if not found:
        # The greedy search keeps every transfer buffer; the MILP may still pack the smallest
        # batch by keeping whole groups resident. Last resort before giving up.
        bs, n = min(batch_sizes), num_batches or 1
        layout = place_milp(cost, bs, n, P, G, budgets, schedule, hot_n, marg)
        if layout is None:
            raise first_failure
        found.append((ctx.predict(bs, n, layout)["tokens_per_s"], bs, n, "memory: only the smallest batch fits"))
    best = None
    for _, bs, n, binding in sorted(found, reverse=True)[:max(1, finalists)]:
        layout = place_milp(cost, bs, n, P, G, budgets, schedule, hot_n, marg)
        if layout is None:
            continue
        pred = ctx.predict(bs, n, layout)
        if best is None or pred["tokens_per_s"] > best[0]["tokens_per_s"] * (1 + 1e-9):
            best = (pred, bs, n, layout, binding)
    if best is None:
        raise _diagnose(cost, found[0][1], found[0][2], P, G, budgets, schedule, hot_n)
    pred, bs, n, layout, binding = best
    return make_plan(cost, shape, budgets, pred, bs, n, layout, ctx.ios(layout), binding, schedule, hot_n,
                      hot, marg, P, G)


class _Ctx:
    """The fixed inputs of one solve, with memoised greedy placements."""

    def __init__(self, cost, P, G, budgets, schedule, hot_n, hot, marg, max_n):
        self.cost, self.P, self.G, self.budgets = cost, P, G, budgets
        self.schedule, self.hot_n, self.hot, self.marg, self.max_n = schedule, hot_n, hot, marg, max_n
        self._placed = {}

    def greedy(self, bs, n):
        if (bs, n) not in self._placed:
            self._placed[bs, n] = place_greedy(self.cost, bs, n, self.P, self.G, self.budgets,
                                                self.schedule, self.hot_n, self.marg)
        return self._placed[bs, n]

    def ios(self, layout):
        s = self.cost.shape
        return layer_ios(layout, s.num_layers, s.num_experts, self.marg)

    def required(self, bs, layout):
        return _required_n(self.cost, self.ios(layout), bs, self.P, self.G, self.schedule, self.hot,
                           self.marg, self.max_n)

    def predict(self, bs, n, layout):
        return _predict(self.cost, self.ios(layout), bs, n, self.P, self.G, self.schedule, self.hot,
                        self.marg, layout)


def _choose_n(ctx: _Ctx, bs):
    """Iterate: n from the inequalities under the current placement; re-place at that n
    (more KV and activations may push weights off the device, which can raise n). When no
    n within memory and max_n meets them (transfers outgrow compute, e.g. host-resident KV
    on a slow link) take the n with the best predicted throughput."""
    n, layout, req, need = 1, ctx.greedy(bs, 1), None, None
    for _ in range(8):
        req, need = ctx.required(bs, layout)
        if req is not None and req <= n:
            return n, layout, _binding(ctx.schedule, need)
        if req is None or ctx.greedy(bs, req) is None:
            break
        n, layout = req, ctx.greedy(bs, req)
    cands, cap = _candidates(ctx.max_n), None
    for i, cand in enumerate(cands):
        if ctx.greedy(bs, cand) is None:
            lo, hi = cands[i - 1], cand  # refine: the largest n that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ctx.greedy(bs, mid) is not None else (lo, mid)
            cands = cands[:i] + ([lo] if lo != cands[i - 1] else [])
            cap = (hi, _diagnose(ctx.cost, bs, hi, ctx.P, ctx.G, ctx.budgets, ctx.schedule, ctx.hot_n).budget)
            break
    n = max(cands, key=lambda c: ctx.predict(bs, c, ctx.greedy(bs, c))["tokens_per_s"])
    last = _binding(ctx.schedule, need)
    if req is not None:
        why = f"memory: the {cap[1] if cap else 'device'} budget caps n below the {req} wanted by {last}"
    elif cap:
        why = f"none: inequalities unmet for every n that fits the {cap[1]} budget (n<{cap[0]}; last: {last})"
    else:
        why = f"none: inequalities unmet up to n={ctx.max_n} (last: {last})"
    return n, ctx.greedy(bs, n), f"{why}; n={n} maximises predicted throughput"


def _candidates(max_n: int) -> list[int]:
    """n values tried when throughput, not the inequalities, decides: every n up to 8, then
    about 20% apart."""
    out, n = [], 1
    while n <= max_n:
        out.append(n)
        n = n + 1 if n < 8 else int(n * 1.2)
    return out + ([max_n] if out[-1] != max_n else [])


def _binding(schedule, need, fixed=False) -> str:
    names = FLEXGEN_INEQUALITIES if schedule == "multibatch" else INEQUALITIES
    if schedule == "simple":
        return "n=1 (simple schedule)"
    if fixed:
        unmet = [names[i] for i, k in enumerate(need) if k is None]
        return "n fixed" + (f"; unmet: {unmet[-1]}" if unmet else "; all inequalities hold")
    known = [(k if k is not None else math.inf, i) for i, k in enumerate(need)]
    k, i = max(known)
    if k <= 1:
        return "none: n=1 satisfies all inequalities"
    return names[i]
