"""The ops and transfers of one forward pass of a batch group, for each schedule variant.

Schedules (Section 9.5 of the paper and DESIGN.md):
  simple        one batch; while a layer computes, the whole next layer loads (attention
                while MoE runs, gate + all experts while attention runs)
  multibatch    the same over n batches (FlexGen zig-zag); the gates run batch by batch, then
                every batch's experts at once
  hot-prefetch  n batches; gate + K hot experts load during attention; every other selected
                expert is queued the moment a batch's gate has run; experts run across all
                batches, in expert-id order
  every schedule's experts are priced in waves (layer.expert_phase: many experts a grouped call)
  klotski       hot-prefetch + hot (and resident) experts first, then cold ones in arrival
                order, each expert freed as soon as it is done

Host compute (layer.Host): the `host` lane runs attention cores next to a host-resident KV
cache (q and the new keys/values go down on the device→host link, the output comes up;
batch k's core overlaps batch k+1's projections on the device) and cold experts computed
where they live (issued once the layer's gates have run; the layer's expert phase ends when
they are back).

Steady-state boundary: each simulated step starts as if the previous one had prefetched
layer 0's attention weights and first KV batch, and the disk window's first layers.
"""
from __future__ import annotations

from planner.event_engine import Deferred, EventEngine, Op, OpPool
from planner.layer import NO_HOST, LayerIO, expert_phase, host_attention_here
from planner.workingset import DISK_WINDOW_LAYERS


class StepOps:
    """Ops and transfers of one forward pass of the batch group (prefill: new = ctx = prompt
    length; decode: new = 1)."""

    def __init__(self, cost, ios, head_tier, routing, schedule, bs, n, ctx, new, step, K, eng: EventEngine,
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
        ops += [Op(f"head b{k}", c.t_head(self.bs), [("H",)], layer=self.L - 1) for k in range(self.n)]
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
            ops.append(Op(f"attn L{j} b{k}", dur, needs, start, end, layer=j))
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
                e.issue(("HO", j, k), "activations", moved["host_to_device"], prereq=("HA", j, k))
            end.append(core_of)
            if k == n - 1:
                end.append(lambda j=j: e.release(("A", j)))
            dur = c.t_attn_proj(self.bs, self.new) + (c.t_dequant("attention") if k == 0 else 0.0)
            ops.append(Op(f"proj L{j} b{k}", dur, [("A", j)], start, end, layer=j))
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
        """Batch by batch the gates, then the experts over every batch at once, in id order (the
        engine routes the group together and computes its experts in waves). The whole layer
        must have arrived first (the weight stream is synchronised per layer)."""
        c = self.c
        layer_keys = [("G", j)] + [("E", j, x) for x in range(self.E)]
        ops = []
        for k in range(self.n):
            start = [lambda j=j: self._next_layer(j)] if k == 0 else []
            ops.append(Op(f"gate L{j} b{k}", c.t_gate(self.bs * self.new), layer_keys + self._gate_needs(j, k), start,
                           layer=j))
        # then every batch's experts at once, in waves (all of them have landed)
        total = [sum(cnt[x] for cnt in counts) for x in range(self.E)]
        price = self._wave_prices(j, io, total, (), landed=True)
        ops += [Op(f"expert L{j} e{x}", price(x), layer=j) for x in range(self.E) if total[x]]
        ops[-1].on_end = tuple(ops[-1].on_end) + (lambda j=j: self._free_layer(j),)
        return ops

    def _wave_prices(self, j, io: LayerIO, total, hot, on_host=(), landed=False):
        """Each expert op's seconds as the engine's waves price it (layer.expert_phase): its part
        of a wave at its tokens, plus its share of the grouped calls' fixed parts, which the
        analytic model counts for the layer at its routing marginals (the resident and hot
        experts' calls shared among theirs, the cold ones' among theirs)."""
        c, tokens = self.c, self.n * self.bs * self.new
        ex = expert_phase(c, io, tokens, self.r.marginals(j), hot, self.host, landed)
        first = [x for x in range(self.E) if total[x] and x not in on_host
                 and (landed or x in hot or io.experts[x] == "device")]
        cold = [x for x in range(self.E) if total[x] and x not in on_host and x not in first]
        share = {x: ex["first_calls"] / len(first) for x in first} | {x: ex["cold_calls"] / len(cold) for x in cold}
        deq, call = c.t_dequant("expert"), c.t_wave_call()
        return lambda x: c.t_wave_expert(total[x]) + deq + share.get(x, 0.0) * call

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
            ops.append(Op(f"gate L{j} b{k}", c.t_gate(self.bs * self.new), [("G", j)] + self._gate_needs(j, k),
                           on_end=end, layer=j))
        back = Op(f"host experts L{j}", 0.0, [("HE", j, x) for x in sorted(on_host)], layer=j)

        def expert_ops():
            price = self._wave_prices(j, io, total, set(hot), on_host)
            back.needs = [("HE", j, x) for x in sorted(on_host) if total[x]]
            if self.sch == "klotski":
                # Hot and resident experts first, most tokens first; then cold ones as they
                # arrive (queue order on a FIFO channel); each freed as soon as it is done.
                # Whatever has arrived runs rather than wait for the next in line.
                early = sorted((x for x in range(self.E) if total[x] and x not in cold_order and x not in on_host),
                               key=lambda x: -total[x])
                return [OpPool([Op(f"expert L{j} e{x}", price(x), [("E", j, x)],
                                   on_end=[lambda x=x: self._free_expert(j, x)], layer=j)
                               for x in early + cold_order], j), back]
            out = [Op(f"expert L{j} e{x}", price(x), [("E", j, x)], layer=j)
                   for x in range(self.E) if total[x] and x not in on_host]
            if out:
                out[-1].on_end = (lambda: self._free_layer(j),)
            return out + [back]
        return ops + [Deferred(expert_ops, j)]
