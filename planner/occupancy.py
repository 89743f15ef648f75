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
from collections.abc import Callable, Sequence

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


def continuous_steps(prompt_lens: Sequence[int], gen_lens: Sequence[int], bs: int, n: int,
                     widest: Callable[[tuple, int, list], int], lookahead: int = 4,
                     cache_bytes: Callable[[int, int], float] | None = None,
                     room: Callable[[int], float] = lambda longest: float("inf")
                     ) -> tuple[list[list[int]], Counter, float]:
    """Continuous batching replayed step by step with its prefills, as klotski/schedule/batching.py
    runs a window: the first n·bs requests (longest answers first) prefill together in place
    (their prompts returned, priced as a static prefill); after that a step decodes the live
    rows and carries up to n newcomer batches (≤ bs prompts each, the longest of the next
    `lookahead` batches' worth, at most 2n prefilled or prefilling), each taking the chunk
    `widest((rows, columns done, columns left), decode rows, others)` allows beside the
    decode rows and the other newcomers (rows, chunk, columns done), oldest first, those not
    yet given one at a column a row (the engine's rule: workingset.widest_chunk within the
    first prefill step's activations); a prefilled newcomer takes rows as they free.

    A newcomer batch of r prompts, the longest p tokens, needs a cache of `cache_bytes(r, p)`
    bytes beside the others' within `room(longest)` bytes (workingset.newcomer_room: what the
    device has beyond the plan sized for prompts up to `longest`, as the engine sizes its rows
    for the longest prompt waiting at a fill; unbounded where the cache lives on the host):
    the engine takes as many of the next prompts as fit, and where none does they wait, and
    once every row has drained the next n·bs start afresh in a fill of their own, prefilled
    alone (a job at a tight budget runs group after group, nothing prefilled beside a decode
    step).

    Returns (each fill's prompt lengths, in the order they ran; Counter of (live rows,
    newcomer batches, their prompt tokens) -> steps; the slots a decode row attends on
    average). A job of short answers and long prompts waits on these prefills, which
    `live_rows` (newcomers there at once) does not see. A batch's rows share its slots, and
    its newest lines up with every row's newest, so a row attends (and loads from a host
    cache) as many slots as the batch's longest-lived row holds: counted here as the group's
    longest, since the first fill spreads the long answers over the batches (tiny-mixtral,
    10 MB, 2 GB/s: 0.95 M row-slots a layer this way against about 0.97 M the engine loaded
    for its decode rows; a row's own context would say 0.48 M)."""
    reqs = sorted(zip(gen_lens, prompt_lens), key=lambda r: (-r[0], -r[1]))
    rows = n * bs
    fills, queue = [reqs[:rows]], reqs[rows:]
    live = [[g - 1, p + 1] for g, p in fills[0] if g > 1]  # [decode steps left, slots attended]
    spare = room(max((p for _, p in reqs), default=0))
    newcomers = []                                  # [answers, columns left, prompts, columns done, cache bytes]
    steps = Counter()
    q, row_slots, row_steps = 0, 0, 0
    while live or q < len(queue) or newcomers:
        prefilling = [nc for nc in newcomers if nc[1]]
        if q < len(queue) and len(prefilling) < n and len(newcomers) < 2 * n:
            head = sorted(queue[q:q + lookahead * bs], key=lambda r: -r[1])
            queue[q:q + len(head)] = head
            held = sum(nc[4] for nc in newcomers)
            for take in range(min(bs, len(head)), 0, -1):  # the longest first: each take pads to head[0]
                need = cache_bytes(take, head[0][1]) if cache_bytes else 0.0
                if held + need <= spare:
                    batch = queue[q:q + take]
                    q += take
                    # an answer of one token ends with its prefill: it never takes a row
                    newcomers.append([[(g, p) for g, p in batch if g > 1], max(p for _, p in batch), take, 0, need])
                    prefilling.append(newcomers[-1])
                    break
            else:
                if not live and not newcomers:  # nothing fits beside the caches: a fill of its own
                    spare = room(max(p for _, p in queue[q:]))  # rows sized for what waits
                    fills.append(queue[q:q + rows])
                    q += len(fills[-1])
                    live = [[g - 1, p + 1] for g, p in fills[-1] if g > 1]
                    continue
        widths = [1] * len(prefilling)
        for i, nc in enumerate(prefilling):
            others = [(o[2], w, o[3]) for j, (o, w) in enumerate(zip(prefilling, widths)) if j != i and w]
            widths[i] = widest((nc[2], nc[3], nc[1]), len(live), others)
        for nc, w in zip(prefilling, widths):
            nc[1], nc[3] = nc[1] - w, nc[3] + w
        tokens = sum(w * nc[2] for nc, w in zip(prefilling, widths))
        steps[(len(live), sum(w > 0 for w in widths), tokens)] += 1
        if live:
            row_slots += len(live) * max(c for _, c in live)
            row_steps += len(live)
        live = [[left - 1, c + 1] for left, c in live if left > 1]
        for nc in [nc for nc in newcomers if not nc[1]]:   # prefilled: take free rows, oldest first
            take = min(rows - len(live), len(nc[0]))
            live += [[g - 1, p + 1] for g, p in nc[0][:take] if g > 1]
            nc[0] = nc[0][take:]
            if not nc[0]:
                newcomers.remove(nc)
    return [[p for _, p in fill] for fill in fills], steps, row_slots / max(1, row_steps)
