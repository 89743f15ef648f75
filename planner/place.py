"""Tensor placement for one (batch size, n): which groups stay on device, host or disk.

The exact answer is a small MILP (`place_milp`): counts of attention layers, gates, experts
and KV layers per tier, minimising the busiest link's time per decode step under the three
budgets, with the KV cache and the device working set (activations and transfer buffers)
included. `place_greedy` solves the same problem by density (seconds saved per byte) and
is what the solver's search uses; `layer_ios` turns counts into per-layer tiers.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from planner.layer import LayerIO
from planner.workingset import BUFFER_KINDS, device_need, kv_staging_bytes, staging_bytes, working_set

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class Budgets:
    device: float
    host: float
    disk: float = math.inf

    @classmethod
    def of(cls, b) -> "Budgets":
        if isinstance(b, Budgets):
            return b
        if isinstance(b, Mapping):
            return cls(float(b["device"]), float(b["host"]), float(b.get("disk") or math.inf))
        raise TypeError(f"budgets must be Budgets or a mapping with device/host[/disk], not {type(b).__name__}")

    @classmethod
    def from_profile(cls, profile, *, device=None, host=None, disk=None) -> "Budgets":
        mem = getattr(profile, "memory", {}) or {}
        pick = lambda given, key: float(given) if given is not None else float(mem.get(key, math.inf))
        return cls(pick(device, "device"), pick(host, "host"), pick(disk, "disk"))


@dataclass
class Layout:
    attn: dict
    gate: dict
    experts: dict
    kv: dict
    embed: str
    head: str


def resident_bytes(cost, layout: Layout, kv_layer: float) -> dict:
    """Bytes each tier holds for the whole run under `layout`: its weights, and its layers' KV
    cache at `kv_layer` bytes a layer."""
    by_tier = {t: 0.0 for t in TIERS}
    for counts, size in ((layout.attn, cost.attention_bytes), (layout.gate, cost.gate_bytes),
                         (layout.experts, cost.expert_bytes), (layout.kv, kv_layer)):
        for t, c in counts.items():
            by_tier[t] += c * size
    by_tier[layout.embed] += cost.embed_bytes
    by_tier[layout.head] += cost.head_bytes
    return by_tier


def resident_kinds(layout: Layout, L: int, E: int) -> dict:
    """The kinds of group (workingset.BUFFER_KINDS) wholly on the device: they need no buffer."""
    return {"attention": layout.attn["device"] == L, "gate": layout.gate["device"] == L,
            "expert": layout.experts["device"] == L * E, "kv": layout.kv["device"] == L,
            "head": layout.head == "device"}


def _inputs(cost, bs, n, P, G, schedule, hot, marg, chunk, buffers, host_attention=False):
    """What both placers need: shape, layers, experts, working set, KV bytes per layer (whole
    context, and loaded per decode step on average), share of experts a layer uses."""
    s = cost.shape
    L, E = s.num_layers, s.num_experts
    ws = working_set(cost, bs=bs, n=n, prompt_len=P, gen_len=G, chunk=chunk, schedule=schedule, hot=hot,
                     buffers=buffers, host_attention=host_attention)
    kv_layer = n * bs * cost.kv_context(P + G) * cost.kv_bytes_per_token_layer
    # with attention on the host the KV stays there and only q and outputs cross (small)
    kv_load = 0 if host_attention else n * bs * cost.kv_context(P + G // 2) * cost.kv_bytes_per_token_layer
    used = 1.0 if schedule in ("simple", "multibatch") else sum(1 - (1 - min(1.0, m)) ** (n * bs) for m in marg) / E
    return s, L, E, ws, kv_layer, kv_load, used


def place_milp(cost, bs, n, P, G, budgets: Budgets, schedule, hot, marg, *, chunk: int,
               buffers: str = "overlap", host_attention: bool = False, host_ring: int = 0) -> Layout | None:
    """Small MILP: how many layers' attention / gates, how many experts, how many layers' KV
    on each tier; embeddings and head as single groups. Objective: the busiest link's time
    per decode step (host→device, disk→host, device→host), plus a small weight on the total
    so that idle links are not filled for nothing. With `host_attention` the KV cache is on
    the host (attention runs where it lives); `host_ring`: host bytes host compute holds
    (workingset.host_ring_bytes)."""
    s, L, E, ws, kv_layer, kv_load, used = _inputs(cost, bs, n, P, G, schedule, hot, marg, chunk, buffers,
                                                   host_attention)
    h2d, disk_bw, d2h = (cost.bandwidth(k) for k in ("host_to_device", "disk_to_host", "device_to_host"))
    staging = staging_bytes(cost)

    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    iv = lambda name, ub: prob.add_variable(name, 0, ub, cat="Integer")
    bv = lambda name: prob.add_variable(name, 0, 1, cat="Integer")
    A = {t: iv(f"attn_{t}", L) for t in TIERS}
    Gt = {t: iv(f"gate_{t}", L) for t in TIERS}
    X = {t: iv(f"exp_{t}", L * E) for t in TIERS}
    KV = {t: iv(f"kv_{t}", L) for t in ("device", "host")}
    EMB = {t: bv(f"emb_{t}") for t in ("host", "disk")}
    HD = {t: bv(f"head_{t}") for t in TIERS}
    full = {k: bv(f"full_{k}") for k in ("attn", "gate", "exp", "kv")}
    anydisk = bv("anydisk")
    T = prob.add_variable("T", 0)
    for var, total in ((A, L), (Gt, L), (X, L * E), (KV, L)):
        prob += pulp.lpSum(var.values()) == total
    prob += pulp.lpSum(EMB.values()) == 1
    prob += pulp.lpSum(HD.values()) == 1
    for k, var, total in (("attn", A, L), ("gate", Gt, L), ("exp", X, L * E), ("kv", KV, L)):
        prob += total * full[k] <= var["device"]
    prob += KV["device"] == L * full["kv"]  # the engine keeps a run's KV cache on one tier
    if host_attention:
        prob += KV["device"] == 0
    prob += A["disk"] + Gt["disk"] + X["disk"] + HD["disk"] <= (2 * L + L * E + 1) * anydisk

    head_b = cost.head_bytes
    resident = (cost.attention_bytes * A["device"] + cost.gate_bytes * Gt["device"]
                + cost.expert_bytes * X["device"] + kv_layer * KV["device"] + head_b * HD["device"])
    # a kind's buffer is dropped when the whole kind is resident (a quantized one still
    # needs room to dequantize into, `*_resident`)
    buf = {"attention": ws["attention_buffers"] * (1 - full["attn"]) + ws.get("attention_resident", 0) * full["attn"],
           "gate": ws["gate_buffers"] * (1 - full["gate"]),
           "expert": ws["expert_buffers"] * (1 - full["exp"]) + ws.get("expert_resident", 0) * full["exp"],
           "kv": ws["kv_buffers"] * (1 - full["kv"]), "head": head_b * (1 - HD["device"])}
    if buffers == "minimum":  # the pipeline holds one of them at a time (attention with its KV)
        held = prob.add_variable("held", 0)
        for term in (buf["attention"] + buf["kv"], buf["gate"], buf["expert"], buf["head"]):
            prob += held >= term
        dev = resident + ws["activations"] + held
    else:
        dev = resident + ws["activations"] + ws["decoded"] + pulp.lpSum(buf.values())
    host = (cost.attention_bytes * A["host"] + cost.gate_bytes * Gt["host"] + cost.expert_bytes * X["host"]
            + kv_layer * KV["host"] + head_b * HD["host"] + cost.embed_bytes * EMB["host"] + staging * anydisk
            + host_ring + kv_staging_bytes(cost) * (1 - full["kv"]))
    disk = (cost.attention_bytes * A["disk"] + cost.gate_bytes * Gt["disk"] + cost.expert_bytes * X["disk"]
            + head_b * HD["disk"] + cost.embed_bytes * EMB["disk"])
    prob += dev <= budgets.device
    prob += host <= budgets.host
    if math.isfinite(budgets.disk):
        prob += disk <= budgets.disk

    off = lambda var: var["host"] + var["disk"]
    t_h2d = (cost.attention_bytes * off(A) + cost.gate_bytes * off(Gt) + cost.expert_bytes * used * off(X)
             + head_b * off(HD) + kv_load * KV["host"]) / h2d
    t_disk = (cost.attention_bytes * A["disk"] + cost.gate_bytes * Gt["disk"] + cost.expert_bytes * X["disk"]
              + head_b * HD["disk"]) / disk_bw
    t_d2h = n * bs * cost.kv_bytes_per_token_layer * KV["host"] / d2h
    prob += T >= t_h2d
    prob += T >= t_disk
    prob += T >= t_d2h
    # Tie-breaks: the paper gives host memory to experts first (they are loaded on demand,
    # right after a gate, while attention and gates are prefetched a layer ahead and ride
    # the disk window well); the embedding is only gathered from, so it costs no transfer
    # time anywhere, but a host copy spares random disk reads.
    prob += (T + 1e-3 * (t_h2d + t_disk + t_d2h) + 1e-4 * cost.expert_bytes * X["disk"] / disk_bw
             + 1e-9 * EMB["disk"])
    prob.solve(_cbc())
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    val = lambda v: int(round(v.value() or 0))
    return Layout(
        attn={t: val(A[t]) for t in TIERS}, gate={t: val(Gt[t]) for t in TIERS},
        experts={t: val(X[t]) for t in TIERS}, kv={t: val(KV[t]) for t in KV},
        embed=max(EMB, key=lambda t: EMB[t].value() or 0), head=max(HD, key=lambda t: HD[t].value() or 0))


def place_greedy(cost, bs, n, P, G, budgets: Budgets, schedule, hot, marg, *, chunk: int,
                 buffers: str = "overlap", host_attention: bool = False, host_ring: int = 0) -> Layout | None:
    """The MILP's problem solved by density: fill the device with the groups that save the
    most transfer seconds per byte, keep the rest on host (KV first: it cannot go to disk),
    spill to disk. Used to search (bs, n) quickly; the final placement is the MILP's."""
    s, L, E, ws, kv_layer, kv_load, used = _inputs(cost, bs, n, P, G, schedule, hot, marg, chunk, buffers,
                                                   host_attention)
    everything = (cost.weights_bytes() - cost.embed_bytes + L * kv_layer
                  + device_need(ws, buffers, {k: True for k in BUFFER_KINDS}))
    if everything <= budgets.device and not host_attention:  # all resident: no transfer buffers needed at all
        embed = "host" if cost.embed_bytes + host_ring <= budgets.host else "disk"
        return Layout(attn={"device": L, "host": 0, "disk": 0}, gate={"device": L, "host": 0, "disk": 0},
                       experts={"device": L * E, "host": 0, "disk": 0}, kv={"device": L, "host": 0},
                       embed=embed, head="device")
    room = budgets.device - device_need(ws, buffers)
    if room < 0:
        return None
    # (seconds saved per byte on device, unit size, kind, units)
    items = [(1.0, cost.attention_bytes, "attn", L), (1.0, cost.gate_bytes, "gate", L),
             (used, cost.expert_bytes, "experts", L * E), (1.0, cost.head_bytes, "head", 1 if cost.head_bytes else 0),
             (kv_load / max(kv_layer, 1), kv_layer, "kv", L)]
    on_dev = {k: 0 for *_, k, _ in items}
    for _, size, kind, units in sorted(items, key=lambda x: -x[0]):
        take = units if size <= 0 or math.isinf(room) else min(units, int(room // size))
        if kind == "kv" and (take < units or host_attention):  # the engine keeps a run's KV on one tier
            take = 0
        on_dev[kind], room = take, room - take * size
    kv_host = (L - on_dev["kv"]) * kv_layer
    rest = {"attn": (L - on_dev["attn"], cost.attention_bytes), "gate": (L - on_dev["gate"], cost.gate_bytes),
            "experts": (L * E - on_dev["experts"], cost.expert_bytes),
            "head": ((1 if cost.head_bytes else 0) - on_dev["head"], cost.head_bytes)}
    off_bytes = sum(u * b for u, b in rest.values()) + cost.embed_bytes
    host_room = budgets.host - kv_host - host_ring - (kv_staging_bytes(cost) if on_dev["kv"] < L else 0)
    staging = staging_bytes(cost) if off_bytes > host_room else 0.0
    host_room -= staging
    if host_room < 0:
        return None
    on_host = {}
    for kind in ("experts", "attn", "gate", "head"):  # experts first, as in the paper (§6.1)
        units, size = rest[kind]
        take = units if size <= 0 or math.isinf(host_room) else min(units, int(host_room // size))
        on_host[kind], host_room = take, host_room - take * size
    embed = "host" if cost.embed_bytes <= host_room else "disk"
    disk = sum((rest[k][0] - on_host[k]) * rest[k][1] for k in rest) + (cost.embed_bytes if embed == "disk" else 0)
    if disk > budgets.disk:
        return None
    tiers = lambda k, total: {"device": on_dev[k], "host": on_host[k], "disk": total - on_dev[k] - on_host[k]}
    head = "device" if on_dev["head"] or not cost.head_bytes else ("host" if on_host["head"] else "disk")
    return Layout(attn=tiers("attn", L), gate=tiers("gate", L), experts=tiers("experts", L * E),
                   kv={"device": on_dev["kv"], "host": L - on_dev["kv"]}, embed=embed, head=head)


def _cbc():
    """CBC: a system install (COIN_CMD, PuLP 4's way) if present, else the copy PuLP ships."""
    solver = pulp.COIN_CMD(msg=False)
    if solver.available():
        return solver
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False)


def _fill(counts: dict, total: int) -> list[str]:
    """Tiers for `total` slots in order: device first, then host, then disk."""
    out = [t for t in TIERS if t in counts for _ in range(counts[t])]
    assert len(out) == total, (counts, total)
    return out


def layer_ios(layout: Layout, L: int, E: int, marg) -> list[LayerIO]:
    """Concrete tiers per layer. Attention, gates and KV by layer range (first layers on the
    device); experts spread evenly over layers, the most popular of each layer resident
    first — uniform layers pipeline better than a few slow ones, and resident hot experts
    need no prefetch."""
    attn, gate, kv = _fill(layout.attn, L), _fill(layout.gate, L), _fill(layout.kv, L)
    flat = _fill(layout.experts, L * E)
    order = sorted(range(E), key=lambda e: -marg[e])
    ios = []
    for layer in range(L):
        mine = flat[layer::L]  # round-robin: each layer gets an even share of each tier
        tiers = [""] * E
        for rank, e in enumerate(order):
            tiers[e] = mine[rank]
        ios.append(LayerIO(attn=attn[layer], next_attn=attn[(layer + 1) % L], gate=gate[layer],
                           experts=tuple(tiers), kv=kv[layer]))
    return ios
