"""The engine's one waiting queue, which every source of work feeds.

A job file's windows (`klotski generate`), a Ray worker's shards and a Batch API batch hand
their sequences to `Engine.run`, which puts them here at `BATCH` priority; `klotski serve`'s
online requests are put here from the HTTP threads at `ONLINE` priority. The continuous run
(klotski/schedule/batching.py) takes waiting sequences at every step: online ones first, in
arrival order and whatever their length, then batch lines in the order the run chose for
them. Finished sequences go back to their source: `Engine.run` yields the ones it was given;
every other one has a `listener` (schedule/sequences.py) that the engine calls on its thread.

A source that no longer wants a sequence sets its `leaving` flag from any thread: a waiting
one leaves the queue at the next step, a running one frees its row (`sequences.abandon`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

ONLINE, BATCH = 0, 1  # priorities: lower goes first


class QueueFull(Exception):
    """The waiting queue holds its limit of online requests: come back later."""


@dataclass
class OnlineStats:
    """What the online requests shared (klotski serve's GET /health): requests put, those that
    joined a run already going (a batch's or other requests'), continuous runs that computed
    them, steps that computed them and the most one step computed."""
    requests: int = 0
    joined: int = 0
    runs: int = 0
    steps: int = 0
    most_in_one_step: int = 0


class Waiting:
    """Sequences waiting for rows. `put` may be called from any thread (sequences land in an
    inbound list under a lock); everything else runs on the engine's thread, which moves them
    into its lanes at each step (`collect`)."""

    def __init__(self, limit: int | None = None):
        self._lock = threading.Lock()
        self._inbound: list = []
        self.online: deque = deque()  # FIFO
        self.batch: deque = deque()   # in the run's order (ContinuousRun.order)
        self.limit = limit  # online requests' sequences that may wait at once; None = no limit
        self.stats = OnlineStats()
        self.arrived = threading.Event()  # set by a put: an idle engine thread wakes

    # ---- any thread ---------------------------------------------------------------------
    def put(self, seqs: list, priority: int = ONLINE) -> None:
        """Queue `seqs` (one request's samples); QueueFull past the limit."""
        with self._lock:
            if priority == ONLINE:
                if self.limit is not None and self._requests(self._inbound) + self._requests(self.online) >= self.limit:
                    raise QueueFull(f"{self.limit} requests wait already")
                self.stats.requests += 1
            for s in seqs:
                s.priority = priority
            self._inbound.extend(seqs)
        self.arrived.set()

    @staticmethod
    def _requests(seqs) -> int:
        """Online requests among `seqs`: a request's n samples (and scoring rows) count once."""
        return sum(s.priority == ONLINE and s.sample == 0 for s in seqs)

    def online_waiting(self) -> int:
        """Online requests waiting (a snapshot; any thread)."""
        with self._lock:
            return self._requests(self._inbound) + self._requests(list(self.online))

    def online_sequences(self) -> int:
        """Online sequences waiting (a snapshot; any thread)."""
        with self._lock:
            return sum(s.priority == ONLINE for s in self._inbound) + len(self.online)

    def online_now(self) -> list:
        """The online sequences waiting, collected or not (a snapshot; the engine's thread)."""
        with self._lock:
            return [s for s in self._inbound if s.priority == ONLINE] + list(self.online)

    def pending(self) -> bool:
        """Anything waiting, collected or not."""
        return bool(self._inbound or self.online or self.batch)

    # ---- the engine's thread ------------------------------------------------------------
    def collect(self, order) -> list:
        """Move what arrived into the lanes (batch lines in `order`'s key); return it."""
        with self._lock:
            new, self._inbound = self._inbound, []
            self.arrived.clear()
        self.online.extend(s for s in new if s.priority == ONLINE)
        lines = [s for s in new if s.priority != ONLINE]
        if lines:
            self.batch = deque(sorted([*self.batch, *lines], key=order))
        return new

    def leaving(self) -> list:
        """Take out the waiting sequences whose source left."""
        gone = [s for lane in (self.online, self.batch) for s in lane if s.leaving]
        if gone:
            self.online = deque(s for s in self.online if not s.leaving)
            self.batch = deque(s for s in self.batch if not s.leaving)
        return gone

    def withdraw(self, seqs) -> None:
        """Take `seqs` out wherever they wait (their source stopped)."""
        ids = {id(s) for s in seqs}
        with self._lock:
            self._inbound = [s for s in self._inbound if id(s) not in ids]
        self.online = deque(s for s in self.online if id(s) not in ids)
        self.batch = deque(s for s in self.batch if id(s) not in ids)

    def lane(self) -> deque:
        """Where admission takes from now: the online requests while any wait."""
        return self.online if self.online else self.batch

    def pop(self, count: int) -> list:
        """The next `count` at most, online first."""
        out = []
        for lane in (self.online, self.batch):
            while lane and len(out) < count:
                out.append(lane.popleft())
        return out

    def everything(self) -> list:
        return [*self.online, *self.batch]

    def __len__(self) -> int:
        return len(self.online) + len(self.batch)

    def take_all(self) -> list:
        """Every waiting sequence, collected (a static run takes them all at its start)."""
        self.collect(lambda s: 0)
        out = self.everything()
        self.online.clear()
        self.batch.clear()
        return out
