"""The plan a solve returns, its JSON form and its human-readable report."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from planner.decode_ops import decode_layer_ops
from planner.layer import INEQUALITIES, NO_HOST, LayerIO, Phase, expert_slots, ineq_terms
from planner.place import TIERS, Layout, resident_bytes, resident_kinds
from planner.workingset import device_need, host_ring_bytes, kv_staging_bytes, staging_bytes, working_set
from planner.units import format_bytes


@dataclass(frozen=True)
class Plan:
    batch_size: int
    num_batches: int
    hot_experts: int
    schedule: str
    placement: dict
    predicted_tokens_per_s: float
    prefill_s: float
    decode_s: float
    binding: str
    peak_bytes: dict
    per_layer: dict
    prompt_len: int = 0
    gen_len: int = 0
    placement_summary: dict = field(default_factory=dict)
    quant_bits: int | None = None
    longest_prompt: int = 0      # what memory was planned for (prompt_len: what time was)
    prefill_chunk: int = 0       # prompt tokens per prefill pass
    buffers: str = "overlap"     # transfer buffers: "overlap", or "minimum" when only that fits
    host_attention: bool = False  # attention cores on the host CPU, next to the KV cache
    host_experts: str = "off"     # off | auto | on: off-device experts computed where they live
    moves: list = field(default_factory=list)      # which host/batching moves, and why, in words
    prefill_tokens_per_s: float = 0.0             # prompt tokens per second of prefill
    decode_tokens_per_s: float = 0.0              # generated rows per second of decode
    batching: str | None = None                   # continuous | static, when the job's lengths were given
    slot_utilisation: dict = field(default_factory=dict)  # {"continuous": u, "static": u}
    job_prefill_s: float = 0.0   # the whole job's prefill and decode seconds, when its lengths were given
    job_decode_s: float = 0.0
    job_prefill_passes: float = 0.0  # the job's prefill passes (continuous batching, its replay)
    precision: dict = field(default_factory=dict)  # the precisions weighed and the one taken (planner.precision)
    newcomer_room: float | None = None  # device bytes newcomers' caches may take (continuous; None: unbounded)
    # where the answer lengths time was planned at came from (planner/answer_lengths.py: source,
    # runs, answer_tokens against max_tokens); empty: no job's lengths were given
    answer_lengths: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def group_tiers(self, num_layers: int, num_experts: int) -> tuple[dict, str]:
        """The placement in the engine's terms (placement/placement.py): {('embed',), ('head',),
        ('attn', j), ('gate', j), ('expert', j, e): tier} and one KV tier (host if any
        layer's KV is)."""
        tiers = {("embed",): self.placement["embed"], ("head",): self.placement["lm_head"]}
        for j in range(num_layers):
            tiers["attn", j] = self.tier(j, "attention")
            tiers["gate", j] = self.tier(j, "gate")
            for e in range(num_experts):
                tiers["expert", j, e] = self.tier(j, "experts", e)
        kv = "host" if any(self.tier(j, "kv") == "host" for j in range(num_layers)) else "device"
        return tiers, kv

    def tier(self, layer: int, kind: str, expert: int | None = None) -> str:
        """Tier of one group: kind is 'attention', 'gate', 'experts' (with expert) or 'kv'."""
        for key, tier in self.placement.items():
            if _key_matches(key, layer, kind, expert):
                return tier
        raise KeyError(f"no placement for layer {layer} {kind} {expert}")


def _ranges(items):
    """[(start, stop_inclusive, value)] for runs of equal consecutive values."""
    out = []
    for i, v in enumerate(items):
        if out and out[-1][2] == v and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i, v)
        else:
            out.append((i, i, v))
    return out


def _span(a, b) -> str:
    return f"{a}" if a == b else f"{a}-{b}"


def _placement_dict(ios: list[LayerIO], layout: Layout) -> dict:
    """Group → tier with layer and expert ranges compressed: 'layers.0-11.attention',
    'layers.0-31.experts.0-1', 'layers.4-31.kv', 'embed', 'lm_head' (with the final norm)."""
    out = {"embed": layout.embed, "lm_head": layout.head}
    for kind, attr in (("attention", "attn"), ("gate", "gate"), ("kv", "kv")):
        for a, b, tier in _ranges([getattr(io, attr) for io in ios]):
            out[f"layers.{_span(a, b)}.{kind}"] = tier
    for a, b, tiers in _ranges([io.experts for io in ios]):
        runs = _ranges(list(tiers))
        if len(runs) == 1:
            out[f"layers.{_span(a, b)}.experts"] = runs[0][2]
        else:
            for ea, eb, tier in runs:
                out[f"layers.{_span(a, b)}.experts.{_span(ea, eb)}"] = tier
    return out


