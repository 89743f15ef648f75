"""Discrete-event replay of one batch group through the pipeline, for each schedule variant.

Lanes: one compute lane running ops in program order, and FIFO transfer channels —
`weights`, `experts`, `kv_load` (host→device link), `kv_store` (device→host link) and
`disk` (the disk→host sliding window). Channels on the same physical link share its
bandwidth equally while both are busy. A compute op starts when the previous op is done
and every transfer it needs has arrived; time the compute lane spends waiting is bubble.

Schedules (Section 9.5 of the paper and DESIGN.md):
  simple        one batch; while a layer computes, the whole next layer loads (attention
                while MoE runs, gate + all experts while attention runs)
  multibatch    the same over n batches (FlexGen zig-zag); the MoE layer runs batch by batch
  hot-prefetch  n batches; gate + K hot experts load during attention; every other selected
                expert is queued the moment a batch's gate has run; experts run across all
                batches, in expert-id order
  klotski       hot-prefetch + hot (and resident) experts first, then cold ones in arrival
                order, each expert freed as soon as it is done

Host compute (layer.Host): a `host` lane, FIFO like a transfer channel but timed in
seconds, runs attention cores next to a host-resident KV cache (q and the new keys/values
go down on the device→host link, the output comes up; batch k's core overlaps batch k+1's
projections on the device) and cold experts computed where they live (issued once the
layer's gates have run; the layer's expert phase ends when they are back).

Steady-state boundary: each simulated step starts as if the previous one had prefetched
layer 0's attention weights and first KV batch, and the disk window's first layers.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from planner.layer import NO_HOST, SCHEDULES, Host, LayerIO, expert_slots, host_attention_here
from planner.routing import RoutingSample
from planner.shapes import as_shape
from planner.workingset import DISK_WINDOW_LAYERS

# Same lanes, in the same order, as the engine's traces (klotski/runtime/trace.py), so that real and
# simulated runs open side by side; "wait" holds the compute lane's bubbles.
# "host" (the host CPU's work, its "bytes" seconds) comes last: the engine's traces may not
# have it.
LANES = ("compute", "wait", "weights", "experts", "kv_load", "kv_store", "disk", "host")
LINK_OF = {"weights": "host_to_device", "experts": "host_to_device", "kv_load": "host_to_device",
           "kv_store": "device_to_host", "disk": "disk_to_host", "host": "host"}


@dataclass
class SimResult:
    schedule: str
    batch_size: int
    num_batches: int
    prompt_len: int
    gen_len: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    bubble_s: float
    bubble_share: float
    step_s: dict                       # {"prefill": s, "decode": [[ctx, s], ...]}
    busy_s: dict                       # per lane, over the whole group (decode steps scaled)
    peak_device_buffer_bytes: float    # transient device buffers (weights in flight/in use, KV)
    events: list | None = field(default=None, repr=False)
    prefill_tokens_per_s: float = 0.0  # prompt tokens per second of prefill
    decode_tokens_per_s: float = 0.0   # generated rows per second of decode

    def chrome_trace(self) -> dict:
        """{"traceEvents": [...]} with one thread per lane, for chrome://tracing / Perfetto."""
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": lane}}
                for i, lane in enumerate(LANES)]
        return {"traceEvents": meta + (self.events or []), "displayTimeUnit": "ms"}


# ---- the event engine -------------------------------------------------------------------------
class _Xfer:
    __slots__ = ("key", "lane", "left", "prereq", "slot", "layer", "start", "done")

    def __init__(self, key, lane, nbytes, prereq, slot, layer):
        self.key, self.lane, self.left, self.prereq, self.slot, self.layer = key, lane, nbytes, prereq, slot, layer
        self.start = self.done = None


class _Deferred:
    """Stands in the op list for ops that can only be ordered once earlier ops have run."""
    __slots__ = ("build", "layer")

    def __init__(self, build, layer):
        self.build, self.layer = build, layer


class _Pool:
    """Ops runnable in any order: the engine runs the first (in priority order) whose
    transfers have all arrived, waiting only when none has. Klotski's expert phase."""
    __slots__ = ("ops", "layer")

    def __init__(self, ops, layer):
        self.ops, self.layer = list(ops), layer


class _Op:
    __slots__ = ("name", "dur", "needs", "on_start", "on_end", "layer")

    def __init__(self, name, dur, needs=(), on_start=(), on_end=(), layer=0):
        self.name, self.dur, self.needs, self.on_start, self.on_end, self.layer = name, dur, needs, on_start, on_end, layer


