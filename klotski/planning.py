"""Glue between the engine and the planner: which profile (measured with the engine's own
ops, EngineOps, on the device `--device` names), which budgets, and turning the planner's
Plan into the engine's batch size, n, prefill chunk and Placement. The planner decides; this
module only asks it, and words its refusals as the flags to change."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from klotski.compress.hqq import spec_for
from klotski.errors import UserError
from klotski.measure.overhead import LAUNCHES
from klotski.measure.profile_ops import EngineOps
from placement.placement import Placement
from planner import answer_lengths
from planner.costmodel import LINKS, CostModel
from planner.precision import (Precision, QualityBound, Weighed, choose, default_options, link_bytes_per_step,
                               quality_row, to_dict)
from planner.profile import Profile, builtin_profiles, load_profile, measure
from planner.shapes import KNOWN_MODELS, as_shape
from planner.solve import BATCH_SIZES, Budgets, Infeasible, Plan, solve
from planner.units import format_size_flag

_FLAGS = {"device": "--device-memory", "host": "--host-memory"}


def model_shape(model: str):
    """Shape of `--model` without loading weights: an alias, or a directory's config.json."""
    if model.lower() in KNOWN_MODELS:
        return as_shape(model.lower())
    from klotski.io import registry
    from klotski.models.spec import ModelSpec
    return as_shape(ModelSpec.from_dir(registry.resolve(model, weights=False)))  # a hub model: its config only


def _gguf_checkpoint(model: str):
    """`--model` opened as a checkpoint when it is a GGUF file or a folder holding one (the
    header holds every shape and type; no weight is read), else None."""
    if model.lower() in KNOWN_MODELS:
        return None
    from klotski.io import gguf, registry
    path = registry.resolve(model, weights=False)
    if not gguf.is_gguf(path):
        return None
    from klotski.io.checkpoint import Checkpoint
    return Checkpoint.open(str(path), direct_io=False)


