"""Glue between the engine and the planner: which profile (measured with the engine's own
ops, EngineOps, on the device `--device` names), which budgets, and turning the planner's
Plan into the engine's batch size, n, prefill chunk and Placement. The planner decides; this
module only asks it, and words its refusals as the flags to change."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from pathlib import Path

from klotski.errors import UserError
from placement.placement import Placement
from planner.costmodel import CostModel
from planner.profile import builtin_profiles, load_profile, measure
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
    return as_shape(ModelSpec.from_dir(registry.resolve(model)))


def compute_device(name: str) -> str:
    """`--device`: `auto` is cuda where torch sees a GPU, else cpu (as `generate` resolves it)."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from klotski.config import ConfigError
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device cpu (or auto)")
    return name


def measure_here(shape, *, device: str = "auto", link_gbps: float | None = None, refresh: bool = False,
                 pipeline_cost=None):
    """This machine's profile for `shape` on `device` (auto: the GPU where there is one), timed
    with the engine's own ops and cached in the user cache unless `refresh`."""
    from klotski.util import cachedir
    from klotski.util.writes import writing
    with writing(cachedir.profiles(), "the disk-speed probe of the hardware profile"):
        profile = measure(shape, ops=EngineOps(), device=compute_device(device), link_gbps=link_gbps,
                          refresh=refresh, cache_dir=cachedir.profiles())
        if pipeline_cost:  # what the pipeline adds around the ops (klotski/runtime/overhead.py, via assemble)
            profile.overhead_s.update(pipeline_cost(compute_device(device), emulated_link=bool(link_gbps)))
    return profile


def profile_for(hardware: str, shape, *, device: str = "auto", link_gbps: float | None = None, pipeline_cost=None):
    """`auto` measures this machine on `device` (cached); otherwise a built-in profile name or a
    JSON path (which says its own device)."""
    if hardware == "auto":
        return measure_here(shape, device=device, link_gbps=link_gbps, pipeline_cost=pipeline_cost)
    if hardware not in builtin_profiles() and not Path(hardware).exists():
        from klotski.config import ConfigError
        raise ConfigError(f"--hardware {hardware!r}: not 'auto', a built-in profile "
                          f"({', '.join(builtin_profiles())}) or a profile JSON file")
    return load_profile(hardware)


def make_plan(shape, profile, *, device_memory, host_memory, prompt_len, gen_len, config, sequences=None,
              longest_prompt=None, sizes=None, gen_lens=None, prompt_lens=None):
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
                     chunk=config.prefill_chunk, gen_lens=gen_lens, prompt_lens=prompt_lens,
                     host_attention=config.host_attention, host_experts=config.host_experts,
                     batching=config.batching, window=config.window)
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


def plan_job(config, ckpt, dtype, device, budgets, seqs, pipeline_cost=None):
    """The planner's answer for this job on this machine, from the checkpoint's exact group
    sizes (quantized ones as they will be packed)."""
    return _plan_lengths(config, ckpt, dtype, device, budgets, [len(s.prompt_ids) for s in seqs],
                         [s.max_new_tokens for s in seqs],
                         max((s.max_new_tokens for s in seqs), default=config.max_new_tokens), pipeline_cost)


def replayed_plan(config, ckpt, setup, prompt_lens, gen_lens, pipeline_cost=None) -> Plan | None:
    """The plan for the job as it ran: the same plan (bs, n, chunk, budgets), its cost model
    replayed over the prompts and the lengths the answers actually had. Its tokens/s (and its
    job's prefill and decode seconds) are what the planner would have said had it known where
    each answer stops (EOS), so set beside the measured ones they tell the cost model's error
    apart from the job's unknowns."""
    plan = setup.plan
    if plan is None or not gen_lens:
        return None
    fixed = dataclasses.replace(config, batch_size=setup.batch_size, num_batches=setup.num_batches,
                                prefill_chunk=plan.prefill_chunk)
    again = _plan_lengths(fixed, ckpt, setup.dtype, setup.device, setup.budgets, list(prompt_lens),
                          [max(1, g) for g in gen_lens], plan.gen_len, pipeline_cost)
    return again


