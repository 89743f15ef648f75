"""Choose batch size, number of batches n and tensor placement for a batch group.

Placement is a small MILP (which groups stay on device, host, disk, minimising the busiest
link's time per decode step under the three budgets, KV cache and working set included).
For each candidate batch size, n is the smallest satisfying inequalities (4)–(7) under the
placement at that n; since a larger n leaves less room for resident weights, the search
re-places at the new n until it stops moving, or memory caps it (then the n with the best
predicted throughput below the cap). The search places greedily by seconds saved per byte
(the MILP's objective) to stay fast; the best few (bs, n) are then placed by the MILP and
re-predicted, and the best of those is the plan. Nothing here allocates or moves a byte.
A candidate's predicted times come from planner.prediction; when nothing fits, the refusal
(which budget is short, and its smallest working value) from planner.infeasible.
"""
from __future__ import annotations

import math

from planner.costmodel import popularity_marginals
from planner.infeasible import Infeasible, diagnose, short_budget
from planner.layer import (FLEXGEN_INEQUALITIES, INEQUALITIES, NO_HOST, SCHEDULES, Host, Phase, flexgen_terms,
                           ineq_terms)
from planner.occupancy import BATCHING
from planner.place import Budgets, layer_ios, place_greedy, place_milp, resident_bytes, resident_kinds
from planner.prediction import JobLengths, predict_group
from planner.workingset import (chunk_candidates, device_need, host_ring_bytes, newcomer_room, pool_slots_planned,
                                prefill_chunk, working_set)
from planner.report import Plan, format_plan, make_plan
from planner.shapes import as_shape

__all__ = ["solve", "Plan", "Budgets", "Infeasible", "format_plan", "working_set"]


# ---- n from the inequalities -----------------------------------------------------------------
def _hot_set(marg, K) -> frozenset:
    return frozenset(sorted(range(len(marg)), key=lambda e: -marg[e])[:K])


def _required_n(cost, ios, bs, P, G, schedule, hot, marg, max_n, host=NO_HOST):
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
                t_a, t_m, io_moe = flexgen_terms(cost, io, ph, marg, host=host)
                pairs = [(t_a, io_moe), (t_m, cost.t_fetch(cost.attention_bytes, io.next_attn))]
            else:
                lhs, rhs, _ = ineq_terms(cost, io, ph, marg, hot, schedule, host=host)
                pairs = list(zip(lhs, rhs))
            for i, (l, r) in enumerate(pairs):
                ok[i] = ok[i] and l >= r * (1 - 1e-9)
        for i, good in enumerate(ok):
            if good and need[i] is None:
                need[i] = n
        if all(ok):
            return n, need
    return None, need


# ---- the solver ------------------------------------------------------------------------------
BATCH_SIZES = (1, 2) + tuple(range(4, 65, 4))
# With the KV cache and attention on the host the device holds no KV: MoE-Gen's very large
# batches become possible, and they are what amortises streaming every expert each step.
LARGE_BATCH_SIZES = (128, 256, 512, 1024, 2048)
MODES = ("auto", "on", "off")