def compute_device(name: str) -> str:
    """`--device`: `auto` is cuda where torch sees a GPU, else cpu (as `generate` resolves it)."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from klotski.errors import ConfigError
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device cpu (or auto)")
    return name


def measure_here(shape, *, device: str = "auto", link_gbps: float | None = None, refresh: bool = False,
                 pipeline_cost=None, reuse: bool = False, threads: int | None = None):
    """This machine's profile for `shape` on `device` (auto: the GPU where there is one), timed
    with the engine's own ops and cached in the user cache unless `refresh`; on a CPU at `threads`
    torch threads where the run fixes them (--threads: the profile's key says its threads)."""
    from klotski.util import cachedir
    from klotski.util.threads import held_threads, machine_busy
    from klotski.util.writes import writing
    cpu = compute_device(device) == "cpu"
    with held_threads(threads if cpu else None), \
            writing(cachedir.profiles(), "the disk-speed probe of the hardware profile"):
        profile = measure(shape, ops=EngineOps(), device=compute_device(device), link_gbps=link_gbps,
                          refresh=refresh, cache_dir=cachedir.profiles(), announce=_say,
                          busy=None if reuse else machine_busy)
        if pipeline_cost:  # what the pipeline adds around the ops (klotski/measure/overhead.py, via assemble)
            found = pipeline_cost(compute_device(device), emulated_link=bool(link_gbps), announce=_say)
            profile.overhead_s.update({k: v for k, v in found.items() if not k.startswith(LAUNCHES)})
            profile.launches = {k[len(LAUNCHES):]: v for k, v in found.items() if k.startswith(LAUNCHES)}
    return profile


def _say(text: str) -> None:
    import sys
    print(f"klotski: {text}", file=sys.stderr, flush=True)


announce = _say  # a line on stderr, as the profile's own


def profile_for(hardware: str, shape, *, device: str = "auto", link_gbps: float | None = None, pipeline_cost=None,
                reuse: bool = False, threads: int | None = None):
    """`auto` measures this machine on `device` (cached; `reuse`: a profile measured while the
    machine was busy serves too); otherwise a built-in profile name or a JSON path (which says
    its own device)."""
    if hardware == "auto":
        return measure_here(shape, device=device, link_gbps=link_gbps, pipeline_cost=pipeline_cost, reuse=reuse,
                            threads=threads)
    if hardware not in builtin_profiles() and not Path(hardware).exists():
        from klotski.errors import ConfigError
        raise ConfigError(f"--hardware {hardware!r}: not 'auto', a built-in profile "
                          f"({', '.join(builtin_profiles())}) or a profile JSON file")
    return load_profile(hardware)


def make_plan(shape, profile, *, device_memory, host_memory, prompt_len, gen_len, config, sequences=None,
              longest_prompt=None, sizes=None, gen_lens=None, prompt_lens=None, popularity=None, segments=()):
    """Solve for (bs, n, prefill chunk, placement) under the budgets; what the user fixed stays
    fixed. Time is planned for `prompt_len` (the typical prompt: batches are formed by length,
    so padding is small), memory for `longest_prompt`; routing as `popularity` says (the
    experts' marginals, in expert order; None: uniform). A refusal names the budget to raise
    and the smallest value that is then accepted."""
    cost = _cost(profile, shape, config, sizes)
    budgets = Budgets.from_profile(profile, device=device_memory, host=host_memory)
    batch_sizes = (config.batch_size,) if config.batch_size else BATCH_SIZES
    if sequences is not None:  # never plan a group larger than the job: idle capacity
        batch_sizes = tuple(bs for bs in batch_sizes if bs <= max(sequences, batch_sizes[0]))
    try:
        return solve(shape, cost, budgets, prompt_len=prompt_len, gen_len=gen_len, longest_prompt=longest_prompt,
                     batch_sizes=batch_sizes, max_sequences=sequences, schedule=config.schedule,
                     K=config.hot_experts, num_batches=1 if config.schedule == "simple" else config.num_batches,
                     chunk=config.prefill_chunk, gen_lens=gen_lens, prompt_lens=prompt_lens,
                     host_attention=config.host_attention, host_experts=config.host_experts,
                     batching=config.batching, window=config.window, next_gate=config.prefetch == "next-gate",
                     popularity=popularity, segments=segments)
    except Infeasible as e:
        raise BudgetRefused(e) from None


def _cost(profile, shape, config, sizes=None) -> CostModel:
    quant = spec_for(config)
    return CostModel(profile, shape, quant_bits=quant.bits if quant else None, sizes=sizes)


def plan_from_flags(model: str, hardware: str, config, *, device_memory, host_memory, prompt_len: int,
                    gen_len: int, pipeline_cost=None):
    """(shape, profile, Plan) of `--model` on `--hardware` for a typical prompt and answer
    length, without weights: what `klotski plan` and `klotski simulate` show. Every precision
    the model can take is planned (the Plan's `precision`), `--quantize` picks one."""
    ckpt = _gguf_checkpoint(model)
    try:
        if ckpt is None:
            shape, sizes_of = model_shape(model), None
        else:  # a GGUF file: planned with its groups' bytes as stored, as `generate` plans it
            from klotski.util.dtypes import torch_dtypes
            dtype = ckpt.spec.dtype if config.dtype == "auto" else torch_dtypes()[config.dtype]
            if hardware == "auto":  # kept decoded on a CPU as `generate` would (no job: rows at --batch-size)
                import torch
                from placement.tiers import detect_budgets
                device = torch.device(compute_device(config.device))
                budgets = detect_budgets(device.type, device_memory, host_memory)
                copies = decoded_copies(config, ckpt, dtype, device, budgets, range(1 << 20))
                config = dataclasses.replace(config, decoded_copies=copies["mode"])
                if copies["bytes"]:
                    host_memory = budgets.host - copies["bytes"]
                    _say(copies["why"])
            shape = compute_shape(ckpt, dtype, _kept(config))
            sizes_of = lambda cfg: ckpt.group_bytes(dtype, spec_for(cfg))  # noqa: E731
        profile = profile_for(hardware, shape, device=config.device, link_gbps=config.emulate_link_gbps,
                              pipeline_cost=pipeline_cost)
        options = precision_options(shape, ckpt, ckpt.spec.dtype if ckpt else None)
        if config.quantize != "auto" and not any(o.quantize == config.quantize for o in options):
            from klotski.errors import ConfigError
            packed = "GGUF blocks" if ckpt is not None else shape.expert_format
            raise ConfigError(f"--quantize {config.quantize}: {model}'s experts ship packed already "
                              f"({packed}); run without --quantize")
        return shape, profile, weigh_plans(shape, profile, config, options, sizes_of=sizes_of,
                                           device_memory=device_memory, host_memory=host_memory,
                                           prompt_len=prompt_len, gen_len=gen_len,
                                           popularity=_learned_routing_of(model, ckpt))
    finally:
        if ckpt is not None:
            ckpt.close()


def learned_plan_routing(ckpt) -> tuple[dict | None, list | None]:
    """(ranking, routing): where the saved correlation table of `ckpt` has seen a job, each MoE
    layer's experts, most picked first (the order engine_placement gives the plan's expert
    slots), and the table's picks as marginals over those slots, which the plan prices; (None,
    None) without one."""
    from klotski.prefetch.correlate import learned_routing
    learned = learned_routing(ckpt)
    if not learned:
        return None, None
    ranking, picks = learned
    return ranking, routing_in_slot_order(picks.numpy(), ckpt.spec, ranking)


def _learned_routing_of(model: str, ckpt=None) -> list | None:
    """The routing `generate` would plan `--model` with (learned_plan_routing): from `ckpt`, or
    from the checkpoint in `model`'s folder; None for an alias, a folder without weights, or a
    model no job has run on yet."""
    if ckpt is not None:
        return learned_plan_routing(ckpt)[1]
    opened = _opened(model)
    if opened is None:
        return None  # a shape alone (config.json): planned without weights, so without their routing
    try:
        return learned_plan_routing(opened)[1]
    finally:
        opened.close()


def _opened(model: str):
    """`model`'s checkpoint opened (nothing read), or None for an alias or a folder without weights."""
    if model.lower() in KNOWN_MODELS:
        return None
    from klotski.io.checkpoint import Checkpoint
    from klotski.io import registry
    from placement.store import CheckpointError
    try:
        return Checkpoint.open(str(registry.resolve(model, weights=False)), direct_io=False)
    except (CheckpointError, OSError, ValueError, KeyError):
        return None


# ---- precision: the planner weighs it (planner/precision.py) ---------------------------------
QUALITY_TABLE = Path(__file__).parent / "builtin" / "data" / "precision_quality.json"


def quality_table() -> dict | None:
    """The measured quality cost of each precision (benchmarks/precision_quality.py), or None."""
    import json
    try:
        return json.loads(QUALITY_TABLE.read_text())
    except (OSError, ValueError):
        return None


def precision_options(shape, ckpt=None, dtype=None) -> list[Precision]:
    """The precisions a run can take. A checkpoint with quant types of its own (GGUF) may list
    them as `ckpt.precision_options(dtype)` -> [planner.precision.Precision], each with its bytes
    per group as stored and its quality-table row; otherwise the checkpoint's own precision
    and HQQ 4-bit where `--quantize hqq4` runs (not over MXFP4 or GGUF experts, packed already)."""
    hook = getattr(ckpt, "precision_options", None)
    if hook is not None:
        return list(hook(dtype))
    options = default_options(shape)
    if getattr(ckpt, "is_gguf", False):  # labelled, and measured, by its experts' block type
        from klotski.io.gguf import expert_types
        types = expert_types(ckpt.store)
        return [dataclasses.replace(options[0], name=f"GGUF {'+'.join(types) or 'as stored'}",
                                    quality=types[0] if len(types) == 1 else "")]
    own = ckpt.spec.shape.expert_format if ckpt is not None else shape.expert_format  # (a kept copy's shape names none)
    return options[:1] if own == "mxfp4" else options


def weigh_plans(shape, profile, config, options, *, sizes_of=None, **plan_kw) -> Plan:
    """make_plan once per precision option; the Plan of the one `config.quantize` takes (none,
    hqq4, or auto: planner.precision.choose), with the weighing in its `precision`. `sizes_of`
    gives a run's exact group bytes for an option's config (None: from the shape). Raises the
    taken option's refusal when it does not fit (under auto: when no option fits)."""
    table = quality_table()
    weighed = []
    for option in options:
        cfg = config.replace(quantize=option.quantize)
        sizes = option.sizes if option.sizes is not None else sizes_of(cfg) if sizes_of else None
        w = Weighed(option, quality=quality_row(table, option))
        try:
            w.plan = make_plan(shape, profile, config=cfg, sizes=sizes, **plan_kw)
            w.link_bytes = link_bytes_per_step(w.plan, _cost(profile, shape, cfg, sizes))
        except BudgetRefused as e:
            w.refusal, w.error = str(e), e
        weighed.append(w)
    chosen, why = choose(weighed, config.quantize, QualityBound(config.quality_max_gap, config.quality_min_agreement))
    if chosen.plan is None and "quality bound" in why:
        raise UserError(f"{chosen.refusal}; {why.split('; ', 1)[1]}: raise the budget or loosen "
                        "--max-logprob-gap / --min-agreement")
    if chosen.plan is None:
        raise chosen.error
    return dataclasses.replace(chosen.plan, precision=to_dict(weighed, chosen, why, table))


def compare_schedules(shape, profile, plan, config, *, prompt_len: int, gen_len: int, skew: float,
                      trace: bool = False) -> tuple[list[dict], dict | None]:
    """Every schedule replayed by the simulator at the plan's bs and n (simple: n = 1) on
    synthetic routing of Zipf `skew`: a row each, and the klotski schedule's Chrome trace."""
    from planner.routing import RoutingSample
    from planner.simulate import simulate
    cost = _cost(profile, shape, config.replace(quantize=plan.precision.get("quantize", config.quantize)))
    routing = RoutingSample.synthetic(shape.num_layers, shape.num_experts, shape.top_k, skew=skew)
    rows, chrome = [], None
    for schedule in ("simple", "multibatch", "hot-prefetch", "klotski"):
        n = 1 if schedule == "simple" else plan.num_batches
        r = simulate(cost, shape, bs=plan.batch_size, n=n, schedule=schedule, prompt_len=prompt_len,
                     gen_len=gen_len, routing=routing, placement=plan, trace=trace and schedule == "klotski")
        rows.append({"schedule": schedule, "batch_size": plan.batch_size, "num_batches": n,
                     "tokens_per_s": r.tokens_per_s, "bubble_share": r.bubble_share, "step_s": r.step_s})
        if trace and schedule == "klotski":
            chrome = r.chrome_trace()
    return rows, chrome


class BudgetRefused(UserError):
    """The planner found no plan within the budgets; says which flag to raise, to what."""

    def __init__(self, e: Infeasible):
        flag = _FLAGS.get(e.budget)
        if flag and e.needed != float("inf"):
            hint = f"; rerun with {flag} {format_size_flag(e.needed)} or more"
        else:
            hint = f"; give it more {e.budget} room"
        super().__init__(f"{e}{hint}")
        self.budget, self.needed = e.budget, e.needed


def plan_job(config, ckpt, dtype, device, budgets, seqs, pipeline_cost=None, popularity=None):
    """The planner's answer for this job on this machine, from the checkpoint's exact group
    sizes (quantized ones as they will be packed); routing as `popularity` says (marginals over
    the plan's expert slots; None: uniform)."""
    caps = [s.max_new_tokens for s in seqs]
    lengths = ([len(s.prompt_ids) for s in seqs], caps, max(caps, default=config.max_new_tokens))
    # a budget that cannot work is refused before this machine is measured
    _plan_lengths(config, ckpt, dtype, device, budgets, *lengths, pipeline_cost, memory_only=True)
    own, segments = shared_prefixes(config, ckpt.spec, seqs)
    # time is planned at the lengths runs taught (planner/answer_lengths.py), memory at the caps
    answers, source = answer_lengths.lengths_for(read_answer_lengths(ckpt), answer_key(seqs), caps)
    plan = _plan_lengths(config, ckpt, dtype, device, budgets, own, answers, lengths[2], pipeline_cost,
                         popularity=popularity, segments=segments, longest=max(lengths[0], default=1))
    return dataclasses.replace(plan, answer_lengths={**source, "answer_tokens": sum(answers), "max_tokens": sum(caps)})


def answer_key(seqs) -> str:
    """The planned window as a key of the answer lengths learned for it: its sequences' prompt
    tokens and what bounds or shapes their answers (max_tokens, temperature, top_p, stop), in
    order; the same job planned again has the same key, whatever its file is called."""
    import hashlib
    import json
    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps([s.prompt_ids, s.max_new_tokens, s.temperature, s.top_p, list(s.stop), s.sample],
                            separators=(",", ":")).encode())
    return h.hexdigest()[:24]


