"""Residency: what the schedule wants on the device and in which order, what it is computing
with, and what goes when room runs out. The pipeline (pipeline.py) says what it wants
(`want`), takes a group when it computes (`get`: started now if nobody did, the wait timed as
bubble) and lets the cache drop what it is done with; this keeps the queue of wanted
transfers, starts them while the device has room (a run of one layer's experts in one
submission), and evicts by Belady's rule (the group needed farthest ahead first): for bytes
among the groups that hold them, for a pool slot (placement.pool) among the pooled experts.

Two priorities on the link (ProMoE): what is wanted on the `weights` channel is a prefetch for a
later layer (SPECULATIVE: it yields the link to demand loads at chunk boundaries, channels.py);
the experts routing chose and whatever `get` must start or wait for are demand loads, and a
prefetch compute comes to wait for is promoted to one."""
from __future__ import annotations

import time
from collections import deque
from itertools import islice

from placement.tiers import OverBudget
from planner.decode_ops import MAX_RUN  # experts one submission takes at most (the plan counts on it)

SPECULATIVE = ("weights",)  # the channels whose wants are prefetches for later layers


class Residency:
    def __init__(self, cache, channels, memory, trace):
        self.cache, self.ch, self.memory, self.trace = cache, channels, memory, trace
        self.wants: deque = deque()  # prefetches in priority order: (key, channel name, claim)
        self.claims: dict = {}   # key -> how often it was taken (by get, or for host compute):
                                 # a want made before its key's latest claim is stale
        self.upcoming: dict = {}  # this layer's experts not computed yet -> their place in compute order
        self.layer = -1
        self.experts_loaded = 0

    def want(self, keys, channel: str, front: bool = False) -> None:
        items = [(k, channel, self.claims.get(k, 0)) for k in keys if not self.cache.present(k)]
        if front:
            self.wants.extendleft(reversed(items))
        else:
            self.wants.extend(items)
        self.pump()

    def claim(self, key) -> None:
        """`key` is taken now: any want of it made before is dropped when it comes up."""
        self.claims[key] = self.claims.get(key, 0) + 1

    def pump(self) -> None:
        """Start wanted transfers in priority order while the device has room; a run of one
        layer's experts wanted on one channel goes in one submission (WeightCache.start_many)."""
        while self.wants:
            key, channel, claim = self.wants[0]
            if claim != self.claims.get(key, 0) or self.cache.present(key):
                self.wants.popleft()
                continue
            if key[0] != "expert":
                if not self.start(key, channel, channel in SPECULATIVE):
                    return
                self.wants.popleft()
                continue
            run, seen = [], set()
            for k, c, n in islice(self.wants, MAX_RUN):
                if (k[:2] != key[:2] or c != channel or n != self.claims.get(k, 0) or self.cache.present(k)
                        or k in seen):
                    break
                run.append(k)
                seen.add(k)
            started = self.cache.start_many(run, self.ch[channel], channel in SPECULATIVE)
            if not started:
                return
            self.experts_loaded += started
            for _ in range(started):
                self.wants.popleft()

    def start(self, key, channel: str, speculative: bool = False) -> bool:
        """Start moving `key` on `channel` unless it is on its way; False if there is no room."""
        if self.cache.present(key):
            return True
        started = self.cache.start(key, self.ch[channel], speculative)
        self.experts_loaded += started and key[0] == "expert"
        return started

    def get(self, key, tensors: bool = True) -> dict | None:
        """Device tensors of `key`, held until released: start it now if nobody did, and time
        any wait as bubble. `tensors=False`: only landed (a pooled expert, computed over the
        pool's tensors)."""
        self.claim(key)
        self.cache.hold(key)
        if not self.cache.present(key):
            self.room_for(key)
            self.start(key, "experts" if key[0] == "expert" else "weights")
        else:
            self.cache.promote(key)  # a prefetch compute now waits for: a demand load's priority
        fetch = self.cache.get if tensors else self.cache.land
        out = self.timed(self.cache.ready(key), lambda: fetch(key), ".".join(map(str, key)))
        if self.cache.needs_decode(key):
            self.make_room(self.cache.decode_nbytes(key), key)
            with self.trace.span("compute", "dequant." + ".".join(map(str, key))):
                return self.cache.decode(key)
        return out

    def wait(self, ticket, name):
        return self.timed(ticket.done(), ticket.wait, name)

    def timed(self, ready: bool, fetch, name):
        """`fetch()`, counting the time as bubble when the data was not there yet."""
        if ready:
            return fetch()
        start = time.perf_counter()
        out = fetch()
        self.trace.waited(name, start, time.perf_counter())
        return out

    def make_room(self, nbytes: int, what) -> None:
        """Evict transient groups until `nbytes` fit, the one needed farthest in the future
        first (Belady): experts already computed, then prefetches for later layers, then this
        layer's experts from the back of the compute order."""
        while not self.memory.fits(nbytes):
            # a pooled expert leaving frees a slot, not bytes
            victims = [k for k in self.cache.transient() if k != what and not self.cache.in_pool(k)]
            if not victims:
                raise OverBudget(
                    f"the device budget ({self.memory.budget} bytes) ran out: {nbytes} bytes needed for {what} "
                    f"with {self.memory.used} in use and nothing left to evict")
            self.cache.release(max(victims, key=self.next_use))

    def room_for(self, key) -> None:
        """Room to move `key`: a pool slot for a pooled expert (another pooled expert evicted, in
        the same Belady order; the pool's bytes stay reserved), else bytes (make_room)."""
        while not self.cache.fits(key):
            victims = [k for k in self.cache.transient() if k != key and self.cache.in_pool(k)]
            if not (self.cache.pooled(key) and victims):
                self.make_room(self.cache.sizes[key], key)
                return
            self.cache.release(max(victims, key=self.next_use))

    def next_use(self, key) -> int:
        if key in self.upcoming:
            return self.upcoming[key]
        if key[0] == "expert" and key[1] == self.layer:
            return 1 << 30  # computed already this step
        return 1 << 20  # a prefetch for a later layer
