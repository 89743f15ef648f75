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
from planner.layer import (FLEXGEN_INEQUALITIES, INEQUALITIES, NO_HOST, SCHEDULES, Host, Phase, flexgen_terms,
                           ineq_terms, layer_time)
from planner.occupancy import BATCHING, continuous_steps, live_rows, slot_utilisation
from planner.place import Budgets, layer_ios, place_greedy, place_milp
from planner.workingset import (chunk_candidates, device_need, newcomer_chunks, prefill_chunk, staging_bytes,
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


# ---- prediction ------------------------------------------------------------------------------
def _predict(cost, ios, bs, n, P, G, schedule, hot, marg, layout, chunk=None, host=NO_HOST,
             utilisation=1.0, job: "_Job | None" = None) -> dict:
    """Analytic times for one batch group: the prefill passes (one per chunk of `chunk`
    prompt tokens) and G−1 decode steps (decode evaluated at the mean context, attention cost
    being linear in it; with the job's prompts, over the batches' padded width:
    `_Job.padded_prompt`). `utilisation` (decode slot utilisation, see planner.occupancy) turns
    computed rows into useful tokens: `tokens_per_s` is the useful rate. With `job` (the
    job's lengths, `_Job`), the rate is the job's: every prompt prefilled once, in groups of
    n·bs, and its tokens after the first decoded n·bs·utilisation to a step, so a job of
    short answers is planned as prefill-heavy as it is, not as if each ran G tokens. The
    job's prefill also pays the attention of its left padding (`padded_attention_s`, where
    the prompt lengths are known). Under continuous batching a decode step is priced at the
    rows it computes (the replay's live rows), under static at the whole group."""
    groups = Counter(ios)  # layers with the same tiers have the same times

    def step(ph):
        t = bubble = 0.0
        for io, count in groups.items():
            lt, lb = layer_time(cost, io, ph, marg, hot, schedule, host)
            t, bubble = t + count * lt, bubble + count * lb
        t += ph.n * cost.t_head(ph.bs) + cost.t_fetch(cost.head_bytes, layout.head) + cost.t_pipeline(steps=1)
        return t, bubble
    longest_chunk = chunk or max(job.prompts if job and job.prompts else [P])
    chunk = max(1, min(chunk or P, P))
    passes = math.ceil(P / chunk)
    prefill, pb = step(Phase(bs, n, P, chunk))
    prefill, pb = prefill * passes, pb * passes
    # a batch's decode attends over its padded width: its longest prompt's slots, every row
    ctx = (job.padded_prompt(bs) if job and job.prompts else P) + G // 2
    dec, db = step(Phase(bs, n, ctx, 1))
    decode = dec * max(0, G - 1)
    tokens = n * bs * G
    computed = tokens / max(prefill + decode, 1e-12)
    useful = computed * utilisation
    job_split = {}
    if job and job.lens:
        lens = job.lens

        def live_price(at=ctx):  # a continuous step computes its live rows only (static: `dec`, the whole group)
            return _row_prices(lambda b, k: step(Phase(b, k, at, 1))[0], bs, n)
        if job.batching == "continuous" and len(job.prompts) == len(lens):
            def fill_s(p):  # the first fill: a group at its own mean prompt, in passes of the chunk
                width = max(1, min(longest_chunk, p))
                return step(Phase(bs, n, p, width))[0] * math.ceil(p / width)
            # its rows attend their batch's longest-lived row's slots (occupancy.continuous_steps)
            replay = job.continuous(cost.shape, bs, n, longest_chunk, host.attention)
            at = max(1, round(replay[3]))
            job_prefill, job_decode = _continuous_s(replay, cost, bs, n, longest_chunk, fill_s, live_price(at),
                                                    lambda k, new: step(Phase(bs, k, at, new))[0])
        else:
            padding = job.padding(cost, bs, longest_chunk, P)
            if job.batching == "static" and job.prompts:
                # a static group runs the passes of its longest prompt, each streaming every
                # off-device weight again: the passes beyond the mean prompt's at a pass's
                # cost less its attention (`padding` prices that)
                extra = job.static_passes(n * bs, longest_chunk) - passes * len(lens) / (n * bs)
                beside = prefill / passes - n * cost.shape.num_layers * cost.t_attn(bs, P, chunk)
                padding += max(0.0, extra) * max(0.0, beside)
            if job.batching == "continuous":
                at = live_price()
                decoding = sum(steps * at(rows) for rows, steps in job.live(n * bs).items())
            elif len(job.prompts) == len(lens):
                # a static batch leaves the group's steps once all its rows are done
                decoding = sum(steps * step(Phase(bs, k, ctx, 1))[0]
                               for (k, _), steps in job.static_decode(bs, n, longest_chunk).items())
            else:
                decoding = dec * sum(max(0, g - 1) for g in lens) / max(n * bs * utilisation, 1e-12)
            job_prefill, job_decode = prefill * len(lens) / (n * bs) + padding, decoding
        useful = sum(lens) / max(job_prefill + job_decode, 1e-12)
        job_split = {"job_prefill_s": job_prefill, "job_decode_s": job_decode}
    return {"prefill_s": prefill, "decode_s": decode, "tokens_per_s": useful,
            "computed_tokens_per_s": computed, "utilisation": utilisation,
            "prefill_tokens_per_s": n * bs * P / max(prefill, 1e-12),
            "decode_tokens_per_s": n * bs * max(0, G - 1) / max(decode, 1e-12) if G > 1 else 0.0,
            "prefill_bubble_s": pb, "decode_step_s": dec, "decode_bubble_s": db, **job_split}


def _continuous_s(replay, cost, bs, n, chunk, fill_s, price, mixed_s) -> tuple[float, float]:
    """Seconds of the job's prefill and decode under continuous batching, from its replay step
    by step with its prefills (`_Job.continuous`: `occupancy.continuous_steps` over the job's
    first window, weighted to stand for all): the first fill is a static prefill of the prompts it takes (`fill_s(p)`, a
    group at their mean prompt p), plus its padding's attention; then a step of r live rows
    alone costs `price(r)`, and one that carries newcomer batches is priced as one forward
    over the decode batches and the newcomers together, their rows' tokens spread over them
    (`mixed_s(batches, tokens a row)`). A step with rows decoding counts as decode, as the
    engine counts it. The first fill takes the longest answers first, and among equal ones
    the longest prompts: with every answer of one length, medium-mixtral's first fill was
    twice the job's mean prompt, and priced at the mean it came out 0.8 s against 1.9."""
    first, steps, weight, _ = replay
    mean = -(-sum(first) // max(1, len(first)))
    prefill, decode, memo = fill_s(mean) + padded_attention_s(cost, bs, chunk, mean, first), 0.0, {}
    for (rows, batches, tokens), count in steps.items():
        if not batches:
            decode += count * price(rows)
            continue
        k = min(n, -(-rows // bs)) + batches
        key = (k, max(1, -(-(rows + tokens) // (k * bs))))
        if key not in memo:
            memo[key] = mixed_s(*key)
        if rows:
            decode += count * memo[key]
        else:
            prefill += count * memo[key]
    return weight * prefill, weight * decode


def _row_prices(step_s, bs: int, n: int):
    """Seconds of a decode step with r live rows (r ≤ n·bs): the rows fill as few batches as
    hold them; priced at the full group and at halvings of it, linear between."""
    at, rows = {}, n * bs
    while rows >= 1:
        batches = min(n, -(-rows // bs))
        at[rows] = step_s(-(-rows // batches), batches)
        rows //= 2
    known = sorted(at)

    def price(r):
        hi = next((k for k in known if k >= r), known[-1])
        lo = max((k for k in known if k <= r), default=hi)
        return at[lo] if hi == lo else at[lo] + (at[hi] - at[lo]) * (r - lo) / (hi - lo)
    return price


def padded_attention_s(cost, bs: int, chunk: int, P: int, prompts) -> float:
    """What the job's prefill attention costs beyond the group model's (every batch at the
    mean prompt `P`): the engine batches prompts longest first, `bs` to a batch, left-pads
    each to its longest and runs attention over that rectangle in passes of `chunk` columns;
    routing and experts skip the padding, so they are priced at real tokens already. On the
    demo's prompts (53 to 207 tokens, one batch of 32, mean 94) a layer's attention took
    413 ms in one pass of 207 columns and 304 ms in two of 128, against 88 ms priced at the
    mean prompt."""
    def passes(rows, length):
        return sum(cost.t_attn(rows, min(start + chunk, length), min(chunk, length - start))
                   for start in range(0, length, chunk))
    lens = sorted(prompts, reverse=True)
    padded = sum(passes(len(lens[i:i + bs]), lens[i]) for i in range(0, len(lens), bs))
    short = max(1, min(chunk, P))  # the group model's passes: ceil(P / chunk), each over all P keys
    charged = math.ceil(P / short) * cost.t_attn(bs, P, short)
    return max(0.0, padded - len(lens) / bs * charged) * cost.shape.num_layers


# ---- diagnosis of infeasibility ---------------------------------------------------------------
def _diagnose(ctx: "_Ctx", bs: int, n: int) -> Infeasible:
    """Which single budget, raised alone by the least, makes (bs, n) fit, and the smallest
    value that does: a binary search (to a KiB) over the planner's own feasibility test in its
    leanest mode, so a rerun with that value is accepted."""
    budgets, lean = ctx.budgets, ctx.lean()
    fits = lambda b: lean.with_budgets(b).greedy(bs, n) is not None
    best = None
    for name in ("device", "host", "disk"):
        have = getattr(budgets, name)
        if not math.isfinite(have) or not fits(dataclasses.replace(budgets, **{name: math.inf})):
            continue
        lo, hi = have, max(2 * have, have + 2**20)
        while not fits(dataclasses.replace(budgets, **{name: hi})):
            lo, hi = hi, 2 * hi
        while hi - lo > 1024:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(dataclasses.replace(budgets, **{name: mid})) else (mid, hi)
        if best is None or hi - have < best[2] - best[1]:
            best = (name, have, hi)
    if best is None:
        return Infeasible(f"no single budget increase makes bs={bs}, n={n} fit the device, host and disk budgets",
                          "device", math.inf, math.inf, budgets.device)
    name, have, hi = best
    at = lean.with_budgets(dataclasses.replace(budgets, **{name: hi}))
    return Infeasible(f"{name} budget {format_bytes(have)} is too small for this job: "
                      f"{_needs(at, name, bs, n, hi)}", name, hi - have, math.ceil(hi), have)


def _short_budget(ctx: "_Ctx", bs: int, n: int) -> str:
    """The budget that stops (bs, n): host (where a growing KV cache goes) if unlimited host
    memory would fit it, else the device."""
    roomy = ctx.with_budgets(dataclasses.replace(ctx.budgets, host=math.inf))
    return "host" if roomy.greedy(bs, n) is not None else "device"


def _needs(ctx: "_Ctx", name: str, bs: int, n: int, minimum: float) -> str:
    """What (bs, n) needs on tier `name` at its minimum, in words."""
    cost, P, G = ctx.cost, ctx.P_mem, ctx.G
    what = f"{n} batch{'es' if n > 1 else ''} of {bs} sequences of up to {P}+{G} tokens"
    if name == "device":
        chunk = ctx.chunk(bs, n)
        ws = ctx.working_set(bs, n)
        held = device_need(ws, ctx.buffers) - ws["activations"] - ws["decoded"]
        return (f"{what} need at least {format_bytes(minimum)} on the device (activations "
                f"{format_bytes(ws['activations'])} with the prompt prefilled {chunk} token{'s' if chunk > 1 else ''} "
                f"at a time, "
                f"transfer buffers {format_bytes(held + ws['decoded'])}; the rest holds resident weights)")
    kv = cost.kv_bytes(n * bs * cost.kv_context(P + G))
    return (f"{what} need at least {format_bytes(minimum)} of {name} memory (KV cache {format_bytes(kv)}, "
            f"weights {format_bytes(cost.weights_bytes())} in all, disk staging "
            f"{format_bytes(staging_bytes(cost))} when weights are read from disk)")


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
          window: int | None = None) -> Plan:
    """Best (batch size, n, placement) for generating `gen_len` tokens after `prompt_len`.

    `cost` is a CostModel for `shape`; `budgets` a Budgets or {"device", "host"[, "disk"]}
    in bytes; `longest_prompt` (default prompt_len) is what memory is planned for, while time
    is planned for `prompt_len`; `K` hot experts prefetched per layer (default top_k);
    `num_batches` fixes n and `chunk` the prefill chunk (default: chosen per (bs, n), see
    workingset.prefill_chunk); `max_sequences` caps n·bs (a group larger than the job is idle); `popularity` is routing statistics as accepted by
    `expected_distinct_experts`. Transfer buffers are planned for overlap where that fits,
    else at the minimum the pipeline can run in.
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
    None: all of them), since its batches are formed by length within a window.
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
    job = _Job(gen_lens, batching, prompt_lens, window)
    found, first = [], None
    for attn in attn_modes:
        host = Host(attention=attn, experts=experts)
        sizes = sorted(batch_sizes)
        if attn and len(sizes) > 1:
            sizes = sorted(set(sizes) | {b for b in LARGE_BATCH_SIZES if b > sizes[-1]})
        if attn and host_attention == "auto":  # where the cost model would move the core
            sizes = [b for b in sizes if cost.attention_on_host(b, prompt_len + gen_len // 2)]
        for buffers in ("overlap", "minimum"):
            ctx = _Ctx(cost, prompt_len, longest, gen_len, budgets, schedule, hot_n, hot, marg, max_n, buffers, chunk,
                       max_sequences, host, job)
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
        raise _diagnose(first, min(batch_sizes), num_batches or 1)
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
                     utilisation={b: job(n * bs, b) for b in BATCHING} if gen_lens else None)


class _Job:
    """The job's lengths (max_new_tokens, prompt lengths) and what the solver derives from
    them per candidate, memoised: every (bs, n) the search tries asks again. Calling it gives
    the decode slot utilisation of a group of `slots` (1 without lengths)."""

    def __init__(self, gen_lens, batching, prompt_lens=None, window: int | None = None):
        self.lens, self.batching, self._memo = list(gen_lens or ()), batching, {}
        self.prompts = list(prompt_lens or ())
        self.window = window or max(1, len(self.lens), len(self.prompts))

    def ordered(self) -> list[list[int]]:
        """The job's lines as the engine batches them: window by window, each window's
        longest prompt first (a stable sort, as `Engine.groups` sorts)."""
        def order():
            starts = range(0, len(self.prompts), self.window)
            return [sorted(range(a, min(a + self.window, len(self.prompts))), key=lambda i: -self.prompts[i])
                    for a in starts]
        return self._memoised(("ordered",), order)

    def _memoised(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def __call__(self, slots: int, batching: str | None = None) -> float:
        key = ("utilisation", slots, batching or self.batching)
        return self._memoised(key, lambda: slot_utilisation(self.lens, slots, key[2]) if self.lens else 1.0)

    def live(self, slots: int):
        """Decode steps per live-row count under continuous batching (occupancy.live_rows)."""
        return self._memoised(("live", slots), lambda: live_rows([g - 1 for g in self.lens], slots))

    def continuous(self, shape, bs: int, n: int, chunk: int,
                   host_attention: bool = False) -> tuple[list, Counter, float, float]:
        """(first fill's prompts, steps, weight, slots a decode row attends) of the job's first window replayed
        (`occupancy.continuous_steps`), weighted to stand for the whole job; newcomers' chunks
        are sized as the engine sizes them (`workingset.newcomer_chunks`)."""
        def replay():
            w = self.window
            prompts, lens = self.prompts[:w], self.lens[:w]
            widest = newcomer_chunks(shape, shape.dtype_bytes, bs, n, chunk, max(map(sum, zip(prompts, lens))),
                                     host_attention)
            first, steps, span = continuous_steps(prompts, lens, bs, n, widest)
            return first, steps, len(self.lens) / min(len(self.lens), w), span
        return self._memoised(("continuous", bs, n, chunk, host_attention), replay)

    def static_passes(self, group: int, chunk: int) -> int:
        """Prefill passes of the job under static batching: each window's prompts longest
        first, `group` to a group, each group in passes of `chunk` over its longest."""
        def count():
            return sum(math.ceil(self.prompts[o[i]] / chunk) for o in self.ordered() for i in range(0, len(o), group))
        return self._memoised(("passes", group, chunk), count)

    def static_decode(self, bs: int, n: int, chunk: int) -> Counter:
        """Decode steps of the job under static batching, by (batches, rows) they compute:
        the engine forms each window's groups longest prompt first (a stable sort), n batches
        of bs; a batch prefills in passes of `chunk` over its own longest prompt, then decodes
        (beside the group's longer prefills, in steps counted as prefill) until its last row is
        done, and leaves the group's steps. With a few long answers a group runs most of its
        decode steps on the one batch that holds them."""
        def count():
            steps = Counter()
            for order in self.ordered():
                batches = [order[i:i + bs] for i in range(0, len(order), bs)]
                for g in range(0, len(batches), n):
                    group = [(math.ceil(self.prompts[b[0]] / chunk),
                              max(self.lens[i] for i in b) - 1, len(b)) for b in batches[g:g + n]]
                    prefill = max(passes for passes, _, _ in group)
                    ends = sorted((passes + life, rows) for passes, life, rows in group)
                    last = prefill
                    for k, (end, _) in enumerate(ends):  # batches k.. are active until `end`
                        if end > last:
                            steps[(len(ends) - k, sum(rows for _, rows in ends[k:]))] += end - last
                            last = end
            return steps
        return self._memoised(("static decode", bs, n, chunk), count)

    def padded_prompt(self, bs: int) -> float:
        """The prompt width a decode row attends over, on average: the engine left-pads each
        batch of `bs` (formed longest first within a window) to its longest prompt, and every
        row's attention reads the batch's slots. On the demo's prompts (53 to 207 tokens, one
        batch of 32) that is 207 where the mean prompt is 94; a decode step's attention there
        measured 2.9 ms a layer against 1.1 priced at the mean."""
        def width():
            total = sum(self.prompts[o[i]] * len(o[i:i + bs]) for o in self.ordered() for i in range(0, len(o), bs))
            return total / max(1, len(self.prompts))
        return self._memoised(("width", bs), width)

    def padding(self, cost, bs: int, chunk: int, P: int) -> float:
        """`padded_attention_s` of the job's prompts (0 without them)."""
        if not self.prompts:
            return 0.0
        return self._memoised(("padding", bs, chunk, P),
                              lambda: sum(padded_attention_s(cost, bs, chunk, P, [self.prompts[i] for i in o])
                                          for o in self.ordered()))


def _best_chunk(ctx: "_Ctx", bs: int, n: int) -> "_Ctx":
    """The search used the largest chunk whose activations take at most PREFILL_SHARE of the
    device; a larger one means fewer prefill passes (each streams every off-device weight)
    but less room for resident weights. Take the chunk with the best predicted throughput."""
    if ctx.fixed_chunk:
        return ctx
    best, best_tps = ctx, ctx.predict(bs, n, ctx.greedy(bs, n))["tokens_per_s"]
    for c in chunk_candidates(ctx.P_mem):
        if c <= ctx.chunk(bs, n):
            continue
        other = ctx._like(chunk=c)
        layout = other.greedy(bs, n)
        if layout is not None and (tps := other.predict(bs, n, layout)["tokens_per_s"]) > best_tps * (1 + 1e-9):
            best, best_tps = other, tps
    return best


class _Ctx:
    """The fixed inputs of one solve, with memoised greedy placements. `P` is the prompt
    length time is planned for, `P_mem` the one memory is planned for."""

    def __init__(self, cost, P, P_mem, G, budgets, schedule, hot_n, hot, marg, max_n, buffers, chunk=None,
                 max_sequences=None, host=NO_HOST, job=None):
        self.cost, self.P, self.P_mem, self.G, self.budgets = cost, P, P_mem, G, budgets
        self.schedule, self.hot_n, self.hot, self.marg, self.max_n = schedule, hot_n, hot, marg, max_n
        self.buffers, self.fixed_chunk, self.max_sequences = buffers, chunk, max_sequences
        self.host, self.job = host, job or _Job(None, "continuous")
        self._placed, self._chunks = {}, {}

    def _like(self, **changes) -> "_Ctx":
        args = dict(cost=self.cost, P=self.P, P_mem=self.P_mem, G=self.G, budgets=self.budgets,
                    schedule=self.schedule, hot_n=self.hot_n, hot=self.hot, marg=self.marg, max_n=self.max_n,
                    buffers=self.buffers, chunk=self.fixed_chunk, max_sequences=self.max_sequences,
                    host=self.host, job=self.job)
        return _Ctx(**{**args, **changes})

    def with_budgets(self, budgets) -> "_Ctx":
        return self._like(budgets=budgets)

    def lean(self) -> "_Ctx":
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
                                               host_attention=self.host.attention)
        return self._placed[bs, n]

    def milp(self, bs, n):
        return place_milp(self.cost, bs, n, self.P_mem, self.G, self.budgets, self.schedule, self.hot_n,
                          self.marg, chunk=self.chunk(bs, n), buffers=self.buffers, host_attention=self.host.attention)

    def ios(self, layout):
        s = self.cost.shape
        return layer_ios(layout, s.num_layers, s.num_experts, self.marg)

    def required(self, bs, layout, max_n=None):
        return _required_n(self.cost, self.ios(layout), bs, self.P, self.G, self.schedule, self.hot,
                           self.marg, max_n or self.cap(bs), self.host)

    def predict(self, bs, n, layout):
        return _predict(self.cost, self.ios(layout), bs, n, self.P, self.G, self.schedule, self.hot,
                        self.marg, layout, self.chunk(bs, n), self.host, self.job(n * bs), self.job)


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
    cands, cap = _candidates(ctx.cap(bs)), None
    for i, cand in enumerate(cands):
        if ctx.greedy(bs, cand) is None:
            lo, hi = cands[i - 1], cand  # refine: the largest n that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ctx.greedy(bs, mid) is not None else (lo, mid)
            cands = cands[:i] + ([lo] if lo != cands[i - 1] else [])
            cap = (hi, _short_budget(ctx, bs, hi))
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