def answer_lengths_path(ckpt) -> Path:
    """Where the answer lengths runs of `ckpt` taught are kept (beside the profiles: the
    planner's learning)."""
    from klotski.util import cachedir
    return cachedir.profiles() / "answer-lengths" / f"{ckpt.key}.json"


def read_answer_lengths(ckpt) -> dict:
    return answer_lengths.read(answer_lengths_path(ckpt), warn=_say)


def answer_lengths_of(model: str) -> dict:
    """The answer lengths runs of `--model` taught ({}: none, or a shape alone without weights)."""
    opened = _opened(model)
    if opened is None:
        return {}
    try:
        return read_answer_lengths(opened)
    finally:
        opened.close()


def shared_prefixes(config, spec, seqs) -> tuple[list[int], list[tuple[int, int]]]:
    """(the prompt tokens each line prefills itself, the shared segments as (end, tokens)) as the
    engine's prefix cache will find them in these lines (klotski/schedule/prefix.py; all of
    each prompt and none where it is off), for the plan to price each segment's prefill once."""
    from klotski.schedule.prefix import find_segments, refusal
    whole = [len(s.prompt_ids) for s in seqs]
    if refusal(spec, config) is not None or len(seqs) < 2:
        return whole, []
    found = find_segments([s.prompt_ids for s in seqs])
    shared = [0] * len(seqs)
    for _, end, members in found:
        for m in members:
            shared[m] = max(shared[m], end)
    return [w - s for w, s in zip(whole, shared)], [(end, end - start) for start, end, _ in found]


