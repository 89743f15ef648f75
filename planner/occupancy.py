"""Decode slot utilisation of a batch group from the job's output lengths.

A group of `slots` sequences steps together; a step computes a row for every slot, but
only rows of sequences still generating are useful. Static batching fills the slots once
and runs until the longest of them ends (groups are formed by prompt length, not by output
length, so each group's lengths are a draw from the job's); continuous batching refills a
slot as soon as its sequence ends, so only the final drain (the last sequences finishing
at different times) is idle. Both are replayed exactly over the job's lengths in job
order, rather than estimated from moments: the tail is what matters and it depends on the
whole distribution.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence

BATCHING = ("continuous", "static")


def slot_utilisation(gen_lens: Sequence[int], slots: int, batching: str = "continuous") -> float:
    """Useful rows / computed rows over the whole job, with `slots` sequences per group."""
    if batching not in BATCHING:
        raise ValueError(f"batching {batching!r} is not one of {BATCHING}")
    lens = [max(1, int(x)) for x in gen_lens]
    if not lens or slots <= 0:
        return 1.0
    useful = sum(lens)
    if batching == "static":
        steps = sum(max(lens[i:i + slots]) for i in range(0, len(lens), slots))
        return useful / (slots * steps)
    free = [0] * min(slots, len(lens))   # when each slot next frees up (in steps)
    heapq.heapify(free)
    end = 0
    for n in lens:                       # each sequence takes the slot that frees first
        t = heapq.heappop(free) + n
        end = max(end, t)
        heapq.heappush(free, t)
    return useful / (slots * end)


def live_rows(gen_lens: Sequence[int], slots: int) -> Counter:
    """Continuous batching replayed as `slot_utilisation` does: for each number of live rows
    r, how many steps run with r. The engine computes live rows only, so a step of the final
    drain costs what its few rows cost, not a full group's."""
    lens = [int(x) for x in gen_lens if x > 0]
    free = [0] * min(max(1, slots), len(lens))
    heapq.heapify(free)
    change = Counter()                   # step -> live rows gained (+) or lost (-) there
    for n in lens:
        start = heapq.heappop(free)
        change[start] += 1
        change[start + n] -= 1
        heapq.heappush(free, start + n)
    steps, live, last = Counter(), 0, 0
    for t in sorted(change):
        if live:
            steps[live] += t - last
        live, last = live + change[t], t
    return steps