def _key_matches(key: str, layer: int, kind: str, expert: int | None) -> bool:
    parts = key.split(".")
    if parts[0] != "layers":
        return kind == key
    lo, _, hi = parts[1].partition("-")
    if not int(lo) <= layer <= int(hi or lo) or parts[2] != kind:
        return False
    if len(parts) == 3 or expert is None:
        return True
    elo, _, ehi = parts[3].partition("-")
    return int(elo) <= expert <= int(ehi or elo)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def host_moves(cost, bs, n, P, G, host, batching=None, utilisation=None) -> list[str]:
    """Why the plan computes (or not) on the host, and its batching's slot utilisation."""
    out, L, ctx = [], cost.shape.num_layers, P + G // 2
    core = cost.t_host("attend", (1, ctx, 1))
    if core != float("inf"):
        kv = cost.attend_link_bytes(bs, ctx)["device"]["host_to_device"] * n * L
        dev = n * L * (cost.t_io(kv / (n * L)) + cost.t_op("attend", (bs, ctx, 1)))
        here = n * L * cost.t_host_attend(bs, ctx)
        where = "on host" if host.attention else "on device"
        out.append(f"attention {where}: KV prefix {format_bytes(kv)}/decode step over the link ({_ms(dev)}) "
                   f"vs host {_ms(here)}")
        if host.experts != "off":
            lo, hi = 0, 1 << 16  # largest token count an off-device expert is still computed on host at
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if cost.expert_on_host(mid) else (lo, mid)
            per = n * bs * cost.shape.top_k / cost.shape.num_experts
            out.append(f"experts on host when ≤ {lo} tokens" + ("" if host.experts == "auto" else " (forced on)")
                       + f" (decode averages {per:.3g} tokens per expert: "
                       + ("host" if host.expert_here(cost, per, "host") else "moved to the device") + ")")
    if utilisation:
        other = "static" if batching == "continuous" else "continuous"
        out.append(f"{batching} batching: expected slot utilisation {utilisation[batching]:.2f} "
                   f"({other} {utilisation[other]:.2f})")
    return out