def replayed_plan(config, ckpt, setup, prompt_lens, gen_lens, pipeline_cost=None, popularity=None,
                  profile=None, segments=(), longest=None) -> Plan | None:
    """The plan for the job as it ran: the same plan (bs, n, chunk, budgets), its cost model
    replayed over the prompts and the lengths the answers actually had and, given its
    `popularity` (planner.routing.marginals_from_counts of the run), the routing the job had
    (else the routing the plan priced); `prompt_lens` the tokens each line prefilled itself and
    `segments` ((end, tokens) each) the shared prefixes prefilled, as the run did.
    Its tokens/s (and its job's prefill and decode seconds) are what the planner would have
    said had it known where each answer stops (EOS) and which experts the tokens pick, so set
    beside the measured ones they tell the cost model's error apart from the job's unknowns."""
    plan = setup.plan
    if plan is None or not gen_lens:
        return None
    fixed = dataclasses.replace(config, batch_size=setup.batch_size, num_batches=setup.num_batches,
                                decoded_copies="on" if kept_in(setup) else "off",
                                prefill_chunk=plan.prefill_chunk,
                                quantize=plan.precision.get("quantize", config.quantize))
    # (reuse: a replay is a report's figure; it never measures again mid-run, which on `klotski
    # serve` would hold the engine's thread, and online requests, for seconds)
    again = _plan_lengths(fixed, ckpt, setup.dtype, setup.device, setup.budgets, list(prompt_lens),
                          [max(1, g) for g in gen_lens], plan.gen_len, pipeline_cost, reuse=True,
                          popularity=setup.planned_routing if popularity is None else popularity, profile=profile,
                          segments=segments, longest=longest)
    return again


