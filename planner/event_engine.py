"""The discrete-event engine the simulator replays a batch group on.

Lanes: one compute lane running ops in program order, and FIFO transfer channels —
`weights`, `experts`, `kv_load`, `activations` (host compute's results; host→device link),
`kv_store` (device→host link) and `disk` (the disk→host sliding window). Channels on the same physical link share its
bandwidth equally while both are busy. A compute op starts when the previous op is done
and every transfer it needs has arrived; time the compute lane spends waiting is bubble.
The `host` lane (the host CPU's work) is FIFO like a transfer channel but timed in seconds.
"""
from __future__ import annotations

import math
from collections import deque

from planner.workingset import DISK_WINDOW_LAYERS

# Same lanes, in the same order, as the engine's traces (klotski/execute/trace.py), so that real and
# simulated runs open side by side; "wait" holds the compute lane's bubbles.
# "host" (the host CPU's work, its "bytes" seconds) comes last: the engine's traces may not
# have it.
LANES = ("compute", "wait", "weights", "experts", "kv_load", "kv_store", "activations", "disk", "host")
LINK_OF = {"weights": "host_to_device", "experts": "host_to_device", "kv_load": "host_to_device",
           "kv_store": "device_to_host", "activations": "host_to_device", "disk": "disk_to_host", "host": "host"}


class _Xfer:
    __slots__ = ("key", "lane", "left", "prereq", "slot", "layer", "start", "done")

    def __init__(self, key, lane, nbytes, prereq, slot, layer):
        self.key, self.lane, self.left, self.prereq, self.slot, self.layer = key, lane, nbytes, prereq, slot, layer
        self.start = self.done = None


class Deferred:
    """Stands in the op list for ops that can only be ordered once earlier ops have run."""
    __slots__ = ("build", "layer")

    def __init__(self, build, layer):
        self.build, self.layer = build, layer


class OpPool:
    """Ops runnable in any order: the engine runs the first (in priority order) whose
    transfers have all arrived, waiting only when none has. Klotski's expert phase."""
    __slots__ = ("ops", "layer")

    def __init__(self, ops, layer):
        self.ops, self.layer = list(ops), layer


class Op:
    """A compute op of `dur` seconds: it starts once the transfers keyed in `needs` have
    arrived; `on_start` and `on_end` callbacks issue and free transfers."""
    __slots__ = ("name", "dur", "needs", "on_start", "on_end", "layer")

    def __init__(self, name, dur, needs=(), on_start=(), on_end=(), layer=0):
        self.name, self.dur, self.needs, self.layer = name, dur, needs, layer
        self.on_start, self.on_end = on_start, on_end


