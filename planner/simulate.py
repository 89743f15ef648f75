"""Discrete-event replay of one batch group through the pipeline, for each schedule variant:
the ops of each forward pass (planner.step_ops) run on the event engine's lanes
(planner.event_engine), a prefill pass and a few decode steps integrated over the
generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.event_engine import LANES, EventEngine
from planner.layer import SCHEDULES, Host, LayerIO, expert_slots
from planner.routing import RoutingSample
from planner.shapes import as_shape
from planner.step_ops import StepOps


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
        eng = EventEngine(bw, latency, slots, trace, t0)
        ops = StepOps(cost, ios, head_tier, routing, schedule, bs, n, ctx, new, step, K, eng, host).build()
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
