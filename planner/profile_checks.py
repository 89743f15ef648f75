"""Judging a measured profile before it is cached: the machine's load watched through the
whole measure, and the samples checked against each other.

Why both: a profile measured on a 2-core machine while two processes started spinning a few
seconds into the measure held attention at one sequence and 128 keys at 56 ms beside 0.58 ms
at 4 sequences and 512 keys, and was cached; the next run predicted 3.3 tok/s and measured
57.4. The load was read only before the measure (quiet then), and a disturbance lasting two of
the three rounds is the median of every point it covered. A load reader sees a process that
keeps running; the shape checks see what a reader misses (a burst between its reads): within
one op, a point with more work in every dimension is never much faster than a smaller one,
and never slower by far more than its work grows. A sample that breaks them was slowed by
something else (a disturbance only adds time) and is measured again; a profile whose checks
still fail, or measured while the load stayed up, is used for this run only.
"""
from __future__ import annotations

import time

# A point with more work in every dimension this many times faster than a smaller one: the
# smaller one was disturbed (timing noise on a quiet machine stays well within it: 1.06-1.33
# between whole profiles).
FASTER_SLACK = 2.0
# A point this many times slower than its work grows (the larger of its FLOP and byte ratio
# to a smaller point): disturbed. Growth is superlinear where a working set leaves the caches:
# tiny-mixtral's prefill attention at 4 x 512 tokens ran 53x its 1 x 512 (work 4x) in one quiet
# read, 2-14x in others; a disturbance of the kind was 10-100x.
GROWTH_SLACK = 16.0
# Differences under this are timer noise on any machine, never a disturbance worth a re-measure.
NOISE_FLOOR_S = 50e-6
WATCH_EVERY_S = 0.5   # how often the load is read while measuring (a read takes ~16 ms, asleep)
BUSY_READS = 2        # reads that saw other processes' threads before the measure counts as busy
RECHECKS = 2          # rounds of re-measuring the samples that disagree


class LoadWatch:
    """The machine's load read before, every `every` seconds during (between ops: `poll`) and
    after a measure. `busy()` is the caller's reader: other processes' runnable threads when
    they hold enough of the cores to matter, else None."""

    def __init__(self, busy=None, clock=time.perf_counter, every: float = WATCH_EVERY_S):
        self.reader, self.clock, self.every = busy, clock, every
        self.reads, self.busy_reads, self.most = 0, 0, 0.0
        self.last = None

    def poll(self, force: bool = False) -> None:
        if self.reader is None:
            return
        now = self.clock()
        if not force and self.last is not None and now - self.last < self.every:
            return
        self.last = now
        seen = self.reader()
        self.reads += 1
        if seen is not None:
            self.busy_reads += 1
            self.most = max(self.most, float(seen))

    @property
    def busy(self) -> bool:
        """Busy for long enough to matter: BUSY_READS reads (one where only one was made)."""
        return self.reads > 0 and self.busy_reads >= min(BUSY_READS, self.reads)

    def summary(self) -> dict:
        return {"reads": self.reads, "busy_reads": self.busy_reads, "most_other_threads": self.most}


def disagreements(samples: dict[str, list[list[float]]], work) -> set[tuple[str, int]]:
    """(kind, row index) of the samples that break their op's shape: for every pair of points of
    one kind where one has at least the other's every coordinate, the smaller is blamed when it
    is FASTER_SLACK times slower than the larger, the larger when it is GROWTH_SLACK times slower
    than its work grows (`work(kind, point)` -> (FLOPs, bytes)). Always the slow one: a
    disturbance only adds time."""
    blamed = set()
    for kind, rows in samples.items():
        if kind == "wave_empty":
            continue  # one row; its work is a wave's with empty groups, not comparable to `wave`'s
        for i, a in enumerate(rows):
            for j, b in enumerate(rows):
                if i == j or not _at_most(a[:-1], b[:-1]):
                    continue
                ta, tb = a[-1], b[-1]
                if ta > FASTER_SLACK * tb and ta - tb > NOISE_FLOOR_S:
                    blamed.add((kind, i))
                grows = _growth(work, kind, a[:-1], b[:-1])
                if grows is not None and tb > GROWTH_SLACK * grows * ta and tb - ta > NOISE_FLOOR_S:
                    blamed.add((kind, j))
    return blamed


def _at_most(p, q) -> bool:
    return len(p) == len(q) and all(x <= y for x, y in zip(p, q)) and any(x < y for x, y in zip(p, q))


def _work(work, kind, point):
    """(FLOPs, bytes) of a sample's point: a wave's is its experts' at their share of the pairs,
    a host op's the device op's."""
    if kind == "wave":
        k, pairs = point
        f, b = work("expert", (pairs / k,))
        return k * f, k * b
    return work(kind.removeprefix("host_"), point)


def _growth(work, kind, small, big) -> float | None:
    try:
        fa, ba = _work(work, kind, small)
        fb, bb = _work(work, kind, big)
    except (KeyError, ValueError):  # a kind the cost model has no work for: only the faster-bigger rule applies
        return None
    ratios = [y / x for x, y in ((fa, fb), (ba, bb)) if x > 0]
    return max(ratios + [1.0])


def settle(samples, work, retime, rechecks: int = RECHECKS) -> dict:
    """Re-measure the samples that disagree (`retime(kind, index)` -> seconds) until they agree
    or `rechecks` rounds are spent; a sample keeps the faster of its times (a disturbance only
    adds time). Returns what was done: {"disagreed", "remeasured", "still"} for the report."""
    first = disagreements(samples, work)
    remeasured = set()
    blamed = first
    for _ in range(rechecks):
        if not blamed:
            break
        for kind, i in sorted(blamed):
            row = samples[kind][i]
            row[-1] = min(row[-1], retime(kind, i))
            remeasured.add((kind, i))
        blamed = disagreements(samples, work)
    return {"disagreed": len(first), "remeasured": len(remeasured),
            "still": [f"{kind} at {_point(samples[kind][i][:-1])}" for kind, i in sorted(blamed)]}


def _point(values) -> str:
    return "(" + ", ".join(f"{v:g}" for v in values) + ")"


def verdict(watch: LoadWatch, checks: dict) -> tuple[bool, str]:
    """(cache it, why) for the report: cached only when the load stayed down and the samples agree."""
    if watch.busy:
        return False, (f"not cached: other processes held the cores in {watch.busy_reads} of {watch.reads} "
                       f"load reads (up to {watch.most:g} runnable threads)")
    if checks["still"]:
        return False, (f"not cached: {len(checks['still'])} samples still disagree with their op's other "
                       f"sizes after re-measuring ({', '.join(checks['still'][:3])})")
    load = "no load reader" if watch.reads == 0 else f"quiet in {watch.reads} load reads"
    fixed = f"; {checks['remeasured']} disagreeing samples re-measured" if checks["remeasured"] else ""
    return True, f"cached: {load}, samples agree{fixed}"
