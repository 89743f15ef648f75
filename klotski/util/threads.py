"""How many threads CPU compute gets: the cores this process can actually have now, not the
ones its affinity mask names. torch's intra-op pool splits an op over its threads and waits
for the slowest; when another process holds a core, the thread that lost it stalls every op
(measured in docs/benchmarks.md: a 128-expert job at 158 tok/s on two threads against 840 on
one, at load average 3.8 on 2 cores). So the pool is sized to the cores left over by the
other processes' runnable threads, sampled from /proc, and checked again as a run goes."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

CHECK_EVERY_S = 2.0  # how often a run looks at the machine again
SAMPLES, SAMPLE_GAP_S = 5, 0.004


def cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runnable_here() -> int:
    """This process's threads that are running or ready to run now."""
    count = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            count += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass
    return count


def others_runnable() -> float | None:
    """Other processes' runnable threads now (the median of a few samples of /proc/loadavg's
    running count less this process's own), or None where /proc cannot say."""
    seen = []
    for i in range(SAMPLES):
        try:
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        seen.append(max(0, running - _runnable_here()))
        if i + 1 < SAMPLES:
            time.sleep(SAMPLE_GAP_S)
    return statistics.median(seen)


def compute_threads(total: int | None = None, others: float | None = None) -> int:
    """Threads for CPU compute: the cores not taken by other runnable threads, at least one."""
    total = cores() if total is None else total
    if others is None:
        others = others_runnable()
    if others is None:
        return total
    return max(1, min(total, int(total - others + 0.5)))


def machine_busy() -> float | None:
    """Other processes' runnable threads when they hold a quarter of the cores or more (at least
    one): a speed measured now is not this machine's speed. None when the machine is free."""
    others = others_runnable()
    return others if others is not None and others >= max(1, cores() / 4) else None


def pinned_by_user() -> bool:
    """Whether the environment already fixes the thread count (OMP_NUM_THREADS, MKL_NUM_THREADS)."""
    return any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))


class ThreadGovernor:
    """Keeps torch's CPU thread count at `compute_threads()`, looking again every CHECK_EVERY_S
    (a run's step calls `check`); `fixed` keeps it where the user put it. `history` lists
    (seconds into the run, threads) at each change, for the report."""

    def __init__(self, fixed: int | None = None, clock=time.monotonic):
        import torch
        self.torch, self.clock, self.fixed = torch, clock, fixed
        self.start = self.last = clock()
        self.before = torch.get_num_threads()
        if fixed:
            torch.set_num_threads(fixed)
        self.history = [(0.0, torch.get_num_threads())]
        if not fixed and not pinned_by_user():
            self._apply()
        else:
            self.fixed = fixed or torch.get_num_threads()

    def restore(self) -> None:
        """The engine closes: torch gets back the thread count it had before this run, unless
        something else has set one since."""
        if self.torch.get_num_threads() == self.history[-1][1]:
            self.torch.set_num_threads(self.before)

    def check(self) -> None:
        now = self.clock()
        if self.fixed or now - self.last < CHECK_EVERY_S:
            return
        self.last = now
        self._apply()

    def _apply(self) -> None:
        want = compute_threads()
        if want != self.torch.get_num_threads():
            self.torch.set_num_threads(want)
            self.history.append((round(self.clock() - self.start, 1), want))


class held_threads:
    """torch's CPU thread count at `n` for a `with` block (None: as it is), then back: what a
    profile is measured at when a run fixes its threads (planning.measure_here)."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self):
        import torch
        self.before = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        import torch
        torch.set_num_threads(self.before)

