"""What the pipeline itself costs per call on this machine, beyond the ops the profile times.

The profile (planner/profile.py) times the model's ops one by one. A real step also pays
for the pipeline around them: routing bookkeeping, token gathers and scatters, masks, the
residency cache, trace spans, the host sync of the expert ids. On a big model that is
noise; on a small one it is most of the step (the demo was predicted ~7x too fast without
it). Here the engine's own Pipeline runs decode steps of the built-in tiny model, every
group resident, with the model's math replaced by stubs that return at once, so what is
timed is the pipeline alone; four runs separate its cost per batch and layer (attention +
gate), per expert call, per transfer (experts fetched from the host: submitting, waiting,
making room, the channel thread's share of the cores) and per step; a fifth, with the KV
cache on the host, its cost per batch-layer (a prefix load and a store submitted, waited for
and freed: 0.4-2 ms a batch-layer on 2 cores, where a transfer is ~0.1-0.3); a sixth, WIDE
tokens a row, its cost per token-layer beyond a decode step's one token a row (masks, rotary
tables, gathers and scatters of a prefill's tokens; the profile's ops time none of it):

    step(n batches of r rows and t tokens a row, E experts chosen, X transfers, KV on host or not)
        = step + L·n·batch_layer + L·E·expert_call + X·transfer + [KV on host] L·n·kv_layer
          + L·n·r·(t − 1)·token

The result is kept in the user cache per machine, pipeline source and channel mode (a run
with `--emulate-link` copies on the channels' threads, one without copies inline on a CPU;
tiny-mixtral's threaded transfer and KV terms ran 1.8x and 2.4x the inline ones), and added to the
profile's `overhead_s` (planner/costmodel.py: `t_pipeline`). Beside each term's seconds, the
ops it issues on the compute thread (`launches.<kind>`, counted once: the same on every
machine), which the cost model prices at the profile's per-launch cost as a floor: on a GPU
each is a kernel launch the device waits for when the host is slower than it. The ops are
counted layer by layer (the median over the layers after the first, which also embeds), so
what a layer issues whatever its batches and experts (sort, slots, combine, the resident
wave's gathers and scatters) is a term of its own, `launches.layer`, and `launches.step` is
only what a step adds around its layers (embedding, LM head): the planner's predicted
kernels per decode layer (planner/decode_ops.py) add them to the model math's own ops.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import statistics
import time

import torch

from klotski.measure.opcounter import OpCounter
from klotski.util.writes import replace_atomically

KINDS = ("batch_layer", "expert_call", "transfer", "kv_layer", "token", "step")
LAUNCH_KINDS = KINDS + ("layer",)  # counted ops only: a layer's own, whatever its batches and experts
LAUNCHES = "launches."  # prefix of the ops counted per kind, beside its seconds
WIDE = 8  # tokens a row in the run that prices a prefill's tokens beyond a decode step's one
FAST_LINK = 1e6  # GB/s: channels on their threads, no transfer held back


class _Stubs:
    """A family whose math is free: attention and experts return their input, the router
    spreads tokens over the first `chosen` experts."""
    HOST_ATTENTION = False

    def __init__(self, chosen: int, top_k: int):
        self.chosen, self.top_k = chosen, top_k

    def attention_block(self, h, *args, **kwargs):
        return h

    def route(self, x, gate, spec):
        idx = torch.arange(x.shape[0] * self.top_k, device=x.device).view(-1, self.top_k) % self.chosen
        return torch.full(idx.shape, 1.0 / self.top_k, device=x.device), idx

    def shared_ffn(self, x, gate, spec):
        return None

    def expert_ffn(self, x, w):
        return x

    def bind_expert_ffn(self, spec):
        return self.expert_ffn

    def bind_grouped_expert_ffn(self, spec):
        return lambda x, w, groups: x


def _rows(experts: int, top_k: int) -> int:
    """Rows of a measuring batch: enough that the stub router reaches every expert, so each
    run calls (and, experts on the host, moves) the experts its accounting divides by."""
    return max(2, -(-experts // top_k))


def _source_key(device: str) -> str:
    from klotski.execute import channels, experts, hostwork, pipeline, residency, staging
    from klotski.measure import overhead
    from klotski.schedule import batching
    from placement import cache, pool
    from planner.profile import machine_fingerprint
    h = hashlib.sha256(json.dumps(machine_fingerprint(device), sort_keys=True).encode())
    # what the pipeline's ops and transfers run through: a change to any of them measures again
    for module in (pipeline, experts, hostwork, batching, channels, staging, residency, cache, pool, overhead):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]


def pipeline_overhead(device: str, open_engine, steps: int = 16, rounds: int = 11,
                      emulated_link: bool = False, announce=None) -> dict[str, float]:
    """Seconds the pipeline adds on `device` per each of KINDS (the module docstring's terms),
    measured once per machine, pipeline source and channel mode (user cache): with
    `emulated_link` the channels run on their threads, as a run with `--emulate-link` does
    (through a link too fast to hold anything back); without, a CPU copies inline.
    `open_engine` is the composition root's (klotski.assemble), handed in so this module does
    not import it. `announce(text)` is told when a measure starts and how long it took."""
    from klotski.util import cachedir
    mode = "-threads" if emulated_link else ""
    path = cachedir.profiles() / f"pipeline-overhead-{_source_key(device)}{mode}.json"
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()
                if k in KINDS or k.startswith(LAUNCHES)}
    except (OSError, ValueError):
        pass
    if announce:  # a new machine or pipeline: the user waits, so say for what
        announce(f"measuring what the pipeline itself costs on this machine ({device}; once, cached in {path.parent})")
    started = time.perf_counter()
    found = _measure(device, steps, rounds, open_engine, FAST_LINK if emulated_link else None)
    if announce:
        announce(f"pipeline cost measured in {time.perf_counter() - started:.1f} s")
    try:
        replace_atomically(path, json.dumps(found).encode())
    except OSError:
        pass  # measured again next time
    return found


def _measure(device: str, steps: int, rounds: int, open_engine, link_gbps: float | None) -> dict[str, float]:
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    from klotski.execute.contract import StepInput
    from klotski.builtin.tiny import ensure_builtin
    from klotski.models.spec import ModelSpec
    from klotski.prefetch.correlate import new_table
    from klotski.prefetch.predictors import CorrelationPredictor, FrequencyPredictor
    from placement.placement import Placement

    # threads as they are: the measure's engines must not change them (the profile's cache key has them)
    cfg = RunConfig(model="tiny-mixtral", batch_size=2, num_batches=3, progress=False, dtype="float32",
                    device=device, batching="static", emulate_link_gbps=link_gbps, threads=torch.get_num_threads())
    request = [Request(id="x", line=1, prompt="x", messages=None, max_new_tokens=1)]
    spec = ModelSpec.from_dir(ensure_builtin(cfg.model))
    keys = spec.group_keys()  # bs, n and placement given: nothing is planned (no profile asked for)
    bs = _rows(spec.shape.num_experts, spec.shape.top_k)

    def per_step(engine, n: int, chosen: int, new: int = 1, counter: OpCounter | None = None, predictor=None):
        """Median seconds of a step; with `counter`, the ops of one step (after a warm-up) and
        the median ops of its layers after the first."""
        marks = []
        on_layer = None if counter is None else lambda layer, hs: marks.append(counter.kernels)
        space = engine.caches.space()
        kvs = [space.allocate(bs, (steps + 2) * new)[0] for _ in range(n)]
        ids = torch.zeros(bs, new, dtype=torch.long)
        times = []
        with engine.pipeline.instrumented(hooks=_Stubs(chosen, engine.spec.shape.top_k), on_layer=on_layer,
                                          predictor=predictor) as pipeline:
            for t in range(2 if counter else steps + 1):
                at = torch.arange(t * new, (t + 1) * new).expand(bs, new)
                inputs = [StepInput(ids, torch.ones_like(ids, dtype=torch.bool), at) for _ in kvs]
                start = time.perf_counter()
                with counter if counter and t else contextlib.nullcontext():
                    pipeline.forward(kvs, inputs)
                times.append(time.perf_counter() - start)
        space.close()
        if counter:
            layers = [b - a for a, b in zip(marks[-L:], marks[-L + 1:])] or [float(counter.kernels) / L]
            return float(counter.kernels), statistics.median(layers)
        # the first is a warm-up; the median, not the fastest: a step's waits on the channel
        # threads and the allocator are part of what every step pays (the fastest of 12 ran
        # ~30% under the typical step on tiny-mixtral)
        return statistics.median(times[1:])

    # The engines open at once and the six runs interleaved, each term the median over
    # rounds: a term is a difference of two runs, and apart (one after the other) the
    # machine's drift between them moved `transfer` 3x from one measure to the next.
    engines = {}
    layouts = {"device": {}, "host": {"expert": "host"}, "kv": {"kv": "host"}}
    try:
        for name, where in layouts.items():
            # a predictor of its own: it learns nothing worth keeping about a stub model
            quiet = CorrelationPredictor(new_table(spec.shape))
            engines[name] = open_engine(cfg, request, placement=Placement.by_kind(keys, **where), predictor=quiet)[0]
        spec = engines["device"].spec
        L, E, k = spec.shape.num_layers, spec.shape.num_experts, spec.shape.top_k
        terms = []
        def run() -> dict:
            one, three, few = (per_step(engines["device"], 1, E), per_step(engines["device"], 3, E),
                               per_step(engines["device"], 1, k))
            moved, kv = per_step(engines["host"], 1, E), per_step(engines["kv"], 1, E)
            wide = per_step(engines["device"], 1, E, WIDE)
            batch_layer = max(0.0, (three - one) / (2 * L))
            expert_call = max(0.0, (one - few) / (L * (E - k))) if E > k else 0.0
            return {"batch_layer": batch_layer, "expert_call": expert_call,
                    "transfer": max(0.0, (moved - one) / (L * E)),
                    "kv_layer": max(0.0, (kv - one) / L),
                    "token": max(0.0, (wide - one) / (L * bs * (WIDE - 1))),
                    "step": max(0.0, one - L * batch_layer - L * E * expert_call)}
        terms = [run() for _ in range(rounds)]
        # The ops themselves: the same on every run, once is enough. Predicted from running
        # counts, whose ops are the same whatever the stub's tokens choose: an exact-path
        # table's look-ups grow with the distinct expert sets, which in these runs grow with
        # the experts chosen (4 ops an "expert call" on tiny-mixtral, where the waves issue none).
        counting = {name: FrequencyPredictor(L, E) for name in engines}
        runs = {name: per_step(engines[engine], n, chosen, new, counter=OpCounter(), predictor=counting[engine])
                for name, engine, n, chosen, new in (("one", "device", 1, E, 1), ("three", "device", 3, E, 1),
                                                     ("few", "device", 1, k, 1), ("moved", "host", 1, E, 1),
                                                     ("kv", "kv", 1, E, 1), ("wide", "device", 1, E, WIDE))}
        counted = _launches({name: layer for name, (_, layer) in runs.items()}, runs["one"][0], L, E, k, bs)
    finally:
        for engine in engines.values():
            engine.close()
    return ({kind: statistics.median(t[kind] for t in terms) for kind in KINDS}
            | {LAUNCHES + kind: counted[kind] for kind in LAUNCH_KINDS})


def _launches(layer: dict, step_ops: float, L: int, E: int, k: int, bs: int) -> dict:
    """Each kind's ops, from the ops of one layer of each counted run (`layer`) and the whole
    of run "one"'s step (`step_ops`): differences of layers, as the seconds are of steps."""
    batch_layer = max(0.0, (layer["three"] - layer["one"]) / 2)
    expert_call = max(0.0, (layer["one"] - layer["few"]) / (E - k)) if E > k else 0.0
    own = max(0.0, layer["one"] - batch_layer - E * expert_call)
    return {"batch_layer": batch_layer, "expert_call": expert_call, "layer": own,
            "transfer": max(0.0, (layer["moved"] - layer["one"]) / E), "kv_layer": max(0.0, layer["kv"] - layer["one"]),
            "token": max(0.0, (layer["wide"] - layer["one"]) / (bs * (WIDE - 1))),
            "step": max(0.0, step_ops - L * layer["one"])}
