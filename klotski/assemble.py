"""The composition root: the one place that builds a run's pieces, in order, and hands them
over. Nothing else constructs a cache, a pipeline or an engine.

    Checkpoint.open   files, shapes, tokenizer, fingerprint           nothing loaded
    prepare           the job's sequences (tokenized)
    setup_run          bs, n, prefill chunk, placement                 a refusal happens here
    build_engine      codec (the quantized copy, made once) -> predictor -> channels and
                      memory accounts -> cache (tiers filled) -> pipeline -> Engine

`open_engine` does all of it for the Python API and the tests.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from klotski import planning
from klotski.execute.caches import CacheManager
from klotski.execute.channels import DISK_CARRIERS, make_channels
from klotski.execute.staging import HostReads, SmallUploads
from klotski.io.checkpoint import Checkpoint
from klotski.models import prepacked
from klotski.models.grouped import stack_form
from klotski.schedule.engine import Engine
from klotski.execute.hostcompute import HostCompute
from klotski.execute.pipeline import Pipeline
from klotski.prefetch.predictors import FrequencyPredictor, NextGatePredictor
from klotski.schedule.sequences import prepare
from klotski.execute.trace import Trace
from klotski.util.threads import ThreadGovernor
from placement.cache import WeightCache
from placement.pinned import PinnedBlocks
from placement.placement import Placement
from placement.tiers import DISK, HOST, Budgets, Memory, detect_budgets
from planner.units import format_size_flag
from planner.workingset import decode_workspace, planned_activations


@dataclass(frozen=True)
class RunSetup:
    """What the run does, decided before anything is loaded."""
    batch_size: int
    num_batches: int
    prefill_chunk: int | None   # prompt tokens per prefill pass; None = the whole prompt
    placement: Placement
    budgets: Budgets
    device: torch.device
    dtype: torch.dtype
    plan: object | None = None  # the planner's Plan, when it decided
    cost: object | None = None  # the run's CostModel, for the engine's own choices (host compute: auto)
    host_modes: tuple = ("off", "off")  # host attention, host experts as run (planning.host_modes)
    quantize: str = "none"      # the precision run: --quantize, or what `auto` took (plan.precision says why)
    # KV slots every continuous-batching row gets at least: `klotski serve` plans for requests
    # not yet known, so a request within what it planned never waits for longer rows
    row_slots: int = 0
    # slots of the device's expert pool that transferred experts land in (planning.expert_pool_slots)
    expert_slots: int = 0
    # the activation bytes the plan left room for (workingset.planned_activations): the engine's
    # prefill chunks keep every step within it (Engine.chunk_within); None: not bounded
    activation_reserve: int | None = None
    # layer -> its experts, most picked first, where the placement put the plan's expert slots so
    # (planning.engine_placement); None: slot i is expert i
    expert_ranking: dict | None = None
    # the routing the plan priced: marginals over its expert slots (a learned table's); None: uniform
    planned_routing: list | None = None
    # how the resident experts were divided among layers: "dp" (by the learned routing's hits,
    # placement/split.py), "even" (the plan's round-robin) or "given" (the caller's placement)
    expert_split: str = "even"
    # a CPU run's GGUF experts kept decoded (planning.decoded_copies): mode, bytes charged to the
    # host budget, groups, why; `kept`: those groups
    decoded_copies: dict = dataclasses.field(default_factory=dict)
    kept: frozenset = frozenset()

    def for_later_prompts(self) -> RunSetup:
        """Planned from the first prompts (a window, a shard, a batch): a longer prompt later is
        prefilled in chunks of what was planned, not whole."""
        if self.plan and self.prefill_chunk is None:
            return dataclasses.replace(self, prefill_chunk=self.plan.prefill_chunk)
        return self


def pipeline_cost(device: str, emulated_link: bool = False, announce=None) -> dict:
    """The pipeline's own cost per call on `device` (klotski/measure/overhead.py), for measured profiles:
    with an emulated link the CPU channels copy on their threads, without one inline."""
    from klotski.measure.overhead import pipeline_overhead
    return pipeline_overhead(device, open_engine, emulated_link=emulated_link, announce=announce)


def setup_run(config, ckpt: Checkpoint, seqs, *, placement: Placement | None = None) -> RunSetup:
    """Budgets from the flags or the machine; bs, n, prefill chunk and placement from the
    planner wherever the user left them open. Raises planning.BudgetRefused (one line, with
    the minimum that works) when nothing fits."""
    if config.quantize == "hqq4" and ckpt.is_gguf:
        from klotski.errors import ConfigError
        raise ConfigError(f"--quantize hqq4: {ckpt.directory} is a GGUF checkpoint, already quantized (its experts "
                          "stay in their GGUF blocks on every tier); run without --quantize")
    if config.attention != "full" and not ckpt.spec.family.SPARSE_ATTENTION:
        from klotski.errors import ConfigError
        why = ("'s linear-attention layers keep a state of every token, which sink/window sparsity does not thin"
               if ckpt.spec.shape.linear_layers else " attention counts positions from the keys it sees (chunked "
               "local attention, temperature tuning), which sink/window sparsity would change")
        raise ConfigError(f"--attention {config.attention}: {ckpt.spec.shape.model_type}{why}; run with "
                          "--attention full")
    if config.host_attention == "on" and ckpt.spec.shape.linear_layers:
        planning.announce(f"--host-attention on: {ckpt.spec.shape.model_type}'s linear-attention layers have no "
                          "keys to attend beside; they run on the device, its full-attention layers beside the host KV")
    if config.host_attention != "off" and not ckpt.spec.family.HOST_ATTENTION:
        # planned as the pipeline will run it (planned on the host, it overran the device budget)
        if config.host_attention == "on":
            planning.announce(f"--host-attention on: {ckpt.spec.family.MODEL_TYPE}'s attention runs beside its "
                              "latent cache on the device only; attention stays on the device")
        config = config.replace(host_attention="off")
    device, dtype = torch.device(planning.compute_device(config.device)), ckpt.compute_dtype(config.dtype)
    budgets = detect_budgets(device.type, config.device_memory, config.host_memory)
    # --prefetch pregate's maps are held on the device for the run: the plan leaves them room
    planned = budgets
    if config.prefetch == "pregate":
        from klotski.prefetch.pregate import maps_nbytes
        planned = Budgets(budgets.device - maps_nbytes(ckpt.spec.shape), budgets.host)
    # GGUF experts kept decoded on a CPU where faster and it fits: the plan gets that much less host room
    copies = planning.decoded_copies(config, ckpt, dtype, device, budgets, seqs)
    if copies["mode"] == "on":
        planned = Budgets(planned.device, planned.host - copies["bytes"])
    config = config.replace(decoded_copies=copies["mode"])
    simple = config.schedule == "simple"
    bs, n, chunk, plan = config.batch_size or 8, 1 if simple else (config.num_batches or 1), config.prefill_chunk, None
    given = placement is not None  # by the caller (the Python API, tests, benchmarks): not the planner's
    split = "given" if given else "even"  # how the resident experts were divided among layers
    # where a learned table says which experts the tokens pick most, the plan's resident slots
    # are those (engine_placement) and it prices the routing the table saw
    ranking, popularity = planning.learned_plan_routing(ckpt) if not given else (None, None)
    if config.batch_size is None or (config.num_batches is None and not simple) or placement is None:
        try:
            plan = planning.plan_job(config, ckpt, dtype, device, planned, seqs, pipeline_cost, popularity)
        except planning.BudgetRefused:
            if copies["mode"] != "on":
                raise
            copies = {"mode": "off", "bytes": 0, "say": True,
                      "why": f"the experts stay in their blocks: a kept copy ({format_size_flag(copies['bytes'])}) "
                             "leaves the plan no host room (--host-memory raises it)"}
            planned = Budgets(planned.device, budgets.host)
            config = config.replace(decoded_copies="off")
            plan = planning.plan_job(config, ckpt, dtype, device, planned, seqs, pipeline_cost, popularity)
        bs = config.batch_size or plan.batch_size
        n = 1 if simple else (config.num_batches or plan.num_batches)
        chunk = plan.prefill_chunk if plan.prefill_chunk < plan.longest_prompt else None
        if placement is None:
            # --expert-split dp: the resident experts divided among layers by the learned routing's hits
            picks = planning.learned_picks(ckpt) if config.expert_split == "dp" and ranking else None
            placement = planning.engine_placement(plan, ckpt.spec, ranking, picks)
            split = "dp" if picks is not None else "even"
    if config.quantize == "auto":  # the planner weighed each precision and took one (none when it did not plan)
        config = config.replace(quantize=plan.precision["quantize"] if plan and plan.precision else "none")
        if plan and plan.precision:
            planning.announce(plan.precision["why"])
    if config.quantize == "hqq4" and ckpt.spec.shape.expert_format == "mxfp4":
        from klotski.errors import ConfigError
        raise ConfigError(f"--quantize hqq4: {ckpt.directory} ships its experts in MXFP4 already (4.25 bits a "
                          "weight, kept packed on every tier); run without --quantize")
    if config.quantize == "hqq4":  # a copy that cannot fit is refused now, not halfway through writing it
        from klotski.compress.quantized import check_room
        check_room(ckpt, dtype, config.offload_dir, optimize=config.quantize_optimize)
    copies, kept = _kept_copies(copies, ckpt, dtype, placement, budgets, given)
    if copies["mode"] == "on" or copies.get("say"):  # said once: what is kept, or why not for want of room
        planning.announce(copies["why"])
    modes = planning.host_modes(config, device, plan)
    cost = planning.run_cost_model(config, ckpt, dtype, device, pipeline_cost) if "auto" in modes else None
    longest = max((len(s.prompt_ids) for s in seqs), default=1)
    gen = max((s.max_new_tokens for s in seqs), default=config.max_new_tokens)
    steps = dict(bs=bs, n=n, chunk=chunk, longest_prompt=longest, gen_len=gen, host_attention=modes[0] == "on")
    if given:  # the planner's own placements fit by construction
        planning.refuse_unworkable_placement(config, ckpt, dtype, planned, placement, **steps)
    slots = planning.expert_pool_slots(config, ckpt, dtype, planned, placement, plan=plan, **steps)
    reserve = planned_activations(ckpt.spec, dtype.itemsize, bs, n, chunk or longest, longest, gen,
                                  host_attention=modes[0] == "on")
    return RunSetup(bs, n, chunk, placement, budgets, device, dtype, plan, cost, modes, config.quantize,
                    expert_slots=slots, activation_reserve=reserve, expert_ranking=ranking,
                    planned_routing=popularity, expert_split=split, decoded_copies=copies, kept=kept)


def _kept_copies(copies: dict, ckpt, dtype, placement: Placement, budgets: Budgets, given: bool):
    """(the decision as run, the groups kept decoded): the GGUF experts the placement keeps on the
    device (others move in their blocks), their decoded bytes; a caller's placement is held to the
    host budget here (a plan was made with that room taken already)."""
    if copies["mode"] != "on":
        return copies, frozenset()
    from klotski.util.dtypes import name_of
    codec = ckpt.expert_codec(dtype, on_cpu=True)
    kept = frozenset(k for k, t in placement.tiers.items() if k[0] == "expert" and t == "device")
    if not kept:
        return {"mode": "off", "bytes": 0, "why": "the placement keeps no packed expert on the device"}, kept
    # (floats of the compute dtype's width are converted in place of their blocks: no byte added)
    nbytes = sum(codec.decoded_nbytes(k) for k in kept if codec.packed_nbytes(k) != codec.decoded_nbytes(k))
    host = sum(ckpt.group_nbytes(k, dtype)[0] for k, t in placement.tiers.items() if t == HOST)
    if given and host + nbytes > budgets.host:
        return {"mode": "off", "bytes": 0, "say": True, "why": f"the experts stay in their blocks: a kept copy "
                f"({format_size_flag(nbytes)}) does not fit the host budget beside the placement's host groups "
                "(--host-memory raises it)"}, frozenset()
    types = "+".join(sorted({q for k in kept for _, q in codec.block_types(k)})) if hasattr(codec, "block_types") \
        else "MXFP4"
    why = (f"host weights: kept {name_of(dtype)} copy of {len(kept)} experts, {format_size_flag(nbytes)} "
           f"({types} blocks decoded once, not per use)" if nbytes else
           f"host weights: {len(kept)} experts' {types} floats read once into {name_of(dtype)} and stacked")
    return {**copies, "bytes": nbytes, "groups": len(kept), "why": why}, kept


def make_predictor(config, ckpt: Checkpoint):
    spec, how = ckpt.spec, config.prefetch
    if how == "correlation":
        from klotski.prefetch.correlate import learning_predictor
        return learning_predictor(ckpt)
    if how == "next-gate":
        return NextGatePredictor(spec.shape.num_layers, spec.shape.num_experts)
    if how == "pregate":
        from klotski.prefetch.pregate import pregate_predictor
        return pregate_predictor(ckpt, compare=config.prefetch_compare)
    return FrequencyPredictor(spec.shape.num_layers, spec.shape.num_experts, name="none")  # K = 0: nothing is predicted


def build_engine(config, ckpt: Checkpoint, setup: RunSetup, *, predictor=None) -> Engine:
    """Fill the tiers as planned and wire the pipeline; the only step that reads weights."""
    device, dtype = setup.device, setup.dtype
    if config.quantize == "auto":
        config = config.replace(quantize=setup.quantize)
    codec = None
    if config.quantize == "hqq4":
        from klotski.compress.quantized import QuantCodec, ensure_quantized
        codec = QuantCodec(ensure_quantized(ckpt, dtype, config.offload_dir, optimize=config.quantize_optimize),
                           dtype, on_cpu=device.type == "cpu")
    else:  # MXFP4 or GGUF experts stay packed as shipped, decoded on the device
        codec = ckpt.expert_codec(dtype, on_cpu=device.type == "cpu")
    predictor = predictor or make_predictor(config, ckpt)
    trace = Trace(keep_events=bool(config.trace), cuda=device.type == "cuda", every=config.time_every)
    channels = make_channels(device, trace, config.emulate_link_gbps, config.transfer_chunk_ms)
    memory = Memory(setup.budgets.device, "device")
    if device.type == "cuda":  # the real allocator's peak is read against the budget from here (report)
        memory.runtime_bytes = _cublas_workspace(device, dtype)
        torch.cuda.reset_peak_memory_stats(device)
        memory.allocator_baseline = torch.cuda.memory_allocated(device)
    host_memory = Memory(setup.budgets.host, "host")
    uploads, reads = SmallUploads(device), HostReads(device)
    reserve_staging_rings(host_memory, channels, setup, (uploads, reads))
    cache = WeightCache(ckpt.store, setup.placement, ckpt.spec.group_refs, dtype, memory,
                        to_device=lambda t: t.to(device),
                        host_blocks=PinnedBlocks(pinned=True) if device.type == "cuda" else None,
                        disk_channel=channels["disk"], codec=codec, host_memory=host_memory, kept=setup.kept,
                        **reordering(config, ckpt.spec, device, dtype))
    _check_sizes(cache, ckpt, dtype, config)
    # slots for the transferred experts, made once and held: copies land in them, waves read them
    cache.open_pool(setup.expert_slots, event=torch.cuda.Event if device.type == "cuda" else None,
                    decode_workspace=decode_workspace)
    host = HostCompute(*setup.host_modes, setup.cost, asked=(config.host_attention, config.host_experts))
    pipeline = Pipeline(ckpt.spec, cache, channels, config, trace, predictor, memory, device, host, uploads, reads)
    # a CPU device computes on the cores free now, looked at again as the run goes (util/threads.py)
    threads = ThreadGovernor(config.threads) if device.type == "cpu" else None
    # the executor's caches on the run's KV tier, each charged to its budget (execute/caches.py)
    kv_on_host = setup.placement.kv == HOST
    caches = CacheManager(ckpt.spec.shape, dtype, device, on_host=kv_on_host,
                          account=host_memory if kv_on_host else memory, make_room=pipeline.make_room,
                          drain=channels["kv_load"].drain, staging=CacheManager.staging_for(channels["kv_load"], device))
    return Engine(config, ckpt, setup, pipeline=pipeline, caches=caches, cache=cache, predictor=predictor,
                  channels=channels, memory=memory, host_memory=host_memory, trace=trace, device=device, dtype=dtype,
                  threads=threads)


def reordering(config, spec, device, dtype) -> dict:
    """WeightCache's forms for a CPU run in bf16 (models/prepacked.py): the resident experts'
    stack form where the family's grouped FFN reads one, and its projections reordered; none
    with --reordered-weights off, elsewhere, or where this torch lacks it."""
    if config.reordered_weights == "off" or not prepacked.applies(device.type, dtype):
        return {}
    return {"stack_form": stack_form(spec.family.bind_grouped_expert_ffn(spec), device.type, dtype),
            "linear_form": functools.partial(prepacked.reorder_linear, spec.family.LINEAR_WEIGHTS)}


def reserve_staging_rings(host_memory: Memory, channels: dict, setup: RunSetup, step_rings=()) -> None:
    """The page-locked rings host data crosses a CUDA link through, charged now: the step's
    small uploads and routing reads (`step_rings`, held for the run), and the channels' own
    (staging.StagedCopies), made on first use and given back when the channels close: one per
    channel carrying disk-tier groups up (as the planner charged them), the activations
    channel's where host compute may run (its results go up through it), and the kv_load
    channel's where the KV cache is on the host (strided slots are gathered into it)."""
    if setup.device.type != "cuda":
        return  # no ring: on a CPU the "device" is host memory
    held = sum(r.pinned_bytes for r in step_rings)
    if held:
        host_memory.reserve(held, "the step's page-locked rings (small uploads, routing reads)")
    names = [*(DISK_CARRIERS if DISK in setup.placement.tiers.values() else ()),
             *(("activations",) if setup.host_modes != ("off", "off") else ()),
             *(("kv_load",) if setup.placement.kv == HOST else ())]
    for name in names:
        channels[name].staged.charge(host_memory, f"the {name} channel's page-locked staging ring")