def _plan_lengths(config, ckpt, dtype, device, budgets, prompt_lens, gen_lens, gen_len, pipeline_cost,
                  memory_only: bool = False, reuse: bool = False, popularity=None, profile=None, segments=(),
                  longest=None):
    """The plan for a job of these prompt and answer lengths (time planned for the answers'
    `gen_lens`, memory for `gen_len`); no lengths: one sequence of a one-token prompt. With
    `memory_only`, from a profile whose times mean nothing and nothing is measured: whether
    the budgets can work (and the minimum a refusal names) depends on memory alone."""
    lengths = prompt_lens or [1]
    if memory_only:
        shape = compute_shape(ckpt, dtype, _kept(config))
        profile = _memory_only(device.type)
    elif profile is not None:  # the caller's (a run's lessons weighed: learn_from_run)
        shape = compute_shape(ckpt, dtype, _kept(config))
    else:
        shape, profile, _ = _measured(config, ckpt, dtype, device, pipeline_cost, reuse)
    kw = dict(device_memory=budgets.device, host_memory=budgets.host, prompt_len=-(-sum(lengths) // len(lengths)),
              longest_prompt=max(max(lengths), longest or 0), gen_len=gen_len, sequences=max(1, len(prompt_lens)),
              gen_lens=gen_lens or None, prompt_lens=prompt_lens or None, popularity=popularity, segments=segments)
    if config.quantize == "auto":  # under memory_only, refused only when no precision fits
        return weigh_plans(shape, profile, config, precision_options(shape, ckpt, dtype),
                           sizes_of=lambda cfg: ckpt.group_bytes(dtype, spec_for(cfg)), **kw)
    return make_plan(shape, profile, config=config, sizes=ckpt.group_bytes(dtype, spec_for(config)), **kw)


def _memory_only(device: str) -> Profile:
    """A profile whose times mean nothing: for what depends on memory alone."""
    return Profile(name="memory-only", device=device, flops=1.0, mem_bw=1.0, links=dict.fromkeys(LINKS, 1.0),
                   host_flops=1.0, host_mem_bw=1.0)


def run_cost_model(config, ckpt, dtype, device, pipeline_cost=None) -> CostModel:
    """The cost model the planner uses for this run (same profile, shape and exact group sizes),
    for the engine's own per-step decisions (host compute under `auto`)."""
    shape, profile, quant = _measured(config, ckpt, dtype, device, pipeline_cost)
    return CostModel(profile, shape, quant_bits=quant.bits if quant else None,
                     sizes=ckpt.group_bytes(dtype, quant))


def _measured(config, ckpt, dtype, device, pipeline_cost, reuse: bool = False):
    """(shape, this machine's profile for it, quantization) of a run: planned in the compute
    dtype, as that is what sits on the device and crosses the links."""
    shape = compute_shape(ckpt, dtype, _kept(config))
    profile = profile_for("auto", shape, device=device.type, link_gbps=config.emulate_link_gbps,
                          pipeline_cost=pipeline_cost, reuse=reuse, threads=config.threads)
    return shape, profile, spec_for(config)


def compute_shape(ckpt, dtype, kept: bool = False):
    """The planner's shape of `ckpt` computed in `dtype`; a GGUF model's experts named by their
    block types (the profile times them in their stored form: compress/ggml.format_name), or,
    `kept` decoded once (`decoded_copies`), none: they compute as a 16-bit model's do."""
    from klotski.util.dtypes import name_of
    shape = dataclasses.replace(as_shape(ckpt.spec), dtype=name_of(dtype))
    if kept:  # decoded once: no packed form to time or price (MXFP4's, GGUF's blocks)
        return dataclasses.replace(shape, expert_format="")
    if getattr(ckpt, "is_gguf", False):
        from klotski.compress.ggml import format_name
        key = next(k for k in ckpt.spec.group_keys() if k[0] == "expert")
        shape = dataclasses.replace(shape, expert_format=format_name(ckpt.expert_codec(dtype).block_types(key)))
    return shape


# decode rows an expert call gets at and above which a kept 16-bit copy multiplies faster than
# torch's int4 kernel over Q4_0 codes on a CPU (docs/benchmarks.md, issue 60: the copy reordered
# for oneDNN, models/prepacked.py, 0.85x the kernel's speed at 4 rows, 1.26x at 5); Q4_K's kernel
# rebuilds its scales per use and is behind at every row count measured; the other block types
# have no kernel here at all
KEPT_BEATS_INT4_ROWS = 5


def decoded_copies(config, ckpt, dtype, device, budgets, seqs) -> dict:
    """Whether a CPU run keeps its GGUF (or MXFP4) experts decoded in the compute dtype, once, in host RAM
    (a placement choice: WeightCache's `kept`), rather than in their blocks decoded per use or
    multiplied by the int4 kernel. `mode` on or off, `bytes` the decoded copies' (charged to
    the host budget: the plan is made with that much less host room), `why` in words."""
    from klotski.util.dtypes import name_of
    off = lambda why: {"mode": "off", "bytes": 0, "why": why}  # noqa: E731
    if config.decoded_copies == "off":
        return off("--decoded-copies off")
    if device.type != "cpu" or not (getattr(ckpt, "is_gguf", False) or ckpt.spec.shape.expert_format == "mxfp4"):
        return off("no GGUF or MXFP4 experts computed on a CPU")
    codec = ckpt.expert_codec(dtype, on_cpu=True)
    keys = [k for k in ckpt.spec.group_keys() if k[0] == "expert"]
    sizes = [codec.packed_nbytes(k) for k in keys], [codec.decoded_nbytes(k) for k in keys]
    need = sum(d for p, d in zip(*sizes) if p != d)
    if not need:  # floats of the compute dtype's width: read into it once and stacked, no byte added
        return {"mode": "on", "bytes": 0, "why": "the experts are stored as floats: read once into the compute "
                                                 "dtype and stacked"}
    shape = ckpt.spec.shape
    tokens = min(len(seqs), config.batch_size * (config.num_batches or 1)) if config.batch_size else len(seqs)
    rows = max(1, tokens) * shape.top_k / shape.num_experts
    types = {q for k in keys[:1] for _, q in codec.block_types(k)} if hasattr(codec, "block_types") else {"MXFP4"}
    if all(codec.int4_held(k) for k in keys) and types <= {"Q4_0"} and rows < KEPT_BEATS_INT4_ROWS:
        return off(f"the int4 kernel is the faster at {rows:.1f} decode rows an expert call "
                   f"(a kept copy from {KEPT_BEATS_INT4_ROWS})")
    if need > budgets.host:
        return {**off(f"the experts stay in their blocks: a kept {name_of(dtype)} copy ({format_size_flag(need)}) "
                      f"does not fit the host budget ({format_size_flag(budgets.host)}; --host-memory raises it)"),
                "say": True}
    return {"mode": "on", "bytes": need,
            "why": f"host weights: kept {name_of(dtype)} copy of the experts, {format_size_flag(need)} "
                   f"({'+'.join(sorted(types))} blocks decoded once, not per use)"}


def _kept(config) -> bool:
    """The run keeps its GGUF experts decoded (`decoded_copies` resolved it so in setup_run)."""
    return config.decoded_copies == "on"


def kept_in(setup) -> bool:
    """A run set up (assemble.RunSetup, or a caller's stand-in without the field) keeps its GGUF
    experts decoded."""
    return (getattr(setup, "decoded_copies", None) or {}).get("mode") == "on"


def host_modes(config, device, plan) -> tuple[str, str]:
    """Host attention and host experts as the engine runs them. `auto` on a CPU-only machine
    is off: the host is the device, so host compute saves (emulated) link bytes but never
    runs beside anything. On a GPU, attention follows the plan (the solver chose it with the
    overlap the simulator sees), and experts stay per call (the cost model at each expert's
    actual token count)."""
    modes = [config.host_attention, config.host_experts]
    if device.type == "cpu":
        return tuple("off" if m == "auto" else m for m in modes)
    if modes[0] == "auto" and plan is not None:
        modes[0] = "on" if plan.host_attention else "off"
    return tuple(modes)


def expert_pool_slots(config, ckpt, dtype, budgets, placement: Placement, *, bs: int, n: int, chunk: int | None,
                      longest_prompt: int, gen_len: int, plan=None, host_attention: bool = False) -> int:
    """Slots of the device's expert pool for this run (planner.workingset.expert_pool_slots): the
    device budget less the exact bytes the placement keeps resident (weights, and the KV cache
    when it is on the device) and the rest of the plan's working set (its buffer mode; without a
    plan the overlapping one, or the minimum where that leaves no slot), in experts. A packed
    expert's slot holds it decoded beside its packed row, and the pool a decode workspace."""
    from planner.workingset import expert_pool_slots as slots_for, working_set
    held = _held(config, ckpt, dtype, placement, bs=bs, n=n, chunk=chunk, longest_prompt=longest_prompt,
                 gen_len=gen_len, plan=plan, host_attention=host_attention)
    if not held.experts:
        return 0  # nothing streamed
    for buffers in ((plan.buffers,) if plan else ("overlap", "minimum")):
        ws = working_set(held.cost, buffers=buffers, **held.kw)
        slots = slots_for(ws, buffers, held.full, budgets.device - held.resident, held.slot, held.schedule,
                          ckpt.spec.shape.num_experts, held.hot, held.decode)
        if slots:
            return slots
    return 0


def refuse_unworkable_placement(config, ckpt, dtype, budgets, placement: Placement, *, bs: int, n: int,
                                chunk: int | None, longest_prompt: int, gen_len: int,
                                host_attention: bool = False) -> None:
    """A placement the caller gave (not planned) is refused before anything is loaded where its
    resident bytes and the least working set a step holds (planner.workingset, "minimum") do not
    fit the device budget, naming the budget that does (BudgetRefused)."""
    from planner.workingset import device_need, working_set
    held = _held(config, ckpt, dtype, placement, bs=bs, n=n, chunk=chunk, longest_prompt=longest_prompt,
                 gen_len=gen_len, host_attention=host_attention)
    steps = device_need(working_set(held.cost, buffers="minimum", **held.kw), "minimum", held.full)
    need = held.resident + steps
    if need > budgets.device:
        raise BudgetRefused(Infeasible(
            f"the placement given keeps {format_size_flag(held.resident)} on the device and a step holds "
            f"{format_size_flag(steps)} more at the least: the device budget of "
            f"{format_size_flag(budgets.device)} cannot hold them", "device", need - budgets.device, need,
            budgets.device))


@dataclasses.dataclass
class _Held:
    cost: CostModel
    resident: int      # bytes the placement keeps on the device: weights, and the KV cache there
    full: dict         # kind -> wholly resident (its buffers are not needed)
    experts: list      # the expert groups that are streamed
    slot: int          # a pool slot's bytes (a packed expert: decoded beside its packed row)
    decode: int        # the pool's decode of one expert (0: experts not packed)
    schedule: str
    hot: int
    kw: dict           # the working set's step: bs, n, lengths, chunk, schedule, hot experts


def _held(config, ckpt, dtype, placement: Placement, *, bs, n, chunk, longest_prompt, gen_len, plan=None,
          host_attention=False) -> _Held:
    """What a placement holds on the device, in the exact bytes of the run's groups."""
    quant = spec_for(config)
    cost = _cost(_memory_only("cpu"), compute_shape(ckpt, dtype, _kept(config)), config,
                 ckpt.group_bytes(dtype, quant))
    experts = [k for k, t in placement.tiers.items() if k[0] == "expert" and t != "device"]
    # a slot holds an expert decoded; a packed one also its packed row, and the pool a decode
    # workspace: sized by the largest (the engine's pool takes one of them)
    sizes = [ckpt.group_nbytes(k, dtype, quant) for k in experts]
    decoded = max((d for _, d in sizes), default=0)
    slot = max((m + d for m, d in sizes), default=0)
    decode = decoded + cost.expert_workspace if decoded else 0
    resident = sum(ckpt.group_nbytes(k, dtype, quant)[0] for k, t in placement.tiers.items() if t == "device")
    if placement.kv == "device":
        resident += (ckpt.spec.shape.num_layers * n * bs * cost.kv_context(longest_prompt + gen_len)
                     * cost.kv_bytes_per_token_layer)
    kinds = {"attention": "attn", "gate": "gate", "expert": "expert", "head": "head"}
    full = {kind: all(t == "device" for k, t in placement.tiers.items() if k[0] == key) for kind, key in kinds.items()}
    full["kv"] = placement.kv == "device"
    schedule = plan.schedule if plan else config.schedule
    hot = plan.hot_experts if plan else (0 if config.prefetch == "none"
                                         else config.hot_experts or ckpt.spec.shape.top_k)
    kw = dict(bs=bs, n=n, prompt_len=longest_prompt, gen_len=gen_len, chunk=chunk or longest_prompt,
              schedule=schedule, hot=hot, host_attention=host_attention)
    return _Held(cost, resident, full, experts, slot, decode, schedule, hot, kw)


def engine_placement(plan, spec, ranking: dict | None = None, picks=None) -> Placement:
    """The plan's tiers for the engine's groups. The plan places expert slots (it prices every
    expert alike); with a `ranking` (layer -> its experts, most picked first: a learned table's,
    prefetch/correlate.learned_routing) slot i of a layer is its i-th most picked expert, so
    the experts the plan keeps resident are the ones the tokens pick most; else slot i is
    expert i. The plan spreads its resident experts evenly over the layers (planner.place.layer_ios);
    with `picks` (a learned table's, per MoE layer and expert: learned_picks; --expert-split dp)
    as many are divided among the layers by each layer's hits instead (placement/split.py)."""
    tiers, kv = plan.group_tiers(spec.shape.num_layers, spec.shape.num_experts)
    for layer, order in (ranking or {}).items():
        slots = [tiers["expert", layer, i] for i in range(len(order))]
        for i, expert in enumerate(order):
            tiers["expert", layer, expert] = slots[i]
    # a dense first layer has no experts to place
    placement = Placement({k: t for k, t in tiers.items() if k[0] != "expert" or k[2] < spec.shape.experts_in(k[1])},
                          kv)
    if picks is None:
        return placement
    from placement.split import divide_experts
    # a decode step routes the group's rows through a layer at once: bs x n tokens a step
    tokens = getattr(plan, "batch_size", 1) * getattr(plan, "num_batches", 1)
    return divide_experts(placement, picks, [j for j in range(spec.shape.num_layers) if spec.shape.experts_in(j)],
                          tokens, spec.shape.top_k)


def learned_picks(ckpt):
    """The picks the saved correlation table of `ckpt` counted, per MoE layer and expert (a numpy
    array), or None where no job has taught it yet."""
    from klotski.prefetch.correlate import learned_routing
    learned = learned_routing(ckpt)
    return learned[1].numpy() if learned else None


def routing_in_slot_order(routed, spec, ranking: dict | None) -> list[float] | None:
    """Routing counted per MoE layer and expert (a run's, Pipeline.routed, for the replay; a
    learned table's, for the plan) as marginals over the plan's expert slots (engine_placement:
    slot i of a ranked layer is its i-th most picked expert)."""
    from planner.routing import marginals_from_counts
    counts = routed.copy()
    for layer, order in (ranking or {}).items():
        counts[spec.shape.moe_index(layer)] = routed[spec.shape.moe_index(layer)][order]
    return marginals_from_counts(counts, spec.shape.top_k)