class _Engine:
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
    def run(self, ops: list[_Op]) -> float:
        """Run ops in order; returns the compute lane's idle (bubble) time."""
        idle, i, op_end, ready = 0.0, 0, None, self.now
        ops = list(ops)
        while i < len(ops):
            if isinstance(ops[i], _Deferred):
                ops[i:i + 1] = ops[i].build()
                continue
            active = self._heads()
            if op_end is None and isinstance(ops[i], _Pool):
                pool = ops[i]
                if not pool.ops:
                    del ops[i]
                    continue
                ready_op = next((o for o in pool.ops if all(k in self.arrived for k in o.needs)), None)
                if ready_op is not None:
                    pool.ops.remove(ready_op)
                    ops.insert(i, ready_op)
            if op_end is None and not isinstance(ops[i], _Pool):
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
                waiting = ops[i].ops if isinstance(ops[i], _Pool) else [ops[i]]
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


# ---- building one step's ops ------------------------------------------------------------------
class _Step:
    """Ops and transfers of one forward pass of the batch group (prefill: new = ctx = prompt
    length; decode: new = 1)."""

    def __init__(self, cost, ios, head_tier, routing, schedule, bs, n, ctx, new, step, K, eng: _Engine,
                 host=NO_HOST):
        self.c, self.ios, self.head_tier, self.r, self.sch = cost, ios, head_tier, routing, schedule
        self.host = host
        self.bs, self.n, self.ctx, self.new, self.step, self.K, self.e = bs, n, ctx, new, step, K, eng
        self.L, self.E = cost.shape.num_layers, cost.shape.num_experts
        self.kv_batch = cost.kv_loaded(bs, ctx, new)
        self.kv_new = cost.kv_bytes(bs * new, 1)
        self.held = {}  # layer -> expert keys holding a device buffer

    # transfers
    def _fetch(self, key, lane, nbytes, tier, layer, slot=False):
        """A group to the device; disk-resident groups wait for their disk read first."""
        if tier == "device":
            self.e.arrived.add(key)
            return
        self.e.issue(key, lane, nbytes, prereq=("disk", key) if tier == "disk" else None, slot=slot, layer=layer)

    def _fetch_expert(self, j, x, lane):
        tier = self.ios[j].experts[x]
        self._fetch(("E", j, x), lane, self.c.expert_bytes, tier, j, slot=tier != "device")
        if tier != "device":
            self.held.setdefault(j, set()).add(x)

    def _free_expert(self, j, x):
        if x in self.held.get(j, ()):
            self.held[j].discard(x)
            self.e.release(("E", j, x), slot=True)

    def _disk_reads(self):
        """The sliding window reads every disk-resident group each step, in layer order; the
        first window is already in host memory (read during the previous step)."""
        c = self.c
        for j, io in enumerate(self.ios):
            groups = [(("A", j), c.attention_bytes, io.attn), (("G", j), c.gate_bytes, io.gate)]
            groups += [(("E", j, x), c.expert_bytes, t) for x, t in enumerate(io.experts)]
            for key, nbytes, tier in groups:
                if tier != "disk":
                    continue
                if j < DISK_WINDOW_LAYERS:
                    self.e.arrived.add(("disk", key))
                else:
                    self.e.issue(("disk", key), "disk", nbytes, layer=j)
        if self.head_tier == "disk":
            self.e.arrived.add(("disk", ("H",)))

    def build(self) -> list:
        c, e = self.c, self.e
        self._disk_reads()
        e.arrived.add(("A", 0))       # steady state: prefetched during the previous step
        e.arrived.add(("KV", 0, 0))
        for j, io in enumerate(self.ios):  # resident groups are always there
            e.arrived.update(("E", j, x) for x, t in enumerate(io.experts) if t == "device")
            if io.attn == "device":
                e.arrived.add(("A", j))
            if io.gate == "device":
                e.arrived.add(("G", j))
        whole = self.sch in ("simple", "multibatch")
        ops = []
        for j, io in enumerate(self.ios):
            counts = [self.r.counts(self.step, j, k, self.bs * self.new) for k in range(self.n)]
            ops += self._attention(j, io, whole)
            ops += self._moe_flexgen(j, io, counts) if whole else self._moe_klotski(j, io, counts)
        ops += [_Op(f"head b{k}", c.t_head(self.bs), [("H",)], layer=self.L - 1) for k in range(self.n)]
        return ops

    # attention: batch by batch, KV of the next batch loading meanwhile
    def _attention(self, j, io: LayerIO, whole):
        if host_attention_here(io, self.host):
            return self._host_attention(j, io, whole)
        c, e, n = self.c, self.e, self.n
        kv = io.kv == "host"
        ops = []
        for k in range(n):
            needs = [("A", j)] + ([("KV", j, k)] if kv and self.kv_batch else [])
            start, end = [], []
            if k == 0:
                start.append(lambda j=j, io=io: self._prefetch_moe(j, io, whole))
                if j == self.L - 1:
                    start.append(lambda: self._fetch(("H",), "weights", c.head_bytes, self.head_tier, self.L - 1))
            if k + 1 < n and kv and self.kv_batch:
                start.append(lambda j=j, k=k: e.issue(("KV", j, k + 1), "kv_load", self.kv_batch))
            if kv:
                end.append(lambda j=j, k=k: e.issue(("KVs", j, k), "kv_store", self.kv_new))
                end.append(lambda j=j, k=k: e.release(("KV", j, k)))
            if k == n - 1:
                end.append(lambda j=j: e.release(("A", j)))
            dur = c.t_attn(self.bs, self.ctx, self.new) + (c.t_dequant("attention") if k == 0 else 0.0)
            ops.append(_Op(f"attn L{j} b{k}", dur, needs, start, end, layer=j))
        return ops

    def _host_attention(self, j, io: LayerIO, whole):
        """Projections on the device batch by batch; each batch's core on the host lane once
        its q (and new keys/values) are down; its output comes up before its gate."""
        c, e, n = self.c, self.e, self.n
        moved = c.attend_link_bytes(self.bs, self.ctx, self.new)["host"]
        core = c.t_host("attend", (self.bs, c.kv_context(self.ctx), self.new))
        ops = []
        for k in range(n):
            start, end = [], []
            if k == 0:
                start.append(lambda j=j, io=io: self._prefetch_moe(j, io, whole))
                if j == self.L - 1:
                    start.append(lambda: self._fetch(("H",), "weights", c.head_bytes, self.head_tier, self.L - 1))

            def core_of(j=j, k=k):
                e.issue(("Q", j, k), "kv_store", moved["device_to_host"])
                e.issue(("HA", j, k), "host", core, prereq=("Q", j, k))
                e.issue(("HO", j, k), "kv_load", moved["host_to_device"], prereq=("HA", j, k))
            end.append(core_of)
            if k == n - 1:
                end.append(lambda j=j: e.release(("A", j)))
            dur = c.t_attn_proj(self.bs, self.new) + (c.t_dequant("attention") if k == 0 else 0.0)
            ops.append(_Op(f"proj L{j} b{k}", dur, [("A", j)], start, end, layer=j))
        return ops

    def _gate_needs(self, j, k) -> list:
        """A batch's gate waits for its hidden state: with host attention, the core's output."""
        return [("HO", j, k)] if host_attention_here(self.ios[j], self.host) else []

    def _prefetch_moe(self, j, io: LayerIO, whole):
        """At the start of layer j's attention: the whole MoE layer (simple, multibatch), or
        the gate and the K hot experts predicted from routing statistics."""
        self._fetch(("G", j), "weights", self.c.gate_bytes, io.gate, j)
        for x in (range(self.E) if whole else self._hot(j)):
            self._fetch_expert(j, x, "weights")

    def _hot(self, j) -> list[int]:
        marg = self.r.marginals(j)
        return sorted(range(self.E), key=lambda x: -marg[x])[:self.K]

    def _next_layer(self, j):
        """Once layer j's experts start: the next attention weights and its first KV batch."""
        if j + 1 < self.L:
            nxt = self.ios[j + 1]
            self._fetch(("A", j + 1), "weights", self.c.attention_bytes, nxt.attn, j + 1)
            if nxt.kv == "host" and self.kv_batch and not host_attention_here(nxt, self.host):
                self.e.issue(("KV", j + 1, 0), "kv_load", self.kv_batch)

    # MoE, FlexGen style
    def _moe_flexgen(self, j, io: LayerIO, counts):
        """Batch by batch: gate, then that batch's experts in id order. The whole layer must
        have arrived first (the weight stream is synchronised per layer)."""
        c = self.c
        layer_keys = [("G", j)] + [("E", j, x) for x in range(self.E)]
        deq = c.t_dequant("expert")
        ops = []
        for k in range(self.n):
            start = [lambda j=j: self._next_layer(j)] if k == 0 else []
            ops.append(_Op(f"gate L{j} b{k}", c.t_gate(self.bs * self.new), layer_keys + self._gate_needs(j, k), start,
                           layer=j))
            for x in range(self.E):
                if counts[k][x]:
                    ops.append(_Op(f"expert L{j} e{x} b{k}", c.t_expert(counts[k][x]) + (deq if k == 0 else 0.0),
                                   layer=j))
        ops[-1].on_end = tuple(ops[-1].on_end) + (lambda j=j: self._free_layer(j),)
        return ops

    def _free_layer(self, j):
        for x in list(self.held.get(j, ())):
            self._free_expert(j, x)
        self.e.release(("G", j))

    # MoE, expert-aware
    def _moe_klotski(self, j, io: LayerIO, counts):
        c, e = self.c, self.e
        hot = self._hot(j)
        total = [sum(cnt[x] for cnt in counts) for x in range(self.E)]
        # computed where they live, chosen (as the solver does) at the expected token count
        tokens, marg = self.n * self.bs * self.new, self.r.marginals(j)
        on_host = {x for x in range(self.E) if x not in hot and marg[x] > 0
                   and self.host.expert_here(c, tokens * marg[x] / (1 - (1 - min(1.0, marg[x])) ** tokens),
                                             io.experts[x])}
        queued = set(hot) | {x for x in range(self.E) if io.experts[x] == "device"} | on_host
        cold_order = []

        def after_gate(k):
            # Every selected expert neither resident nor in flight is queued at once.
            for x in range(self.E):
                if counts[k][x] and x not in queued:
                    queued.add(x)
                    cold_order.append(x)
                    self._fetch_expert(j, x, "experts")

        def unused_hot():
            for x in hot:
                if not total[x]:
                    self._free_expert(j, x)
            e.release(("G", j))

        def host_experts():
            for x in sorted(on_host):
                if total[x]:
                    e.issue(("HE", j, x), "host", c.t_host_expert(total[x]))

        ops = []
        for k in range(self.n):
            end = [lambda k=k: after_gate(k)]
            if k == self.n - 1:  # the expert phase begins: next attention may load now
                end += [host_experts, unused_hot, lambda: self._next_layer(j)]
            ops.append(_Op(f"gate L{j} b{k}", c.t_gate(self.bs * self.new), [("G", j)] + self._gate_needs(j, k),
                           on_end=end, layer=j))
        back = _Op(f"host experts L{j}", 0.0, [("HE", j, x) for x in sorted(on_host)], layer=j)

        def expert_ops():
            deq = c.t_dequant("expert")
            back.needs = [("HE", j, x) for x in sorted(on_host) if total[x]]
            if self.sch == "klotski":
                # Hot and resident experts first, most tokens first; then cold ones as they
                # arrive (queue order on a FIFO channel); each freed as soon as it is done.
                # Whatever has arrived runs rather than wait for the next in line.
                early = sorted((x for x in range(self.E) if total[x] and x not in cold_order and x not in on_host),
                               key=lambda x: -total[x])
                return [_Pool([_Op(f"expert L{j} e{x}", c.t_expert(total[x]) + deq, [("E", j, x)],
                                   on_end=[lambda x=x: self._free_expert(j, x)], layer=j)
                               for x in early + cold_order], j), back]
            out = [_Op(f"expert L{j} e{x}", c.t_expert(total[x]) + deq, [("E", j, x)], layer=j)
                   for x in range(self.E) if total[x] and x not in on_host]
            if out:
                out[-1].on_end = (lambda: self._free_layer(j),)
            return out + [back]
        return ops + [_Deferred(expert_ops, j)]