def solve(shape, cost, budgets, *, prompt_len: int, gen_len: int, longest_prompt: int | None = None,
          batch_sizes=BATCH_SIZES, max_n: int = 64, schedule: str = "klotski", K: int | None = None,
          num_batches: int | None = None, chunk: int | None = None, max_sequences: int | None = None,
          popularity=None, finalists: int = 3, host_attention: str = "off", host_experts: str = "off",
          gen_lens=None, batching: str = "continuous", prompt_lens=None,
          window: int | None = None, next_gate: bool = False, segments=()) -> Plan:
    """Best (batch size, n, placement) for generating `gen_len` tokens after `prompt_len`.

    `cost` is a CostModel for `shape`; `budgets` a Budgets or {"device", "host"[, "disk"]}
    in bytes; `longest_prompt` (default prompt_len) is what memory is planned for, while time
    is planned for `prompt_len`; `K` hot experts prefetched per layer (default top_k);
    `num_batches` fixes n and `chunk` the prefill chunk (default: chosen per (bs, n), see
    workingset.prefill_chunk); `max_sequences` caps n·bs (a group larger than the job is
    idle); `popularity` is routing statistics as accepted by `expected_distinct_experts`.
    Transfer buffers are planned for overlap where that fits, else at the minimum the
    pipeline can run in.
    The search over (bs, n) places tensors greedily (by seconds saved per byte, which is
    what the MILP optimises too); the best `finalists` are then placed by the MILP and
    re-predicted, so the plan's placement is the MILP's. Raises Infeasible naming the short
    budget and the smallest value of it that works when nothing fits.

    `host_attention` and `host_experts` (auto | on | off, the engine's knobs) let the host
    CPU compute attention next to a host-resident KV cache and experts where they live (see
    layer.Host). Under auto, host attention is tried for batch sizes where the cost model
    finds it sooner than moving the KV prefix, and the faster plan wins; with it, batch
    sizes up to LARGE_BATCH_SIZES are tried too (unless `batch_sizes` fixes one).
    `gen_lens` (the job's max_new_tokens, in job order) and `batching` give the decode slot
    utilisation (planner.occupancy) by which computed rows become useful tokens/s;
    `prompt_lens` (the job's prompt lengths) the attention of each batch's left padding;
    `window` is how many of the job's lines the engine batches together (RunConfig.window;
    None: all of them), since its batches are formed by length within a window. `segments`
    ((end, tokens) each): shared prompt prefixes the engine prefills once each, `prompt_lens`
    then being what each line prefills itself (prediction.JobLengths).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    for name, mode in (("host_attention", host_attention), ("host_experts", host_experts)):
        if mode not in MODES:
            raise ValueError(f"{name} {mode!r} is not one of {MODES}")
    if batching not in BATCHING:
        raise ValueError(f"batching {batching!r} is not one of {BATCHING}")
    host_known = math.isfinite(cost.t_host("attend", (1, prompt_len, 1)))
    if getattr(cost.profile, "device", "cuda") == "cpu":
        # the host is the device: the same cores, so nothing computes beside anything (and
        # the lanes of the simulator would pretend it did); `on` still runs, for measuring
        host_attention, host_experts = (("off" if m == "auto" else m) for m in (host_attention, host_experts))
    if "on" in (host_attention, host_experts) and not host_known:
        raise ValueError(f"host compute is on but hardware profile {getattr(cost.profile, 'name', '?')!r} has no host "
                         "rates (a 'host' section with flops and mem_bw); set it to auto or off")
    shape = as_shape(shape)
    budgets = Budgets.of(budgets)
    E = shape.num_experts
    K = shape.top_k if K is None else max(0, min(K, E))
    hot_n = K if schedule in ("klotski", "hot-prefetch") else 0
    marg = popularity_marginals(E, shape.top_k, popularity)
    hot = _hot_set(marg, hot_n)
    if schedule == "simple":
        num_batches = 1
    longest = max(prompt_len, longest_prompt or prompt_len)
    experts = host_experts if host_known else "off"
    attn_modes = {"off": (False,), "on": (True,), "auto": (False, True) if host_known else (False,)}[host_attention]
    job = JobLengths(gen_lens, batching, prompt_lens, window, segments)
    found, first = [], None
    for attn in attn_modes:
        host = Host(attention=attn, experts=experts)
        sizes = sorted(batch_sizes)
        if attn and len(sizes) > 1:
            sizes = sorted(set(sizes) | {b for b in LARGE_BATCH_SIZES if b > sizes[-1]})
        if attn and host_attention == "auto":  # where the cost model would move the core
            sizes = [b for b in sizes if cost.attention_on_host(b, prompt_len + gen_len // 2)]
        for buffers in ("overlap", "minimum"):
            ctx = SearchContext(cost, prompt_len, longest, gen_len, budgets, schedule, hot_n, hot, marg, max_n,
                                buffers, chunk, max_sequences, host, job)
            first = first or ctx
            here = []
            for bs in sizes:
                if max_sequences is not None and bs > max(max_sequences, sizes[0]):
                    continue
                if ctx.greedy(bs, num_batches or 1) is None:
                    continue
                if num_batches is not None:
                    layout = ctx.greedy(bs, num_batches)
                    need = ctx.required(bs, layout, num_batches)[1]
                    n, binding = num_batches, _binding(schedule, need, fixed=True)
                else:
                    n, layout, binding = _choose_n(ctx, bs)
                if buffers == "minimum":
                    binding = f"{binding}; memory: transfer buffers at their minimum (little overlap)"
                here.append((ctx.predict(bs, n, layout)["tokens_per_s"], bs, n, binding, ctx))
            found += here
            if here:
                break
    if not found:
        raise diagnose(first, min(batch_sizes), num_batches or 1)
    best = None
    for _, bs, n, binding, ctx in sorted(found, key=lambda f: f[:4], reverse=True)[:max(1, finalists)]:
        at = _best_chunk(ctx, bs, n)
        # the MILP packs at least as well as the greedy search; keep the greedy layout if it fails
        layout = at.milp(bs, n) or at.greedy(bs, n)
        pred = at.predict(bs, n, layout)
        if best is None or pred["tokens_per_s"] > best[0]["tokens_per_s"] * (1 + 1e-9):
            best = (pred, bs, n, layout, binding, at)
    pred, bs, n, layout, binding, at = best
    return make_plan(cost, shape, budgets, pred, bs, n, layout, at.ios(layout), binding, schedule, hot_n,
                     hot, marg, prompt_len, gen_len, longest=longest, chunk=at.chunk(bs, n), buffers=at.buffers,
                     host=at.host, batching=batching if gen_lens else None,
                     utilisation={b: job(n * bs, b) for b in BATCHING} if gen_lens else None,
                     next_gate=next_gate)



def _best_chunk(ctx: "SearchContext", bs: int, n: int) -> "SearchContext":
    """The search used the largest chunk whose activations take at most PREFILL_SHARE of the
    device; a larger one means fewer prefill passes (each streams every off-device weight)
    but less room for resident weights. Take the chunk with the best predicted throughput."""
    if ctx.fixed_chunk:
        return ctx
    best, best_tps = ctx, ctx.predict(bs, n, ctx.greedy(bs, n))["tokens_per_s"]
    for c in chunk_candidates(ctx.P_mem):
        if c <= ctx.chunk(bs, n):
            continue
        other = ctx.with_chunk(c)
        layout = other.greedy(bs, n)
        if layout is not None and (tps := other.predict(bs, n, layout)["tokens_per_s"]) > best_tps * (1 + 1e-9):
            best, best_tps = other, tps
    return best


class SearchContext:
    """The fixed inputs of one solve, with memoised greedy placements. `P` is the prompt
    length time is planned for, `P_mem` the one memory is planned for."""

    def __init__(self, cost, P, P_mem, G, budgets, schedule, hot_n, hot, marg, max_n, buffers, chunk=None,
                 max_sequences=None, host=NO_HOST, job=None):
        self.cost, self.P, self.P_mem, self.G, self.budgets = cost, P, P_mem, G, budgets
        self.schedule, self.hot_n, self.hot, self.marg, self.max_n = schedule, hot_n, hot, marg, max_n
        self.buffers, self.fixed_chunk, self.max_sequences = buffers, chunk, max_sequences
        self.host, self.job = host, job or JobLengths(None, "continuous")
        self._placed, self._chunks = {}, {}

    def _like(self, **changes) -> "SearchContext":
        args = dict(cost=self.cost, P=self.P, P_mem=self.P_mem, G=self.G, budgets=self.budgets,
                    schedule=self.schedule, hot_n=self.hot_n, hot=self.hot, marg=self.marg, max_n=self.max_n,
                    buffers=self.buffers, chunk=self.fixed_chunk, max_sequences=self.max_sequences,
                    host=self.host, job=self.job)
        return SearchContext(**{**args, **changes})

    def with_budgets(self, budgets) -> "SearchContext":
        return self._like(budgets=budgets)

    def with_chunk(self, chunk: int) -> "SearchContext":
        """The same problem with its prefill chunk fixed at `chunk`."""
        return self._like(chunk=chunk)

    def lean(self) -> "SearchContext":
        """The same problem with transfer buffers at their minimum."""
        return self._like(buffers="minimum")

    def cap(self, bs) -> int:
        """The largest n tried at batch size `bs`."""
        if self.max_sequences is None:
            return self.max_n
        return max(1, min(self.max_n, self.max_sequences // bs))

    def working_set(self, bs, n, chunk=None) -> dict:
        return working_set(self.cost, bs=bs, n=n, prompt_len=self.P_mem, gen_len=self.G,
                           chunk=self.chunk(bs, n) if chunk is None else chunk, schedule=self.schedule,
                           hot=self.hot_n, buffers=self.buffers, host_attention=self.host.attention)

    def chunk(self, bs, n) -> int:
        if self.fixed_chunk:
            return max(1, min(self.fixed_chunk, self.P_mem))
        if (bs, n) not in self._chunks:
            ws = self.working_set(bs, n, chunk=1)
            rest = device_need(ws, self.buffers) - ws["activations"]
            self._chunks[bs, n] = prefill_chunk(self.cost, bs, n, self.P_mem, self.G, self.budgets.device, rest,
                                                self.host.attention)
        return self._chunks[bs, n]

    def greedy(self, bs, n):
        if (bs, n) not in self._placed:
            self._placed[bs, n] = place_greedy(self.cost, bs, n, self.P_mem, self.G, self.budgets, self.schedule,
                                               self.hot_n, self.marg, chunk=self.chunk(bs, n), buffers=self.buffers,
                                               host_attention=self.host.attention,
                                               host_ring=host_ring_bytes(self.cost, self.host))
        return self._placed[bs, n]

    def milp(self, bs, n):
        return place_milp(self.cost, bs, n, self.P_mem, self.G, self.budgets, self.schedule, self.hot_n,
                          self.marg, chunk=self.chunk(bs, n), buffers=self.buffers, host_attention=self.host.attention,
                          host_ring=host_ring_bytes(self.cost, self.host))

    def ios(self, layout):
        s = self.cost.shape
        return layer_ios(layout, s.num_layers, s.num_experts, self.marg)

    def required(self, bs, layout, max_n=None):
        return _required_n(self.cost, self.ios(layout), bs, self.P, self.G, self.schedule, self.hot,
                           self.marg, max_n or self.cap(bs), self.host)

    def predict(self, bs, n, layout):
        return predict_group(self.cost, self.ios(layout), bs, n, self.P, self.G, self.schedule, self.hot,
                             self.marg, layout, self.chunk(bs, n), self.host, self.job(n * bs), self.job,
                             self.newcomer_room(bs, n, layout))

    def newcomer_room(self, bs, n, layout):
        """Device bytes newcomers' caches may take under continuous batching, as a function of
        the longest prompt the engine sizes its rows for (workingset.newcomer_room); None
        (unbounded) when the KV cache lives on the host, as newcomers' caches then do."""
        if self.job.batching != "continuous" or layout.kv.get("host"):
            return None
        cost, L, E = self.cost, self.cost.shape.num_layers, self.cost.shape.num_experts
        resident, chunk = resident_kinds(layout, L, E), self.chunk(bs, n)
        kw = dict(bs=bs, n=n, gen_len=self.G, chunk=chunk, schedule=self.schedule, hot=self.hot_n,
                  host_attention=self.host.attention)

        def free(longest: int) -> float:  # the budget less resident weights and the rows' caches
            kv_layer = n * bs * cost.kv_context(longest + self.G) * cost.kv_bytes_per_token_layer
            return self.budgets.device - resident_bytes(cost, layout, kv_layer)["device"]
        # the pool is opened once, for the plan's longest prompt; the rows are sized again at each fill
        slots = pool_slots_planned(cost, working_set(cost, prompt_len=self.P_mem, buffers=self.buffers, **kw),
                                   self.buffers, resident, free(self.P_mem), schedule=self.schedule, hot=self.hot_n)

        def room(longest: int) -> float:
            return newcomer_room(cost, free(longest), resident,
                                 working_set(cost, prompt_len=longest, buffers="minimum", **kw), slots)
        return room


def _choose_n(ctx: SearchContext, bs):
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
    cands, cap = _candidates(ctx.cap(bs)), None
    for i, cand in enumerate(cands):
        if ctx.greedy(bs, cand) is None:
            lo, hi = cands[i - 1], cand  # refine: the largest n that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ctx.greedy(bs, mid) is not None else (lo, mid)
            cands = cands[:i] + ([lo] if lo != cands[i - 1] else [])
            cap = (hi, short_budget(ctx, bs, hi))
            break
    n = max(cands, key=lambda c: ctx.predict(bs, c, ctx.greedy(bs, c))["tokens_per_s"])
    last = _binding(ctx.schedule, need)
    if req is not None:
        why = f"memory: the {cap[1] if cap else 'device'} budget caps n below the {req} wanted by {last}"
    elif cap:
        why = f"none: inequalities unmet for every n that fits the {cap[1]} budget (n<{cap[0]}; last: {last})"
    else:
        why = f"none: inequalities unmet up to n={ctx.cap(bs)} (last: {last})"
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
