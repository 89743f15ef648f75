"""Glue between the engine and the planner: which profile, which budgets, and turning the
planner's Plan into the engine's batch size, n and Placement. The planner decides; this
module only asks it."""
from __future__ import annotations

import json
import math
from pathlib import Path

from planner.costmodel import CostModel
from planner.place import activation_bytes  # noqa: F401  (the engine sizes its reserve with it)
from planner.profile import builtin_profiles, load_profile, measure
from planner.shapes import KNOWN_MODELS, as_shape
from planner.solve import Budgets, Infeasible, solve

from placement.plan import Placement


def model_shape(model: str):
    """Shape of `--model` without loading weights: an alias, or a directory's config.json."""
    if model.lower() in KNOWN_MODELS:
        return as_shape(model.lower())
    from klotski.models import registry
    return as_shape(json.loads((Path(registry.resolve(model)) / "config.json").read_text()))


def profile_for(hardware: str, shape, *, device: str = "cpu", link_gbps: float | None = None):
    """`auto` measures this machine (cached); otherwise a built-in profile name or a JSON path."""
    if hardware == "auto":
        return measure(shape, device=device, link_gbps=link_gbps)
    if hardware not in builtin_profiles() and not Path(hardware).exists():
        from klotski.config import ConfigError
        raise ConfigError(f"--hardware {hardware!r}: not 'auto', a built-in profile "
                          f"({', '.join(builtin_profiles())}) or a profile JSON file")
    return load_profile(hardware)


def make_plan(shape, profile, *, device_memory, host_memory, prompt_len, gen_len, config, sequences=None):
    """Solve for (bs, n, placement) under the budgets; bs and n fixed when the user gave them."""
    cost = CostModel(profile, shape, quant_bits=4 if config.quantize == "hqq4" else None)
    budgets = Budgets.from_profile(profile, device=device_memory, host=host_memory)
    batch_sizes = (config.batch_size,) if config.batch_size else tuple(range(4, 65, 4))
    num_batches = 1 if config.schedule == "simple" else config.num_batches

    def for_bs(bs):
        # never plan a group larger than the job: n*bs beyond the sequences is idle capacity
        max_n = 64 if sequences is None else max(1, sequences // bs)
        return solve(shape, cost, budgets, prompt_len=prompt_len, gen_len=gen_len, batch_sizes=(bs,),
                     max_n=max_n, schedule=config.schedule, K=config.hot_experts, num_batches=num_batches)

    if sequences is not None:
        batch_sizes = tuple(bs for bs in batch_sizes if bs <= max(sequences, batch_sizes[0])) or batch_sizes[:1]
    plans, failure = [], None
    for bs in batch_sizes:
        try:
            plans.append(for_bs(bs))
        except Infeasible as e:
            failure = failure or e
    if not plans:
        raise failure
    return max(plans, key=lambda p: p.predicted_tokens_per_s)


def engine_placement(plan, spec) -> Placement:
    tiers, kv = plan.group_tiers(spec.num_layers, spec.num_experts)
    return Placement(tiers, kv)
