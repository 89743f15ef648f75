"""The engine's one waiting queue, which every source of work feeds.

Every source hands its sequences to `Engine.add_request` (schedule/engine.py), which puts them
here: a job file's windows (`klotski generate`), a Ray worker's shards and a Batch API batch at
`BATCH` priority, `klotski serve`'s online requests at `ONLINE` priority from the HTTP threads.
The engine's run (schedule/batching.py) takes waiting sequences at every step: online ones
first, in arrival order and whatever their length, then batch lines in the order the run's
policy chose for them. Finished sequences go back to their source through their `listener`
(schedule/sequences.py), called on the engine's thread; `Engine.run` also yields the ones it
was given.

A source that no longer wants a sequence sets its `leaving` flag from any thread: a waiting
one leaves the queue at the next step, a running one frees its row (`sequences.abandon`).

One lock guards everything here: arrivals and both lanes. Only the engine's thread takes out
of the lanes, but any thread may count them (a waiting limit, /health) while it does.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass

ONLINE, BATCH = 0, 1  # priorities: lower goes first


class QueueFull(Exception):
    """The waiting queue holds its limit of online requests: come back later."""


@dataclass
class OnlineStats:
    """What the online requests shared (klotski serve's GET /health): requests put, those that
    joined a run already going (a batch's or other requests'), runs that computed them, steps
    that computed them and the most one step computed."""
    requests: int = 0
    joined: int = 0
    runs: int = 0
    steps: int = 0
    most_in_one_step: int = 0


@dataclass
class Arrival:
    """One source's sequences, put together (a window's lines share prompt segments)."""
    seqs: list
    priority: int


def _requests(seqs) -> int:
    """Online requests among `seqs`: a request's n samples (and scoring rows) count once."""
    return sum(s.priority == ONLINE and s.sample == 0 for s in seqs)


class Waiting:
    """Sequences waiting for rows: arrivals (any thread) and the two lanes they are moved into
    at each step (`collect`, the engine's thread)."""

    def __init__(self, limit: int | None = None):
        self._lock = threading.RLock()
        self._arrivals: list[Arrival] = []
        self._online: deque = deque()  # FIFO
        self._batch: deque = deque()   # in the run policy's order
        self.limit = limit  # online requests' sequences that may wait at once; None = no limit
        self._stats = OnlineStats()
        self.arrived = threading.Event()  # set by `put`: an idle engine thread wakes

    # ---- any thread ---------------------------------------------------------------------
    def put(self, seqs: list, priority: int) -> None:
        """Queue `seqs` (one request's samples, or a source's lines); QueueFull past the limit
        of online requests."""
        with self._lock:
            if priority == ONLINE:
                if self.limit is not None and self._online_requests() >= self.limit:
                    raise QueueFull(f"{self.limit} requests wait already")
                self._stats.requests += 1
            for s in seqs:
                s.priority = priority
            self._arrivals.append(Arrival(list(seqs), priority))
        self.arrived.set()

    def online_stats(self) -> OnlineStats:
        """What the online requests shared so far (a snapshot)."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def count_online(self, *, joined: int = 0, new_run: bool = False, in_step: int = 0) -> None:
        """The engine's thread counts: requests that joined work already going, a run (`new_run`)
        and a step that computed `in_step` online sequences."""
        with self._lock:
            s = self._stats
            s.joined += joined
            s.runs += new_run
            if in_step:
                s.steps += 1
                s.most_in_one_step = max(s.most_in_one_step, in_step)

    def _online_requests(self) -> int:
        return sum(_requests(a.seqs) for a in self._arrivals) + _requests(self._online)

    def online_waiting(self) -> int:
        """Online requests waiting (a snapshot)."""
        with self._lock:
            return self._online_requests()

    def online_sequences(self) -> int:
        """Online sequences waiting (a snapshot)."""
        with self._lock:
            return sum(len(a.seqs) for a in self._arrivals if a.priority == ONLINE) + len(self._online)

    def online_now(self) -> list:
        """The online sequences waiting, collected or not (a snapshot)."""
        with self._lock:
            return [s for a in self._arrivals if a.priority == ONLINE for s in a.seqs] + list(self._online)

    def pending(self) -> bool:
        """Anything waiting, collected or not."""
        with self._lock:
            return bool(self._arrivals or self._online or self._batch)

    def everything(self) -> list:
        """Every collected sequence waiting, online first (a snapshot)."""
        with self._lock:
            return [*self._online, *self._batch]

    def __len__(self) -> int:
        with self._lock:
            return len(self._online) + len(self._batch)

    def withdraw(self, seqs) -> None:
        """Take `seqs` out wherever they wait (their source stopped)."""
        ids = {id(s) for s in seqs}
        with self._lock:
            for a in self._arrivals:
                a.seqs = [s for s in a.seqs if id(s) not in ids]
            self._arrivals = [a for a in self._arrivals if a.seqs]
            self._online = deque(s for s in self._online if id(s) not in ids)
            self._batch = deque(s for s in self._batch if id(s) not in ids)

    # ---- the engine's thread ------------------------------------------------------------
    def collect(self, order) -> list[Arrival]:
        """Move what arrived into the lanes (batch lines sorted by `order`); return it."""
        with self._lock:
            new, self._arrivals = self._arrivals, []
            self.arrived.clear()
            for a in new:
                if a.priority == ONLINE:
                    self._online.extend(a.seqs)
            lines = [s for a in new if a.priority != ONLINE for s in a.seqs]
            if lines:
                self._batch = deque(sorted([*self._batch, *lines], key=order))
        return new

    def reorder(self, arrange) -> None:
        """The batch lane rearranged as `arrange(lines)` returns it (--order routing)."""
        with self._lock:
            if self._batch:
                self._batch = deque(arrange(list(self._batch)))

    def leaving(self) -> list:
        """Take out the waiting sequences whose source left."""
        with self._lock:
            gone = [s for lane in (self._online, self._batch) for s in lane if s.leaving]
            if gone:
                self._online = deque(s for s in self._online if not s.leaving)
                self._batch = deque(s for s in self._batch if not s.leaving)
            return gone

    def online_first(self) -> bool:
        """Whether admission takes from the online lane now (any online request waits)."""
        with self._lock:
            return bool(self._online)

    def front(self, count: int, key) -> tuple[list, bool]:
        """The first `count` of the lane admission takes from now (the online requests while
        any wait), reordered in place by `key`; and whether that lane is the online one."""
        with self._lock:
            online = bool(self._online)
            lane = self._online if online else self._batch
            head = sorted((lane.popleft() for _ in range(min(len(lane), count))), key=key)
            lane.extendleft(reversed(head))
            return head, online

    def pop(self, count: int, key=None) -> list:
        """The next `count` at most: online first, or with `key` the first by `key` of both
        lanes (a static group: whatever waits is grouped by length, online or not)."""
        with self._lock:
            if key is None:
                out = []
                for lane in (self._online, self._batch):
                    while lane and len(out) < count:
                        out.append(lane.popleft())
                return out
            out = sorted([*self._online, *self._batch], key=key)[:count]
            taken = {id(s) for s in out}
            self._online = deque(s for s in self._online if id(s) not in taken)
            self._batch = deque(s for s in self._batch if id(s) not in taken)
            return out
