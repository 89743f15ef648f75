"""Per-layer timing of one batch group under a placement: the terms of inequalities (4)–(7)
and an analytic layer time for each schedule. Shared by the solver (choosing n, predicting
throughput) and the plan report; the simulator replays the same schedules event by event.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.waves import landing_waves, resident_calls, wave_calls

SCHEDULES = ("simple", "multibatch", "hot-prefetch", "klotski")
INEQUALITIES = ("(4) n·t_A ≥ t_io(G)",
                "(5) n·(t_A+t_G) ≥ t_io(G)+K·t_io(E)",
                "(6) n·(t_A+t_G)+t_hotE ≥ t_io(G)+(K+1)·t_io(E)",
                "(7) n·(t_A+t_G)+t_hotE+Σ_Q t_E ≥ t_io(G)+(K+|Q|)·t_io(E)+t_io(A)")
FLEXGEN_INEQUALITIES = ("(1) n·t_A ≥ t_io(MoE)", "n·t_MoE ≥ t_io(A)")


def expert_slots(schedule: str, num_experts: int, hot: int) -> int:
    """Device buffers for off-device experts. FlexGen-style schedules hold the current and
    the next whole MoE layer; hot-prefetch keeps a layer's experts until the layer ends;
    Klotski frees each expert when done, so K hot + one computing + one arriving suffice."""
    if schedule in ("simple", "multibatch"):
        return 2 * num_experts
    if schedule == "hot-prefetch":
        return num_experts
    return min(num_experts, hot + 2)


@dataclass(frozen=True)
class LayerIO:
    """Tier of each group of one layer ('device', 'host' or 'disk')."""
    attn: str
    next_attn: str
    gate: str
    experts: tuple
    kv: str


@dataclass(frozen=True)
class Phase:
    """One forward pass of a batch group: decode (new=1) or prefill (new=ctx=prompt)."""
    bs: int
    n: int
    ctx: int
    new: int


@dataclass(frozen=True)
class Host:
    """Work the host CPU does next to host RAM (MoE-Gen's and Fiddler's moves). `attention`:
    the attention core of every layer whose KV is on the host runs there (projections stay
    on the device; q and the new keys/values go down, the output comes up; no KV prefix
    crosses the link). `experts`: an expert that is not on the device is computed where it
    lives — "auto" where CostModel.expert_on_host says that is sooner at the expected token
    count, "on" always, "off" never. The host is its own lane, concurrent with the device
    and the link: host attention of batch k overlaps the device projections of batch k+1
    and every transfer; host experts overlap the device experts of the same layer."""
    attention: bool = False
    experts: str = "off"

    def expert_here(self, cost, tokens: float, tier: str) -> bool:
        if tier == "device" or tokens <= 0 or self.experts == "off":
            return False
        return self.experts == "on" or cost.expert_on_host(tokens, tier)


NO_HOST = Host()


def host_attention_here(io, host) -> bool:
    return bool(host and host.attention and io.kv == "host")


def attention_phase(cost, io, ph, host=None) -> tuple[float, float]:
    """(time of one layer's attention over the n batches, host-lane share of it). With the
    core on the host, batch k's core overlaps batch k+1's projections on the device: the
    phase is one projection plus the slower of the two lanes over n batches."""
    if not host_attention_here(io, host):
        return ph.n * cost.t_attn(ph.bs, ph.ctx, ph.new), 0.0
    proj, core = cost.t_attn_proj(ph.bs, ph.new), cost.t_host_attend(ph.bs, ph.ctx, ph.new)
    return proj + ph.n * max(proj, core), ph.n * core


def _used(m: float, tokens: float) -> float:
    """Probability that an expert with per-token marginal m serves at least one of `tokens`."""
    return 1.0 - (1.0 - min(1.0, m)) ** tokens


def t_kv_batch(cost, io: LayerIO, ph: Phase, host=None) -> float:
    """Loading one batch's KV prefix for this layer (its cache on the host). It shares
    the host→device link with the weights, so it is transfer, not cover. With host attention
    only one batch's attention output comes up instead."""
    if io.kv != "host":
        return 0.0
    if host_attention_here(io, host):
        return cost.t_io(cost.attend_link_bytes(ph.bs, ph.ctx, ph.new)["host"]["host_to_device"])
    return cost.t_io(cost.kv_loaded(ph.bs, ph.ctx, ph.new))


def expert_phase(cost, io: LayerIO, tokens: float, marg, hot=(), host=None, landed=False) -> dict:
    """One layer's experts over a group's `tokens` tokens, priced as the engine computes them
    (planner/waves.py): each used expert's part of a wave (`t_wave_expert` at its expected
    pairs, and its dequantization), and each grouped call's fixed part once a call. The
    resident experts are one wave over their stack, run first (before the routing reaches the
    host: with the hot ones, cover for the cold transfers), each of its calls over the whole
    stack (`t_wave_slot` for each group a call passes empty); the moved hot experts, prefetched,
    one wave; the cold ones in the waves they land in (`waves.landing_waves`, a wave each when
    the link is the slower), or, `landed` (the whole layer moved ahead: simple, multibatch),
    one wave. Packed experts (HQQ, MXFP4, GGUF) moved to the device land in the pool and are
    priced alike; resident ones decode for their use and are a wave each.
    Experts computed where they live (`host`) keep their own price. Returns compute ("first":
    resident and hot, "cold"), their grouped calls, their transfers and the host lane's
    experts."""
    out = {"first": 0.0, "hot_io": 0.0, "cold": 0.0, "cold_io": 0.0, "cold_fetch": [], "host": 0.0, "calls": 0.0}
    deq = cost.t_dequant("expert")
    packed = cost.quant_bits is not None or bool(cost.shape.expert_format)
    used_by = {"resident": 0.0, "hot": 0.0, "cold": 0.0}
    pairs_by = dict(used_by)
    for e, m in enumerate(marg):
        used = _used(m, tokens)
        if used <= 0:
            continue
        if e not in hot and host and host.expert_here(cost, tokens * m / used, io.experts[e]):
            out["host"] += used * cost.t_host_expert(tokens * m / used)
            continue
        t_c = used * (cost.t_wave_expert(tokens * m / used) + deq)
        fetch = cost.t_fetch(cost.expert_bytes, io.experts[e])
        kind = "resident" if io.experts[e] == "device" else "hot" if e in hot or landed else "cold"
        used_by[kind] += used
        pairs_by[kind] += tokens * m
        if kind == "cold":
            out["cold"] += t_c
            out["cold_io"] += used * fetch
            if fetch > 0:
                out["cold_fetch"].append(fetch)
        else:
            out["first"] += t_c
            out["hot_io"] += fetch
    call = cost.t_wave_call()
    resident = sum(t == "device" for t in io.experts)
    empty = 0.0  # group slots the resident wave's calls pass without a pair (each call takes the whole stack)
    if packed:  # resident packed experts decode for their use: a wave each
        first = wave_calls(pairs_by["resident"], tokens, used_by["resident"])
    else:
        first = resident_calls(tokens, cost.shape.top_k, resident) if used_by["resident"] > 0 else 0.0
        empty = max(0.0, first * resident - used_by["resident"])
    # moved ones, packed or not, land in the pool and compute in its waves
    first += wave_calls(pairs_by["hot"], tokens, min(1.0, used_by["hot"]))
    fetch = sum(out["cold_fetch"]) / len(out["cold_fetch"]) if out["cold_fetch"] else 0.0
    expert = out["cold"] / used_by["cold"] if used_by["cold"] else 0.0
    cold = wave_calls(pairs_by["cold"], tokens, landing_waves(used_by["cold"], fetch, call, expert))
    out["first"] += first * call + empty * cost.t_wave_slot()
    out["cold"] += cold * call
    out["first_calls"], out["cold_calls"], out["calls"] = first, cold, first + cold
    return out


def ineq_terms(cost, io: LayerIO, ph: Phase, marg, hot, schedule="klotski", with_kv=False, host=None):
    """Left and right sides of inequalities (4)–(7) for one layer, generalised to per-expert
    tiers (a resident expert costs no transfer) and expected routing: expert e serves
    n·bs·m_e tokens and is needed with probability 1−(1−m_e)^(n·bs). Experts are priced in
    waves (`expert_phase`): t_hotE is the resident and hot experts' waves, Σ_Q t_E the cold
    ones'. `with_kv` adds the KV-cache loads that share the link (the paper's inequalities
    leave them out). `host` (a Host) moves attention cores and cold experts to the host lane:
    host attention is cover like device attention; a host expert neither moves nor takes
    device time."""
    tokens = ph.n * ph.bs * ph.new
    t_a, host_a = attention_phase(cost, io, ph, host)
    t_a += cost.t_dequant("attention")
    t_g = ph.n * cost.t_gate(ph.bs * ph.new)
    ex = expert_phase(cost, io, tokens, marg, hot, host)
    hot_c, hot_io, cold_c, cold_io, cold_fetch = ex["first"], ex["hot_io"], ex["cold"], ex["cold_io"], ex["cold_fetch"]
    first = sum(cold_fetch) / len(cold_fetch) if cold_fetch else 0.0
    io_g = cost.t_fetch(cost.gate_bytes, io.gate)
    io_a = cost.t_fetch(cost.attention_bytes, io.next_attn)
    if with_kv:
        # Batches 1..n-1 load their KV during this layer's attention, and batch 0 of the
        # next layer during the experts, on the same link as the weights.
        kv = t_kv_batch(cost, io, ph, host)
        io_g += (ph.n - 1) * kv
        io_a += kv
    # In expert-id order (hot-prefetch) a cold expert may be awaited before any hot one has
    # run, so the hot compute is not counted as cover for the cold transfers.
    cover = hot_c if schedule == "klotski" else 0.0
    lhs = [t_a, t_a + t_g, t_a + t_g + cover, t_a + t_g + cover + cold_c]
    rhs = [io_g, io_g + hot_io, io_g + hot_io + first, io_g + hot_io + cold_io + io_a]
    parts = {"attn": t_a, "gate": t_g, "hot": hot_c, "cold": cold_c, "compute": t_a + t_g + hot_c + cold_c,
             "host_attn": host_a, "host_experts": ex["host"], "expert_calls": ex["calls"]}
    return lhs, rhs, parts


def flexgen_terms(cost, io: LayerIO, ph: Phase, marg, with_kv=False, host=None):
    """Multi-batch without expert awareness (FlexGen zig-zag): while attention runs for all
    batches the whole MoE layer loads (the paper's Eq. 1); while the MoE layer runs (the
    gates batch by batch, the experts over every batch at once, in waves: all of them have
    landed) the next attention loads."""
    t_a = ph.n * cost.t_attn(ph.bs, ph.ctx, ph.new) + cost.t_dequant("attention")
    ex = expert_phase(cost, io, ph.n * ph.bs * ph.new, marg, landed=True)
    t_m = ph.n * cost.t_gate(ph.bs * ph.new) + ex["first"] + ex["cold"]
    io_moe = cost.t_fetch(cost.gate_bytes, io.gate) + sum(cost.t_fetch(cost.expert_bytes, t) for t in io.experts)
    if with_kv:  # every batch's KV loads during the attention phase, beside the MoE weights
        io_moe += ph.n * t_kv_batch(cost, io, ph, host)
    return t_a, t_m, io_moe


def moved_bytes(cost, io: LayerIO, ph: Phase, marg, schedule, hot=(), host=None) -> dict:
    """Bytes one layer moves per forward pass, by link."""
    tokens = ph.n * ph.bs * ph.new
    whole = schedule in ("simple", "multibatch")
    h2d = sum(b for b, t in ((cost.attention_bytes, io.next_attn), (cost.gate_bytes, io.gate)) if t != "device")
    acts = 0.0  # host experts: their tokens go down and their outputs come up
    for e, (m, t) in enumerate(zip(marg, io.experts)):
        if t == "device":
            continue
        used = 1.0 if whole else _used(m, tokens)
        if not whole and e not in hot and used > 0 and host and host.expert_here(cost, tokens * m / used, t):
            acts += used * tokens * m / used * cost.shape.hidden_size * cost.shape.dtype_bytes
        else:
            h2d += cost.expert_bytes * used
    h2d += acts
    disk = sum(b for b, t in ((cost.attention_bytes, io.attn), (cost.gate_bytes, io.gate)) if t == "disk")
    disk += cost.expert_bytes * sum(t == "disk" for t in io.experts)
    kv_load = kv_store = 0.0
    if host_attention_here(io, host):
        moved = cost.attend_link_bytes(ph.bs, ph.ctx, ph.new)["host"]
        return {"host_to_device": h2d + ph.n * moved["host_to_device"], "disk_to_host": disk,
                "device_to_host": acts + ph.n * moved["device_to_host"]}
    if io.kv == "host":
        kv_load = ph.n * cost.kv_loaded(ph.bs, ph.ctx, ph.new)
        kv_store = ph.n * cost.kv_bytes(ph.bs * ph.new, 1)
    return {"host_to_device": h2d + kv_load, "disk_to_host": disk, "device_to_host": kv_store + acts}


def layer_time(cost, io: LayerIO, ph: Phase, marg, hot, schedule, host=None) -> tuple[float, float]:
    """(layer time, bubble) for one layer and one batch group. The pipeline part is the
    computation plus the worst shortfall among the inequalities (a stall at one point delays
    every later point); and a layer is never faster than each link can move its bytes."""
    if schedule in ("simple", "multibatch"):
        t_a, t_m, io_moe = flexgen_terms(cost, io, ph, marg, with_kv=True, host=host)
        io_a = cost.t_fetch(cost.attention_bytes, io.next_attn)
        compute = t_a + t_m
        pipe = max(t_a, io_moe) + max(t_m, io_a)
        host = None  # whole layers move: no host experts
    else:
        lhs, rhs, parts = ineq_terms(cost, io, ph, marg, hot, schedule, with_kv=True, host=host)
        compute = parts["compute"]
        # host experts run beside the device's experts, after the gates
        pipe = max(compute + max(0.0, *(r - c for c, r in zip(lhs, rhs))),
                   parts["attn"] + parts["gate"] + parts["host_experts"])
    links = moved_bytes(cost, io, ph, marg, schedule, hot, host)
    copy = cost.t_copy(links["host_to_device"])  # CPU-only: copies share the compute's cores and RAM
    tokens = ph.n * ph.bs * ph.new
    calls = [1.0 if schedule in ("simple", "multibatch") else _used(m, tokens) for m in marg]
    moves = sum(u for u, t in zip(calls, io.experts) if t != "device") + (io.next_attn != "device") \
        + (io.gate != "device")
    kv_layers = ph.n if io.kv == "host" and not host_attention_here(io, host) else 0
    extra = cost.t_pipeline(batch_layers=ph.n, expert_calls=sum(calls), transfers=moves, kv_layers=kv_layers,
                            tokens=ph.n * ph.bs * (ph.new - 1))
    t = max(pipe + copy + extra, *(cost.t_io(b, link) for link, b in links.items()))
    return t, t - compute - copy - extra