def adopt_on_this_thread(engine: Engine) -> None:
    """A thread other than the one that built `engine` will run its steps (`klotski serve`'s
    worker). On CUDA cuBLAS keeps a handle, and a workspace, per thread: this thread's is made
    now and counted with the runtime, outside the budget's accounts, as the builder's was."""
    if engine.device.type == "cuda":
        made = _cublas_workspace(engine.device, engine.dtype)
        engine.memory.runtime_bytes += made
        engine.memory.allocator_baseline += made


def _cublas_workspace(device, dtype) -> int:
    """cuBLAS allocates a workspace per stream on first use, through the caching allocator. It
    belongs to the CUDA runtime, like the context, and does not grow with the job: it is made
    here, before the baseline the budget is held to, and reported apart (bytes it took)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.ones(2, 64, 64, device=device, dtype=dtype)
    torch.nn.functional.linear(a, a[0], a[0, 0])
    torch.bmm(a, a)
    del a
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


def _check_sizes(cache: WeightCache, ckpt: Checkpoint, dtype, config) -> None:
    """The planner sized every group from the checkpoint's headers (and the quantized layout);
    the cache measured the real thing. They must agree, or a budget could be broken."""
    from klotski.compress.hqq import spec_for
    quant = spec_for(config)
    for key in cache.moved:
        planned = ckpt.group_nbytes(key, dtype, quant)[0]
        assert cache.moved[key] == planned, f"{key}: planned {planned} bytes, the cache holds {cache.moved[key]}"


def open_engine(config, requests, *, placement: Placement | None = None, predictor=None):
    """Checkpoint, sequences, plan and engine for `requests`: (engine, sequences, line errors)."""
    ckpt = Checkpoint.open(config.model, direct_io=config.direct_io)
    seqs, errors = prepare(requests, ckpt.tokenizer, ckpt.spec, config)
    setup = setup_run(config, ckpt, seqs, placement=placement)
    return build_engine(config, ckpt, setup, predictor=predictor), seqs, errors