def _plan_lengths(config, ckpt, dtype, device, budgets, prompt_lens, gen_lens, gen_len, pipeline_cost):
    """The plan for a job of these prompt and answer lengths (time planned for the answers'
    `gen_lens`, memory for `gen_len`); no lengths: one sequence of a one-token prompt."""
    from klotski.compress.hqq import QuantSpec
    quant = QuantSpec(optimize=config.quantize_optimize) if config.quantize == "hqq4" else None
    # plan in the compute dtype: that is what sits on the device and crosses the links
    shape = dataclasses.replace(as_shape(ckpt.spec), dtype=str(dtype).removeprefix("torch."))
    profile = profile_for("auto", shape, device=device.type, link_gbps=config.emulate_link_gbps,
                          pipeline_cost=pipeline_cost)
    lengths = prompt_lens or [1]
    return make_plan(shape, profile, device_memory=budgets.device, host_memory=budgets.host,
                     prompt_len=-(-sum(lengths) // len(lengths)), longest_prompt=max(lengths), gen_len=gen_len,
                     config=config, sequences=max(1, len(prompt_lens)), sizes=ckpt.group_bytes(dtype, quant),
                     gen_lens=gen_lens or None, prompt_lens=prompt_lens or None)


def run_cost_model(config, ckpt, dtype, device, pipeline_cost=None) -> CostModel:
    """The cost model the planner uses for this run (same profile, shape and exact group sizes),
    for the engine's own per-step decisions (host compute under `auto`)."""
    from klotski.compress.hqq import QuantSpec
    quant = QuantSpec(optimize=config.quantize_optimize) if config.quantize == "hqq4" else None
    shape = dataclasses.replace(as_shape(ckpt.spec), dtype=str(dtype).removeprefix("torch."))
    profile = profile_for("auto", shape, device=device.type, link_gbps=config.emulate_link_gbps,
                          pipeline_cost=pipeline_cost)
    return CostModel(profile, shape, quant_bits=4 if config.quantize == "hqq4" else None,
                     sizes=ckpt.group_bytes(dtype, quant))


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


def engine_placement(plan, spec) -> Placement:
    tiers, kv = plan.group_tiers(spec.num_layers, spec.num_experts)
    # a dense first layer has no experts to place
    return Placement({k: t for k, t in tiers.items() if k[0] != "expert" or k[2] < spec.experts_in(k[1])}, kv)


# ---- the ops the profile times ----------------------------------------------------------
# The engine code EngineOps calls; a change to any of it changes the profile's cache key.
_TIMED_MODULES = ("klotski.models.layers", "klotski.models.mixtral", "klotski.models.qwen3_moe",
                  "klotski.models.qwen2_moe", "klotski.models.olmoe", "klotski.models.gpt_oss",
                  "klotski.models.deepseek_v2", "klotski.models.deepseek_v3", "klotski.runtime.kvcache", "klotski.compress.hqq",
                  "klotski.compress.mxfp4")


class EngineOps:
    """The profile's ops factory (planner/profile.py, `measure(ops=...)`): each op is the
    engine's own code as the pipeline calls it, on random weights of the shape's family."""

    VERSION = 3  # of how _LayerOps composes the engine's functions; the code it calls is hashed

    @functools.cached_property
    def key(self) -> str:
        """Names what is timed: this composition, the source of the engine code it calls, and
        the hqq release that dequantizes."""
        import importlib
        import inspect
        from importlib.metadata import PackageNotFoundError, version
        h = hashlib.sha256()
        for name in _TIMED_MODULES:
            h.update(inspect.getsource(importlib.import_module(name)).encode())
        try:
            hqq = version("hqq")
        except PackageNotFoundError:
            hqq = "none"
        return f"klotski-engine-ops/{self.VERSION}/{h.hexdigest()[:16]}/hqq-{hqq}"

    def __call__(self, shape, dtype, device) -> "_LayerOps":
        return _LayerOps(shape, dtype, device)


class _LayerOps:
    """Random weights of one layer of `shape`'s family on `device`, and closures running each op
    exactly as the pipeline does: the family's attention block over a BatchKV (norm, RoPE,
    GQA expansion, scores chunked at ATTENTION_SCORE_CHUNK), its router and shared expert,
    SwiGLU experts in PREFILL_EXPERT_CHUNK pieces, the LM head, and HQQ dequantization of one
    expert as the quantized cache decodes it. Per-step work (RoPE tables, masks) is prepared
    outside the timed closures, as the pipeline does it once per step, not per layer.

    Each closure cycles through copies of its weights and inputs, COLD_BYTES of them in all:
    a step reads every weight (and KV block) once, long after the last step evicted it from
    the caches, and an op timed over the same warm weight again and again ran 1.7x faster
    than that here (a 10.6 MB expert at 8 tokens: 1.09 ms warm, 1.87 ms cold, 1.86 ms
    freshly cloned as the residency cache does)."""

    COLD_BYTES = 256 << 20  # above any CPU's last-level cache and an H100's 50 MB L2
    MAX_COPIES = 16

    def __init__(self, shape, dtype, device):
        import torch

        from klotski.models.spec import FAMILIES, ModelSpec, rope_frequencies
        self.torch, self.dtype, self.device = torch, dtype, torch.device(device)
        family = FAMILIES[shape.model_type]
        inv_freq, scaling = rope_frequencies({}, shape.head_dim)
        self.packed = shape.expert_format  # MXFP4 experts are timed decoded, their decoding apart
        self.spec = ModelSpec(shape=dataclasses.replace(shape, expert_format=""), dtype=dtype, rms_norm_eps=1e-5, max_position_embeddings=1 << 20,
                              rope_inv_freq=inv_freq, rope_attention_scaling=scaling, **family.options({}))
        self.M = family
        moe = min(shape.dense_layers, shape.num_layers - 1)  # a MoE layer's gate, not a dense layer's MLP
        self.attn, self.gate_w, self.expert_w = (self._copies(k) for k in (("attn", 0), ("gate", moe),
                                                                           ("expert", moe, 0)))
        self._head = None

    def _copies(self, key) -> list[dict]:
        first = self._weights(key)
        return [first] + [self._weights(key) for _ in range(self._count(_nbytes(first)) - 1)]

    def _count(self, nbytes: int) -> int:
        """How many copies of `nbytes` of data one op cycles through to read it cold."""
        return max(1, min(self.MAX_COPIES, self.COLD_BYTES // max(1, nbytes)))

    @staticmethod
    def _cycle(runs: list):
        turn = itertools.cycle(runs)
        return lambda: next(turn)()

    def _weights(self, key) -> dict:
        """The group's tensors by local name: norms (and biases) ones, projections N(0, 0.02²)."""
        torch, shapes = self.torch, self.spec.local_shapes()

        def make(size):
            if len(size) == 1:
                return torch.ones(size, dtype=self.dtype, device=self.device)
            return torch.randn(size, dtype=self.dtype, device=self.device) * 0.02
        return {name: make(shapes[name]) for name in self.spec.group_refs(key)}

    def _x(self, *size):
        return self.torch.randn(*size, dtype=self.dtype, device=self.device)

    def attention(self, bs: int, ctx: int, new: int):
        torch, s = self.torch, self.spec
        from klotski.runtime.kvcache import BatchKV
        from klotski.models import layers as L
        from planner.workingset import ATTENTION_SCORE_CHUNK
        past = ctx - new
        heads, key_dim, value_dim = s.kv_cache_dims
        # masks and RoPE tables are built on the host and moved, as the pipeline does
        mask = L.attention_mask(torch.ones(bs, ctx, dtype=torch.bool), new, s.sliding_window).to(self.device)
        positions = torch.arange(past, ctx).expand(bs, new)
        cos, sin = (t.to(self.device) for t in
                    L.rope_tables(positions, s.rope_inv_freq, s.rope_attention_scaling, self.dtype))
        kv_bytes = bs * ctx * heads * (key_dim + value_dim) * self.dtype.itemsize
        runs = []
        for w in self.attn[:self._count(_nbytes(self.attn[0]) + kv_bytes)]:
            kv = BatchKV(1, bs, heads, key_dim, ctx, self.dtype, device=self.device, value_dim=value_dim)
            if past:
                kv.begin_step(torch.ones(bs, past, dtype=torch.bool))
                kv.end_step()
            kv.begin_step(torch.ones(bs, new, dtype=torch.bool))
            h = self._x(bs, new, s.hidden_size)
            runs.append(lambda h=h, w=w, kv=kv: self.M.attention_block(
                h, w, cos, sin, mask, lambda k, v: kv.write(0, k, v), s, max_scores=ATTENTION_SCORE_CHUNK))
        return self._cycle(runs)

    def attend(self, bs: int, ctx: int, new: int):
        """The attention core alone (what host attention runs beside a host KV cache)."""
        from klotski.models import layers as L
        s, torch = self.spec, self.torch
        heads, key_dim, _ = s.kv_cache_dims
        mask = L.attention_mask(torch.ones(bs, ctx, dtype=torch.bool), new, None).to(self.device)
        runs = []
        for _ in range(self._count(2 * bs * heads * ctx * key_dim * self.dtype.itemsize)):
            q = self._x(bs, s.num_heads, new, key_dim)
            keys, values = self._x(bs, heads, ctx, key_dim), self._x(bs, heads, ctx, key_dim)
            runs.append(lambda q=q, keys=keys, values=values: L.attend(q, keys, values, mask))
        return self._cycle(runs)

    def gate(self, n: int):
        from klotski.models import layers as L
        s = self.spec
        h = self._x(n, s.hidden_size)

        def run(g):
            x = L.rms_norm(h, g["post_norm"], s.rms_norm_eps)
            return self.M.route(x, g, s), self.M.shared_ffn(x, g, s)
        return self._cycle([functools.partial(run, g) for g in self.gate_w])

    def expert(self, n: int):
        from planner.workingset import PREFILL_EXPERT_CHUNK
        from klotski.runtime.pipeline import _expert_ffn
        x, ffn = self._x(n, self.spec.hidden_size), _expert_ffn(self.M, self.spec)
        return self._cycle([lambda w=w: self.torch.cat([ffn(c, w) for c in x.split(PREFILL_EXPERT_CHUNK)])
                            for w in self.expert_w])

    def head(self, n: int):
        from klotski.models import layers as L
        if self._head is None:
            self._head = self._copies(("head",))
        x = self._x(n, self.spec.hidden_size)
        return self._cycle([lambda w=w: L.logits(x, w["norm"], w["lm_head"], self.spec.rms_norm_eps)
                            for w in self._head])

    def dequant(self):
        if self.packed == "mxfp4":
            from klotski.compress import mxfp4
            parts = {f"{m}_{p}": t.to(self.device) for m in mxfp4.MATRICES
                     for p, t in zip(("blocks", "scales"), mxfp4.quantize(self.expert_w[0][m].t().float().cpu()))}
            return lambda: {m: mxfp4.dequantize(parts[f"{m}_blocks"], parts[f"{m}_scales"], self.dtype)
                            for m in mxfp4.MATRICES}
        from klotski.compress import hqq as quant
        parts = quant.quantize_group(self.expert_w[0], quant.QuantSpec())  # packed on the device, where it is decoded
        return lambda: quant.dequantize_group(parts, self.dtype)


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