def make_plan(cost, shape, budgets, pred, bs, n, layout, ios, binding, schedule, K, hot, marg, P, G, *,
              longest: int, chunk: int, buffers: str, host=NO_HOST, batching=None, utilisation=None,
              next_gate: bool = False) -> Plan:
    L, E = shape.num_layers, shape.num_experts
    ws = working_set(cost, bs=bs, n=n, prompt_len=longest, gen_len=G, chunk=chunk, schedule=schedule, hot=K,
                     buffers=buffers, host_attention=host.attention)
    kv_layer = n * bs * cost.kv_context(longest + G) * cost.kv_bytes_per_token_layer
    by_tier = resident_bytes(cost, layout, kv_layer)
    resident = dict(by_tier)
    by_tier["device"] += device_need(ws, buffers, resident_kinds(layout, L, E))
    if layout.attn["disk"] or layout.gate["disk"] or layout.experts["disk"] or layout.head == "disk":
        by_tier["host"] += staging_bytes(cost)
    by_tier["host"] += host_ring_bytes(cost, host)
    if layout.kv["host"]:
        by_tier["host"] += kv_staging_bytes(cost)
    summary = {}
    # a hybrid's linear layers keep a recurrent state where attention layers keep keys and values
    hybrid = bool(shape.linear_layers)
    attn_label = "attention and linear layers" if hybrid else "attention layers"
    cache_label = "cache layers (KV or recurrent state)" if hybrid else "KV layers"
    for t in TIERS:
        groups = []
        for label, counts in ((attn_label, layout.attn), ("gates", layout.gate),
                              ("experts", layout.experts), (cache_label, layout.kv)):
            if counts.get(t):
                groups.append(f"{counts[t]} {label}")
        groups += [g for g, where in (("embed", layout.embed), ("lm_head", layout.head)) if where == t]
        summary[t] = {"resident_bytes": resident[t], "groups": ", ".join(groups) or "-"}

    ctx = P + G // 2
    io = max(ios, key=lambda x: sum(cost.t_fetch(cost.expert_bytes, t) for t in x.experts))
    dec = Phase(bs, n, ctx, 1)
    per_layer = {
        "t_attn_ms": {"decode": cost.t_attn(bs, ctx) * 1e3, "prefill": cost.t_attn(bs, P, P) * 1e3},
        "t_gate_ms": {"decode": cost.t_gate(bs) * 1e3, "prefill": cost.t_gate(bs * P) * 1e3},
        "t_expert_ms": {"decode": cost.t_expert(n * bs * shape.top_k / E) * 1e3,
                        "prefill": cost.t_expert(n * bs * P * shape.top_k / E) * 1e3},
        "t_io_ms": {"attention": cost.t_io(cost.attention_bytes) * 1e3, "gate": cost.t_io(cost.gate_bytes) * 1e3,
                    "expert": cost.t_io(cost.expert_bytes) * 1e3,
                    "expert_from_disk": cost.t_fetch(cost.expert_bytes, "disk") * 1e3,
                    "kv_batch_decode": cost.t_io(cost.kv_bytes(bs * cost.kv_context(ctx), 1)) * 1e3},
        "layer_ms": {"decode": (pred["decode_step_s"] - n * cost.t_head(bs)) / L * 1e3,
                     "prefill": (pred["prefill_s"] - n * cost.t_head(bs)) / L * 1e3},
        "bubble_ms": {"decode": pred["decode_bubble_s"] / L * 1e3, "prefill": pred["prefill_bubble_s"] / L * 1e3},
        "expected_distinct_experts": sum(1 - (1 - min(1.0, m)) ** (n * bs) for m in marg),
    }
    # ops the pipeline launches around the timed ones in a decode layer (the profile's counts):
    # its batch-layers, expert calls, the layer's own and its share of the step's
    launches = cost.launches(batch_layers=n, expert_calls=per_layer["expected_distinct_experts"], layers=1,
                             steps=1 / L)
    per_layer["launches"] = {"decode": launches, "ms": launches * cost.profile.launch_s * 1e3}
    # the host's waits for the routing ids (execute/staging.HostReads) per MoE layer, and for the
    # next gate's picks with next-gate prediction where an expert is off the device (with every
    # expert resident nothing is predicted): the only host syncs a decode layer step makes
    # (tests/test_expert_waves.py counts them)
    speculates = next_gate and any(layout.experts.get(t) for t in TIERS if t != "device")
    per_layer["host_syncs"] = {"decode": (1 + speculates) if E else 0}
    # every kernel a decode layer issues (the pipeline's launches and the model math's ops,
    # None where the profile counted no math) and every transfer it submits to a channel:
    # the terms are planner/decode_ops.py's (tests/test_plan_ops.py counts both in a real run)
    # the expert pool the engine opens for this plan (planner.workingset.expert_pool_slots's cap)
    slots = 1 if buffers == "minimum" else expert_slots(schedule, E, K)
    ops = decode_layer_ops(cost, ios, bs, n, marg, hot, schedule, host_attention=host.attention, head=layout.head,
                           slots=slots)
    per_layer["kernels"] = {"decode": ops["kernels"]}
    per_layer["submissions"] = {"decode": ops["submissions"]}
    if schedule in ("klotski", "hot-prefetch"):
        lhs, rhs, _ = ineq_terms(cost, io, dec, marg, hot, schedule, host=host)
        per_layer["inequalities_ms"] = [{"name": nm, "lhs": l * 1e3, "rhs": r * 1e3}
                                        for nm, l, r in zip(INEQUALITIES, lhs, rhs)]
    return Plan(batch_size=bs, num_batches=n, hot_experts=K, schedule=schedule,
                placement=_placement_dict(ios, layout),
                predicted_tokens_per_s=pred["tokens_per_s"], prefill_s=pred["prefill_s"], decode_s=pred["decode_s"],
                binding=binding, peak_bytes=by_tier, per_layer=per_layer, prompt_len=P, gen_len=G,
                placement_summary=summary, quant_bits=cost.quant_bits, longest_prompt=longest,
                prefill_chunk=chunk, buffers=buffers, host_attention=host.attention, host_experts=host.experts,
                moves=host_moves(cost, bs, n, P, G, host, batching, utilisation),
                prefill_tokens_per_s=pred.get("prefill_tokens_per_s", 0.0),
                decode_tokens_per_s=pred.get("decode_tokens_per_s", 0.0), batching=batching,
                newcomer_room=pred.get("newcomer_room"),
                slot_utilisation=dict(utilisation or {}), job_prefill_s=pred.get("job_prefill_s", 0.0),
                job_prefill_passes=pred.get("job_prefill_passes", 0.0),
                job_decode_s=pred.get("job_decode_s", 0.0))


