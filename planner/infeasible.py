"""Refusals: when nothing fits the budgets, which budget is short, the smallest value of it
that works (found with the solver's own feasibility test, so a rerun with it is accepted),
and what the job needs there, in words."""
from __future__ import annotations

import dataclasses
import math

from planner.workingset import device_need, staging_bytes
from planner.units import format_bytes


class Infeasible(Exception):
    """No plan fits the budgets; `budget` names the short one, `shortfall` says by how much."""

    def __init__(self, message: str, budget: str, shortfall: float, needed: float, available: float):
        super().__init__(message)
        self.budget, self.shortfall, self.needed, self.available = budget, shortfall, needed, available


# `ctx` below is the context of one solve (planner.solve.SearchContext): its budgets, memoised
# greedy placements and working sets.
def diagnose(ctx, bs: int, n: int) -> Infeasible:
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


def short_budget(ctx, bs: int, n: int) -> str:
    """The budget that stops (bs, n): host (where a growing KV cache goes) if unlimited host
    memory would fit it, else the device."""
    roomy = ctx.with_budgets(dataclasses.replace(ctx.budgets, host=math.inf))
    return "host" if roomy.greedy(bs, n) is not None else "device"


def _needs(ctx, name: str, bs: int, n: int, minimum: float) -> str:
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
