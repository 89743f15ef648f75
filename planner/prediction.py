"""Predicted times of one batch group: what the solver ranks its candidates (bs, n, placement)
by. The group model prices a prefill and a decode step per layer (layer.layer_time); with the
job's lengths (`JobLengths`) the rate is the job's own: its prompts' padding, its batching's
live rows, its continuous replay."""
from __future__ import annotations

import math
from collections import Counter

from planner.layer import NO_HOST, Phase, layer_time
from planner.occupancy import continuous_steps, live_rows, slot_utilisation
from planner.workingset import newcomer_chunks


def predict_group(cost, ios, bs, n, P, G, schedule, hot, marg, layout, chunk=None, host=NO_HOST,
                  utilisation=1.0, job: "JobLengths | None" = None, newcomer_room=None) -> dict:
    """Analytic times for one batch group: the prefill passes (one per chunk of `chunk`
    prompt tokens) and G−1 decode steps (decode evaluated at the mean context, attention cost
    being linear in it; with the job's prompts, over the batches' padded width:
    `JobLengths.padded_prompt`). `utilisation` (decode slot utilisation, see planner.occupancy)
    turns computed rows into useful tokens: `tokens_per_s` is the useful rate. With `job` (the
    job's lengths, `JobLengths`), the rate is the job's: every prompt prefilled once, in groups
    of n·bs, and its tokens after the first decoded n·bs·utilisation to a step, so a job of
    short answers is planned as prefill-heavy as it is, not as if each ran G tokens. The
    job's prefill also pays the attention of its left padding (`padded_attention_s`, where
    the prompt lengths are known). Under continuous batching a decode step is priced at the
    rows it computes (the replay's live rows), under static at the whole group; its newcomers'
    caches share `newcomer_room(longest prompt)` device bytes (workingset.newcomer_room; None:
    unbounded; where none fits, the engine runs group after group)."""
    room = newcomer_room or (lambda longest: math.inf)
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
            return row_prices(lambda b, k: step(Phase(b, k, at, 1))[0], bs, n)
        if job.batching == "continuous" and len(job.prompts) == len(lens):
            def fill_s(p):  # the first fill: a group at its own mean prompt, in passes of the chunk
                width = max(1, min(longest_chunk, p))
                return step(Phase(bs, n, p, width))[0] * math.ceil(p / width)
            # its rows attend their batch's longest-lived row's slots (occupancy.continuous_steps)
            replay = job.continuous(cost.shape, bs, n, longest_chunk, host.attention, room,
                                    lambda rows, p: cost.kv_bytes(rows * cost.kv_context(p)))
            at = max(1, round(replay[3]))
            job_prefill, job_decode = continuous_s(replay, cost, bs, n, longest_chunk, fill_s, live_price(at),
                                                   lambda k, new: step(Phase(bs, k, at, new))[0])
            fills, steps, weight, _ = replay  # the job's prefill passes, as the engine counts them
            job_split["job_prefill_passes"] = weight * (sum(math.ceil(max(f) / longest_chunk) for f in fills if f)
                                                        + sum(c for (_, b, _), c in steps.items() if b))
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
        job_prefill += segments_s(job.segments, longest_chunk, lambda k, ctx, new: step(Phase(1, k, ctx, new))[0])
        useful = sum(lens) / max(job_prefill + job_decode, 1e-12)
        job_split.update(job_prefill_s=job_prefill, job_decode_s=job_decode)
    return {"prefill_s": prefill, "decode_s": decode, "tokens_per_s": useful,
            "computed_tokens_per_s": computed, "utilisation": utilisation,
            "prefill_tokens_per_s": n * bs * P / max(prefill, 1e-12),
            "decode_tokens_per_s": n * bs * max(0, G - 1) / max(decode, 1e-12) if G > 1 else 0.0,
            "prefill_bubble_s": pb, "decode_step_s": dec, "decode_bubble_s": db,
            "newcomer_room": None if math.isinf(at_longest := room(max(job.prompts) if job and job.prompts else P))
            else at_longest, **job_split}