# ---- driver ----------------------------------------------------------------------------------
def layer_ios_from(placement, shape) -> tuple[list[LayerIO], str]:
    """Per-layer tiers from a Plan (anything with `.tier(layer, kind, expert)` and a
    `placement` dict), a callable tier(layer, kind, expert), or None (all on host)."""
    L, E = shape.num_layers, shape.num_experts
    if placement is None:
        tier = lambda layer, kind, expert=None: "host"
        head = "host"
    elif callable(placement):
        tier, head = placement, placement(0, "lm_head")
    else:
        tier = placement.tier
        head = placement.placement.get("lm_head", "device")
    ios = [LayerIO(attn=tier(j, "attention"), next_attn=tier((j + 1) % L, "attention"), gate=tier(j, "gate"),
                   experts=tuple(tier(j, "experts", x) for x in range(E)), kv=tier(j, "kv")) for j in range(L)]
    return ios, head


def simulate(cost, shape=None, *, bs: int, n: int, schedule: str = "klotski", prompt_len: int, gen_len: int,
             routing: RoutingSample | None = None, placement=None, K: int | None = None, trace: bool = False,
             decode_samples: int = 3, host=None) -> SimResult:
    """Replay one batch group (n batches of bs sequences, prompt_len + gen_len tokens).

    Simulates the prefill pass and `decode_samples` decode steps spread over the context
    range, and integrates decode time over the gen_len−1 steps (Simpson's rule for 3).
    `placement` is a Plan or a tier(layer, kind, expert) callable; default: every weight and
    the KV cache on host. `routing` defaults to uniform synthetic routing. `host` (a
    layer.Host) moves work to the host lane; default: the plan's own choice (Plan's
    host_attention / host_experts), else none."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    shape = as_shape(shape if shape is not None else cost.shape)
    if schedule == "simple":
        n = 1
    L, E = shape.num_layers, shape.num_experts
    K = shape.top_k if K is None else K
    routing = routing or RoutingSample.synthetic(L, E, shape.top_k)
    ios, head_tier = layer_ios_from(placement, shape)
    if host is None:
        host = Host(attention=bool(getattr(placement, "host_attention", False)),
                    experts=getattr(placement, "host_experts", "off") if schedule in ("klotski", "hot-prefetch")
                    else "off")
    bw = {link: cost.bandwidth(link) for link in ("disk_to_host", "host_to_device", "device_to_host")}
    bw["host"] = 1.0  # the host lane's "bytes" are seconds
    latency = float(getattr(cost.profile, "link_latency_s", 0.0))
    slots = expert_slots(schedule, E, K if schedule in ("klotski", "hot-prefetch") else 0)
    P, G = prompt_len, gen_len
    events = [] if trace else None
    busy = {lane: 0.0 for lane in LANES}
    peak = 0.0

    def run(ctx, new, step, weight, t0):
        nonlocal peak
        eng = _Engine(bw, latency, slots, trace, t0)
        ops = _Step(cost, ios, head_tier, routing, schedule, bs, n, ctx, new, step, K, eng, host).build()
        idle = eng.run(ops)
        for lane, v in eng.busy.items():
            busy[lane] += v * weight
        peak = max(peak, eng.peak_buffers)
        if trace:
            events.extend(eng.events)
        return eng.now - t0, idle

    prefill, prefill_idle = run(P, P, 0, 1.0, 0.0)
    steps = max(0, G - 1)
    decode_points = []
    if steps:
        k = min(decode_samples, steps)
        ctxs = sorted({P + 1 + round(i * (steps - 1) / max(1, k - 1)) for i in range(k)})
        weights = _quadrature(len(ctxs), steps)
        t0 = prefill
        decode = decode_idle = 0.0
        for i, (c_, w) in enumerate(zip(ctxs, weights)):
            t, idle = run(c_, 1, i + 1, w, t0)
            decode_points.append([c_, t])
            decode, decode_idle, t0 = decode + w * t, decode_idle + w * idle, t0 + t
    else:
        decode = decode_idle = 0.0
    total = prefill + decode
    tokens = n * bs * G
    return SimResult(schedule=schedule, batch_size=bs, num_batches=n, prompt_len=P, gen_len=G,
                     prefill_tokens_per_s=n * bs * P / prefill if prefill else 0.0,
                     decode_tokens_per_s=n * bs * steps / decode if decode else 0.0,
                     prefill_s=prefill, decode_s=decode, tokens_per_s=tokens / total if total else 0.0,
                     bubble_s=prefill_idle + decode_idle,
                     bubble_share=(prefill_idle + decode_idle) / total if total else 0.0,
                     step_s={"prefill": prefill, "decode": decode_points}, busy_s=busy,
                     peak_device_buffer_bytes=peak, events=events)


def _quadrature(points: int, steps: int) -> list[float]:
    """Weights turning `points` evenly spaced step times into the sum over `steps` steps."""
    if points == 1:
        return [float(steps)]
    if points == 3:
        return [steps / 6, 4 * steps / 6, steps / 6]
    return [steps / points] * points
