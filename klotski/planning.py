"""Glue between the engine and the planner: which profile, which budgets, and turning the
planner's Plan into the engine's batch size, n, prefill chunk and Placement. The planner
decides; this module only asks it, and words its refusals as the flags to change."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from klotski.errors import UserError
from placement.plan import Placement
from planner.costmodel import CostModel
from planner.profile import builtin_profiles, load_profile, measure
from planner.shapes import KNOWN_MODELS, as_shape
from planner.solve import BATCH_SIZES, Budgets, Infeasible, solve
from planner.units import format_size_flag

_FLAGS = {"device": "--device-memory", "host": "--host-memory"}


def model_shape(model: str):
    """Shape of `--model` without loading weights: an alias, or a directory's config.json."""
    if model.lower() in KNOWN_MODELS:
        return as_shape(model.lower())
    from klotski.models import registry
    from klotski.models.spec import ModelSpec
    return as_shape(ModelSpec.from_dir(registry.resolve(model)))


def profile_for(hardware: str, shape, *, device: str = "cpu", link_gbps: float | None = None):
    """`auto` measures this machine (cached); otherwise a built-in profile name or a JSON path."""
    if hardware == "auto":
        from klotski import cachedir
        from klotski.writes import writing
        with writing(cachedir.profiles(), "the disk-speed probe of the hardware profile"):
            return measure(shape, device=device, link_gbps=link_gbps, cache_dir=cachedir.profiles())
    if hardware not in builtin_profiles() and not Path(hardware).exists():
        from klotski.config import ConfigError
        raise ConfigError(f"--hardware {hardware!r}: not 'auto', a built-in profile "
                          f"({', '.join(builtin_profiles())}) or a profile JSON file")
    return load_profile(hardware)


def make_plan(shape, profile, *, device_memory, host_memory, prompt_len, gen_len, config, sequences=None,
              longest_prompt=None, sizes=None):
    """Solve for (bs, n, prefill chunk, placement) under the budgets; what the user fixed stays
    fixed. Time is planned for `prompt_len` (the typical prompt: batches are formed by length,
    so padding is small), memory for `longest_prompt`. A refusal names the budget to raise
    and the smallest value that is then accepted."""
    cost = CostModel(profile, shape, quant_bits=4 if config.quantize == "hqq4" else None, sizes=sizes)
    budgets = Budgets.from_profile(profile, device=device_memory, host=host_memory)
    batch_sizes = (config.batch_size,) if config.batch_size else BATCH_SIZES
    if sequences is not None:  # never plan a group larger than the job: idle capacity
        batch_sizes = tuple(bs for bs in batch_sizes if bs <= max(sequences, batch_sizes[0]))
    try:
        return solve(shape, cost, budgets, prompt_len=prompt_len, gen_len=gen_len, longest_prompt=longest_prompt,
                     batch_sizes=batch_sizes, max_sequences=sequences, schedule=config.schedule,
                     K=config.hot_experts, num_batches=1 if config.schedule == "simple" else config.num_batches,
                     chunk=config.prefill_chunk)
    except Infeasible as e:
        raise BudgetRefused(e) from None


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


def plan_job(config, ckpt, dtype, device, budgets, seqs):
    """The planner's answer for this job on this machine, from the checkpoint's exact group
    sizes (quantized ones as they will be packed)."""
    from klotski.quant import QuantSpec
    quant = QuantSpec(optimize=config.quantize_optimize) if config.quantize == "hqq4" else None
    # plan in the compute dtype: that is what sits on the device and crosses the links
    shape = dataclasses.replace(as_shape(ckpt.spec), dtype=str(dtype).removeprefix("torch."))
    profile = profile_for("auto", shape, device=device.type, link_gbps=config.emulate_link_gbps)
    lengths = [len(s.prompt_ids) for s in seqs] or [1]
    return make_plan(shape, profile, device_memory=budgets.device, host_memory=budgets.host,
                     prompt_len=-(-sum(lengths) // len(lengths)), longest_prompt=max(lengths),
                     gen_len=max((s.max_new_tokens for s in seqs), default=config.max_new_tokens), config=config,
                     sequences=max(1, len(seqs)), sizes=ckpt.group_bytes(dtype, quant))


def engine_placement(plan, spec) -> Placement:
    tiers, kv = plan.group_tiers(spec.num_layers, spec.num_experts)
    return Placement(tiers, kv)