def format_plan(plan: Plan) -> str:
    """A readable report of a plan, for `klotski plan`."""
    pl = plan.per_layer
    lines = [
        f"schedule {plan.schedule}: batch size {plan.batch_size} x {plan.num_batches} batches "
        f"(= {plan.batch_size * plan.num_batches} sequences per group), {plan.hot_experts} hot experts prefetched",
        f"prompt {plan.prompt_len} + generate {plan.gen_len} tokens"
        + (f" (memory for prompts up to {plan.longest_prompt})" if plan.longest_prompt > plan.prompt_len else "")
        + (f", prefill in chunks of {plan.prefill_chunk} tokens" if plan.prefill_chunk < plan.longest_prompt else "")
        + (f", weights HQQ {plan.quant_bits}-bit" if plan.quant_bits else "")
        + ("; transfer buffers at their minimum" if plan.buffers == "minimum" else ""),
        f"predicted {plan.predicted_tokens_per_s:.3g} tokens/s   prefill {plan.prefill_s:.3g} s + "
        f"decode {plan.decode_s:.3g} s per batch group"
        + (f" ({plan.prefill_tokens_per_s:.3g} prompt tokens/s, {plan.decode_tokens_per_s:.3g} decode rows/s)"
           if plan.decode_tokens_per_s else ""),
        f"binding: {plan.binding}",
        *(f"  {m}" for m in plan.moves),
        *([f"continuous batching: {format_bytes(plan.newcomer_room)} of the device left for the caches of"
           " prompts prefilled ahead of free rows"]
          if plan.newcomer_room is not None and plan.batching == "continuous" else []),
        "",
        f"{'tier':<8}{'peak':>12}{'resident':>12}  groups",
    ]
    for t in TIERS:
        s = plan.placement_summary.get(t, {})
        lines.append(f"{t:<8}{format_bytes(plan.peak_bytes[t]):>12}{format_bytes(s.get('resident_bytes', 0)):>12}  "
                     f"{s.get('groups', '-')}")
    lines += ["", "placement:"]
    lines += [f"  {k:<28} {v}" for k, v in plan.placement.items()]
    lines += ["", f"per layer (ms){'':<14}{'decode':>10}{'prefill':>10}"]
    for key, label in (("t_attn_ms", "attention / batch"), ("t_gate_ms", "gate / batch"),
                       ("t_expert_ms", "one expert (avg)"), ("layer_ms", "layer, predicted"),
                       ("bubble_ms", "bubble")):
        lines.append(f"  {label:<26}{pl[key]['decode']:>10.3f}{pl[key]['prefill']:>10.3f}")
    io = pl["t_io_ms"]
    lines.append(f"  transfers: attention {io['attention']:.3f}, gate {io['gate']:.3f}, expert {io['expert']:.3f} "
                 f"(from disk {io['expert_from_disk']:.3f}), KV of one batch {io['kv_batch_decode']:.3f}")
    lines.append(f"  expected distinct experts per layer: {pl['expected_distinct_experts']:.2f}")
    if pl.get("launches", {}).get("decode"):
        lines.append(f"  ops the pipeline launches around the timed ones, per decode layer: {pl['launches']['decode']:.0f} "
                     f"(at least {pl['launches']['ms']:.3f} ms of host time at the measured cost per launch)")
    if "kernels" in pl:
        k = pl["kernels"]["decode"]
        lines.append("  kernels per decode layer: " + ("not counted (a profile measured here counts them)" if k is None
                     else f"{k:.0f} (the pipeline's launches and the model math's ops: attention per batch, "
                          "routing, expert waves)"))
    if "host_syncs" in pl:
        lines.append(f"  host syncs per decode layer: {pl['host_syncs']['decode']} (waits for the routing ids' "
                     "copy to the host; the resident experts compute meanwhile; one more with --prefetch next-gate)")
    if "submissions" in pl:
        lines.append(f"  channel submissions per decode layer: {pl['submissions']['decode']:.3g} (attention and gate "
                     "off the device, runs of moved experts, disk reads, host KV loads and stores)")
    for q in pl.get("inequalities_ms", []):
        mark = "ok " if q["lhs"] >= q["rhs"] * (1 - 1e-9) else "NO "
        lines.append(f"  {mark}{q['name']:<62} {q['lhs']:9.2f} vs {q['rhs']:9.2f}")
    return "\n".join(lines)