class EventEngine:
    """One forward pass's clock: transfers queued per channel, sharing their links, and the
    compute lane running its ops (`run`)."""

    def __init__(self, bandwidth: dict, latency: float, slots: int, trace: bool, t0: float = 0.0):
        self.bw, self.latency = bandwidth, latency
        self.now = t0
        self.queues = {lane: deque() for lane in LINK_OF}
        self.arrived: set = set()
        self.free_slots = slots
        self.layer = 0           # layer the compute lane is in (for the disk window)
        self.busy = {lane: 0.0 for lane in LANES}
        self.buffers = 0.0       # device bytes held by transient buffers
        self.peak_buffers = 0.0
        self.sizes: dict = {}
        self.events = [] if trace else None

    # transfers
    def issue(self, key, lane, nbytes, *, prereq=None, slot=False, layer=0):
        if key in self.arrived or nbytes <= 0:
            self.arrived.add(key)
            return
        bw = self.bw[LINK_OF[lane]]
        # A fixed per-transfer latency is modelled as that many extra bytes on the link.
        extra = self.latency * bw if math.isfinite(bw) and lane != "host" else 0.0
        self.queues[lane].append(_Xfer(key, lane, nbytes + extra, prereq, slot, layer))
        # an attention output coming up is counted among the activations, not as a buffer
        self.sizes[key] = nbytes if lane not in ("kv_store", "disk", "host") and key[0] != "HO" else 0.0

    def release(self, key, slot=False):
        self.buffers -= self.sizes.pop(key, 0.0)
        if slot:
            self.free_slots += 1

    def _startable(self, x: _Xfer) -> bool:
        if x.prereq is not None and x.prereq not in self.arrived:
            return False
        if x.lane == "disk" and x.layer > self.layer + DISK_WINDOW_LAYERS:
            return False
        return not x.slot or self.free_slots > 0

    def _heads(self):
        active = []
        for q in self.queues.values():
            if not q:
                continue
            x = q[0]
            if x.start is None and self._startable(x):
                x.start = self.now
                if x.slot:
                    self.free_slots -= 1
                self.buffers += self.sizes.get(x.key, 0.0)
                self.peak_buffers = max(self.peak_buffers, self.buffers)
            if x.start is not None:
                active.append(x)
        return active

    def _rates(self, active):
        per_link = {}
        for x in active:
            per_link[LINK_OF[x.lane]] = per_link.get(LINK_OF[x.lane], 0) + 1
        return {id(x): self.bw[LINK_OF[x.lane]] / per_link[LINK_OF[x.lane]] for x in active}

    def _advance(self, until, active, rates):
        dt = until - self.now
        for x in active:
            rate = rates[id(x)]
            x.left = 0.0 if math.isinf(rate) else x.left - rate * dt
            self.busy[x.lane] += dt
        self.now = until
        for x in active:
            if x.left <= self.bw[LINK_OF[x.lane]] * 1e-12:  # less than a picosecond's worth left
                self.queues[x.lane].popleft()
                self.arrived.add(x.key)
                if self.events is not None:
                    self._event(_name(x.key), x.lane, x.start, self.now, {"bytes": self.sizes.get(x.key, 0.0)})

    def _event(self, name, lane, start, end, args=None):
        self.events.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                            "pid": 1, "tid": LANES.index(lane), "args": {"lane": lane, **(args or {})}})

    # the compute lane
    def run(self, ops: list[Op]) -> float:
        """Run ops in order; returns the compute lane's idle (bubble) time."""
        idle, i, op_end, ready = 0.0, 0, None, self.now
        ops = list(ops)
        while i < len(ops):
            if isinstance(ops[i], Deferred):
                ops[i:i + 1] = ops[i].build()
                continue
            active = self._heads()
            if op_end is None and isinstance(ops[i], OpPool):
                pool = ops[i]
                if not pool.ops:
                    del ops[i]
                    continue
                ready_op = next((o for o in pool.ops if all(k in self.arrived for k in o.needs)), None)
                if ready_op is not None:
                    pool.ops.remove(ready_op)
                    ops.insert(i, ready_op)
            if op_end is None and not isinstance(ops[i], OpPool):
                op = ops[i]
                self.layer = op.layer
                if all(k in self.arrived for k in op.needs):
                    for cb in op.on_start:
                        cb()
                    active = self._heads()
                    idle += self.now - ready
                    if self.events is not None and self.now > ready:
                        self._event(f"wait before {op.name}", "wait", ready, self.now)
                    op_end = self.now + op.dur
                    self.busy["compute"] += op.dur
                    if self.events is not None:
                        self._event(op.name, "compute", self.now, op_end)
            rates = self._rates(active)
            t_next = op_end if op_end is not None else math.inf
            for x in active:
                t_next = min(t_next, self.now + x.left / rates[id(x)])
            if t_next == math.inf:
                stuck = [q[0].key for q in self.queues.values() if q]
                waiting = ops[i].ops if isinstance(ops[i], OpPool) else [ops[i]]
                raise RuntimeError(f"simulation stalled: ops {[o.name for o in waiting]} wait for "
                                   f"{[k for o in waiting for k in o.needs if k not in self.arrived]}, "
                                   f"queued heads {stuck}")
            self._advance(t_next, active, rates)
            if op_end is not None and op_end <= self.now + 1e-15:
                for cb in ops[i].on_end:
                    cb()
                i, op_end, ready = i + 1, None, self.now
        return idle


def _name(key) -> str:
    """Readable event names for transfer keys."""
    kind, *rest = key
    if kind == "disk":
        return "read " + _name(rest[0])
    labels = {"A": "attention L{}", "G": "gate L{}", "E": "expert L{} e{}", "H": "lm_head",
              "KV": "kv L{} b{}", "KVs": "kv store L{} b{}"}
    return labels[kind].format(*rest)