def continuous_s(replay, cost, bs, n, chunk, fill_s, price, mixed_s) -> tuple[float, float]:
    """Seconds of the job's prefill and decode under continuous batching, from its replay step
    by step with its prefills (`JobLengths.continuous`: `occupancy.continuous_steps` over the
    job's first window, weighted to stand for all): each fill (the first, and any the engine
    starts afresh when no newcomer's cache fits) is a static prefill of the prompts it takes
    (`fill_s(p)`, a group at their mean prompt p), plus its padding's attention; then a step of r live rows
    alone costs `price(r)`, and one that carries newcomer batches is priced as one forward
    over the decode batches and the newcomers together, their rows' tokens spread over them
    (`mixed_s(batches, tokens a row)`). A step with rows decoding counts as decode, as the
    engine counts it. The first fill takes the longest answers first, and among equal ones
    the longest prompts: with every answer of one length, medium-mixtral's first fill was
    twice the job's mean prompt, and priced at the mean it came out 0.8 s against 1.9."""
    fills, steps, weight, _ = replay
    prefill, decode, memo = 0.0, 0.0, {}
    for fill in fills:
        mean = -(-sum(fill) // max(1, len(fill)))
        prefill += fill_s(mean) + padded_attention_s(cost, bs, chunk, mean, fill)
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


def segments_s(segments, chunk: int, pass_s) -> float:
    """Seconds of prefilling the job's shared segments, each once as a one-row batch in passes
    of `chunk` tokens over the keys before them (`pass_s(batches, keys, new tokens)`). Priced
    so, three interleaved rubrics before 48 short lines were predicted as the run without the
    prefix cache: 5.4 tok/s where the run measured 29.9."""
    total = 0.0
    for end, tokens in segments:
        start = end - tokens
        for at in range(start, end, max(1, chunk)):
            new = min(chunk, end - at)
            total += pass_s(1, at + new, new)
    return total


def row_prices(step_s, bs: int, n: int):
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



class JobLengths:
    """The job's lengths (max_new_tokens, prompt lengths) and what the solver derives from
    them per candidate, memoised: every (bs, n) the search tries asks again. Calling it gives
    the decode slot utilisation of a group of `slots` (1 without lengths)."""

    def __init__(self, gen_lens, batching, prompt_lens=None, window: int | None = None, segments=()):
        self.lens, self.batching, self._memo = list(gen_lens or ()), batching, {}
        self.prompts = list(prompt_lens or ())
        # shared prompt segments (klotski/schedule/prefix.py), each prefilled once as one row:
        # (its end: the keys its last pass attends, its tokens); `prompts` are then the tokens
        # each line prefills itself (after its segments)
        self.segments = list(segments or ())
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

    def continuous(self, shape, bs: int, n: int, chunk: int, host_attention: bool = False,
                   room=lambda longest: math.inf, cache_bytes=None) -> tuple[list, Counter, float, float]:
        """(each fill's prompts, steps, weight, slots a decode row attends) of the job's first
        window replayed (`occupancy.continuous_steps`), weighted to stand for the whole job;
        newcomers' chunks are sized as the engine sizes them (`workingset.newcomer_chunks`),
        their caches (`cache_bytes(rows, longest prompt)`) within `room(longest prompt)` bytes."""
        window = self.prompts[:self.window]
        longest, shortest = max(window), min(window)
        ends = (room(longest), room(shortest))  # what tells one room apart from another, for the memo
        if cache_bytes and ends[0] >= 2 * n * cache_bytes(bs, longest):
            room, ends = (lambda _: math.inf), None  # every newcomer the engine takes fits

        def replay():
            w = self.window
            prompts, lens = self.prompts[:w], self.lens[:w]
            widest = newcomer_chunks(shape, shape.dtype_bytes, bs, n, chunk, max(map(sum, zip(prompts, lens))),
                                     host_attention)
            fills, steps, span = continuous_steps(prompts, lens, bs, n, widest, cache_bytes=cache_bytes, room=room)
            return fills, steps, len(self.lens) / min(len(self.lens), w), span
        return self._memoised(("continuous", bs, n, chunk, host_attention, ends), replay)

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

