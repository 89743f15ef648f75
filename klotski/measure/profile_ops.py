"""The ops a hardware profile times (planner/profile.py, `measure(ops=EngineOps())`): the
engine's own code as the pipeline runs it, on random weights of the shape's family, so the
planner's cost model is fitted to what generation will actually execute."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools


# The engine code EngineOps calls; a change to any of it changes the profile's cache key.
TIMED_MODULES = ("klotski.models.layers", "klotski.models.defaults", "klotski.models.mixtral",
                  "klotski.models.qwen3_moe", "klotski.models.qwen2_moe", "klotski.models.olmoe",
                  "klotski.models.gpt_oss", "klotski.models.deepseek_v2", "klotski.models.deepseek_v3",
                  "klotski.models.glm4_moe", "klotski.models.minimax_m2",
                  "klotski.models.ernie4_5_moe", "klotski.models.llama4", "klotski.models.qwen3_next",
                  "klotski.models.qwen3_5_moe", "klotski.models.gated_deltanet",
                  "klotski.models.grouped", "klotski.execute.kvcache", "klotski.execute.experts", "klotski.compress.hqq",
                  "klotski.compress.mxfp4", "klotski.compress.ggml", "klotski.compress.int4", "klotski.models.int4",
                  "klotski.models.prepacked")


class EngineOps:
    """The profile's ops factory (planner/profile.py, `measure(ops=...)`): each op is the
    engine's own code as the pipeline calls it, on random weights of the shape's family."""

    VERSION = 5  # of how LayerOps composes the engine's functions (4: `kernels`; 5: `wave`); the code it calls is hashed

    @functools.cached_property
    def key(self) -> str:
        """Names what is timed: this composition, the source of the engine code it calls, and
        the hqq release that dequantizes."""
        import importlib
        import inspect
        from importlib.metadata import PackageNotFoundError, version
        h = hashlib.sha256()
        for name in TIMED_MODULES:
            h.update(inspect.getsource(importlib.import_module(name)).encode())
        try:
            hqq = version("hqq")
        except PackageNotFoundError:
            hqq = "none"
        # whether 4-bit weights run torch's int4 kernel here (compress/int4.py) changes what the
        # expert ops time on a CPU: a profile of one is no measure of the other
        from klotski.compress import int4
        return f"klotski-engine-ops/{self.VERSION}/{h.hexdigest()[:16]}/hqq-{hqq}" + ("" if int4.available() else "/no-int4")

    def __call__(self, shape, dtype, device) -> "LayerOps":
        return LayerOps(shape, dtype, device)


class LayerOps:
    """Random weights of one layer of `shape`'s family on `device`, and closures running each op
    exactly as the pipeline does: the family's attention block over a BatchKV (norm, RoPE,
    GQA expansion, scores chunked at ATTENTION_SCORE_CHUNK), its router and shared expert,
    SwiGLU experts in PREFILL_EXPERT_CHUNK pieces, a wave of experts in one grouped call, the LM head, and HQQ dequantization of one
    expert as the quantized cache decodes it. Per-step work (RoPE tables, masks) is prepared
    outside the timed closures, as the pipeline does it once per step, not per layer.

    Each closure cycles through copies of its weights and inputs, COLD_BYTES of them in all:
    a step reads every weight (and KV block) once, long after the last step evicted it from
    the caches, while an op timed over the same weight again and again would read it warm
    and come out too fast."""

    COLD_BYTES = 256 << 20  # above any CPU's last-level cache and an H100's 50 MB L2
    MAX_COPIES = 16

    def __init__(self, shape, dtype, device):
        import torch

        from klotski.models.spec import FAMILIES, ModelSpec, rope_frequencies
        self.torch, self.dtype, self.device = torch, dtype, torch.device(device)
        family = FAMILIES[shape.model_type]
        inv_freq, scaling = rope_frequencies({}, shape.head_dim)
        self.packed = shape.expert_format  # MXFP4 experts are timed decoded, their decoding apart
        self.spec = ModelSpec(shape=dataclasses.replace(shape, expert_format=""), dtype=dtype, rms_norm_eps=1e-5,
                              max_position_embeddings=1 << 20, rope_inv_freq=inv_freq,
                              rope_attention_scaling=scaling, **family.options({}))
        self.M = family
        moe = shape.first_moe_layer  # a MoE layer's gate, not a dense layer's MLP
        # a full-attention layer's weights (a hybrid's first layers are linear attention, not timed here)
        attn = next((j for j in range(shape.num_layers) if not shape.is_linear(j)), 0)
        self.attn, self.gate_w, self.expert_w = (self._copies(k) for k in (("attn", attn), ("gate", moe),
                                                                           ("expert", moe, 0)))
        self._head = None
        self._packed = None
        self._blocks = None
        from klotski.compress.ggml import format_types
        self.gguf = format_types(self.packed)  # GGUF experts: each matrix's block type
        if not set(self.gguf) <= set(self.expert_w[0]):
            # a family whose experts GGUF lays out otherwise (gpt-oss: gate and up joined after
            # decoding) is timed on its dense experts: the per-use decode is not priced for it
            self.gguf = {}
        if self.gguf:
            self._hold_gguf()

    def _hold_gguf(self) -> None:
        """GGUF experts as the codec holds them for compute: random blocks of each matrix's type
        (its scales small and finite); on a CPU in 16 bits, the 4-bit ones as int4 codes
        (compress/int4.py), so `expert` and `wave` time the kernel the engine runs and `dequant`
        the per-use decode that remains (the kernel's scales and zeros, or the whole blocks)."""
        from klotski.compress import ggml
        from klotski.models.int4 import SCALES
        torch, gen = self.torch, self.torch.Generator().manual_seed(0)
        self._blocks = {}
        for name, qtype in self.gguf.items():
            if qtype in ggml.FLOAT_TYPES:  # read in the compute dtype: nothing to decode
                continue
            rows, cols = self.expert_w[0][name].shape
            _, block, size = ggml.BY_NAME[qtype]
            raw = torch.randint(0, 256, (rows * cols // block, size), dtype=torch.uint8, generator=gen)
            for at, kind in ggml.scale_bytes(qtype):
                if kind == "f16":
                    raw[:, at:at + 2] = torch.full((len(raw), 1), 0.01, dtype=torch.float16).view(torch.uint8)
                else:
                    raw[:, at] = 120
            self._blocks[name] = raw.reshape(rows, -1)
        held = {n for n in self._blocks
                if self.device.type == "cpu" and ggml.int4_applies(self.gguf[n], self.dtype, self.expert_w[0][n].shape[0])}
        if held:
            forms = {n: ggml.int4_from_blocks(self._blocks[n], self.gguf[n]) for n in held}
            self._blocks.update({n: forms[n][1] for n in held})
            for w in self.expert_w:  # a copy of the codes each, cycled through as the dense copies were
                for n in held:
                    codes, meta = forms[n]
                    w[n], w[n + SCALES] = codes.clone(), ggml.int4_scales_zeros(meta, self.gguf[n], self.dtype)
        self._held = held

    def _copies(self, key) -> list[dict]:
        """Copies of the group `key`, its projections held as a CPU run in bf16 holds them
        (reordered for oneDNN: models/prepacked.py, assemble.reordering)."""
        from klotski.models import prepacked
        first = self._weights(key)
        copies = [first] + [self._weights(key) for _ in range(self._count(_nbytes(first)) - 1)]
        if prepacked.applies(self.device.type, self.dtype):
            copies = [prepacked.reorder_linear(self.M.LINEAR_WEIGHTS, key[0], w) for w in copies]
        return copies

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
        from klotski.execute.kvcache import BatchKV
        from klotski.models import layers as L
        from planner.workingset import ATTENTION_SCORE_CHUNK
        past = ctx - new
        heads, key_dim, value_dim = s.shape.kv_cache_dims
        # masks and RoPE tables are built on the host and moved, as the pipeline does
        mask = L.attention_mask(torch.ones(bs, ctx, dtype=torch.bool), new, s.shape.sliding_window).to(self.device)
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
            h = self._x(bs, new, s.shape.hidden_size)
            runs.append(lambda h=h, w=w, kv=kv: self.M.attention_block(
                h, w, cos, sin, mask, lambda k, v: kv.write(0, k, v), s, max_scores=ATTENTION_SCORE_CHUNK))
        return self._cycle(runs)

    def attend(self, bs: int, ctx: int, new: int):
        """The attention core alone (what host attention runs beside a host KV cache)."""
        from klotski.models import layers as L
        s, torch = self.spec, self.torch
        heads, key_dim, _ = s.shape.kv_cache_dims
        mask = L.attention_mask(torch.ones(bs, ctx, dtype=torch.bool), new, None).to(self.device)
        runs = []
        for _ in range(self._count(2 * bs * heads * ctx * key_dim * self.dtype.itemsize)):
            q = self._x(bs, s.shape.num_heads, new, key_dim)
            keys, values = self._x(bs, heads, ctx, key_dim), self._x(bs, heads, ctx, key_dim)
            runs.append(lambda q=q, keys=keys, values=values: L.attend(q, keys, values, mask))
        return self._cycle(runs)

    def gate(self, n: int):
        from klotski.models import layers as L
        s = self.spec
        h = self._x(n, s.shape.hidden_size)

        def run(g):
            x = L.rms_norm(h, g["post_norm"], s.rms_norm_eps)
            return self.M.route(x, g, s), self.M.shared_ffn(x, g, s)
        return self._cycle([functools.partial(run, g) for g in self.gate_w])

    def expert(self, n: int):
        from klotski.execute.experts import run_expert
        x, ffn = self._x(n, self.spec.shape.hidden_size), self.M.bind_expert_ffn(self.spec)
        return self._cycle([lambda w=w: run_expert(ffn, x, w) for w in self.expert_w])

    def wave(self, groups: int, pairs: int, spread: bool = True):
        """One wave as `LayerExperts.run_wave` computes it: the family's grouped expert FFN over
        a stack of `groups` experts (stacked as the cache stacks a layer's resident experts and
        the pool holds the landed ones), `pairs` rows spread evenly over them (or, not `spread`,
        all in the first: the others empty groups, as a resident wave's calls pass the whole
        stack), in one call (the profile keeps `pairs` within a call's PREFILL_EXPERT_CHUNK).
        Cycles through copies of the stack, so its weights are read cold. Where the engine runs
        a whole wave at once (grouped.wave_runner: fp32 SwiGLU experts on a CPU), that is timed,
        gathering its rows and writing its weighted outputs as the engine's does."""
        import numpy as np

        from klotski.models.grouped import Groups, stack_form, wave_runner
        torch, experts = self.torch, self.expert_w
        ffn = self.M.bind_grouped_expert_ffn(self.spec)
        held = _held_form(stack_form(ffn, self.device.type, self.dtype), experts)
        stacks = [_stacked([held[(c * groups + g) % len(held)] for g in range(groups)])
                  for c in range(self._count(groups * _nbytes(experts[0])))]
        rows = [pairs // groups + (g < pairs % groups) for g in range(groups)] if spread else \
            [pairs] + [0] * (groups - 1)
        ends = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
        x = self._x(pairs, self.spec.shape.hidden_size)
        runners = [wave_runner(ffn, x, w) for w in stacks]
        if all(r is not None for r in runners):
            counts, pick = np.asarray(rows), torch.arange(pairs, device=x.device)
            weights, out = torch.ones(pairs, device=x.device, dtype=x.dtype), torch.empty_like(x)
            return self._cycle([lambda run=run: run(x, counts, [(0, pairs)], pick, pick, weights, out)
                                for run in runners])
        return self._cycle([lambda w=w: ffn(x, w, Groups(rows, ends)) for w in stacks])

    def kernels(self, bs: int = 4, ctx: int = 64) -> dict[str, float]:
        """ATen ops (views excluded) of one call of each piece of the model's own math as the
        pipeline calls it: exactly the family hooks klotski/measure/overhead.py stubs out, so
        its counted launches and these add up to a layer's ops. `attention`: one batch's
        attention block at decode (bs rows over ctx slots); `router`: a group's routing;
        `shared`: one batch's shared expert (0 without one); `wave`: one grouped expert call
        over one expert's rows; `wave_group`: each further expert in that call (0 where the
        grouped kernel runs, a product each in its fallback). Counted on the profile's device
        and dtype, once."""
        from klotski.models import layers as L
        from klotski.models.grouped import Groups, stack_form
        from klotski.measure.opcounter import OpCounter
        s, torch = self.spec, self.torch

        def count(fn) -> float:
            fn()  # a first call may set things up (a probe of the grouped kernel)
            with OpCounter() as ops:
                fn()
            return float(ops.kernels)
        g = self.gate_w[0]
        x = L.rms_norm(self._x(8, s.shape.hidden_size), g["post_norm"], s.rms_norm_eps)
        ffn, w = self.M.bind_grouped_expert_ffn(s), self.expert_w[0]

        def wave(groups: int) -> float:
            # one expert's weights as each group's, stacked as the cache stacks them: views of
            # one copy could fail a grouped kernel the stacks run, and a failure marks the
            # kernel unsupported for the engine that runs next (models/grouped.py)
            ws = _stacked(_held_form(stack_form(ffn, self.device.type, self.dtype), [w]) * groups)
            rows = [len(x) // groups] * groups
            ends = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
            return count(lambda: ffn(x, ws, Groups(rows, ends)))
        one = wave(1)
        return {"attention": count(self.attention(bs, ctx, 1)), "router": count(lambda: self.M.route(x, g, s)),
                "shared": count(lambda: self.M.shared_ffn(x, g, s)), "wave": one, "wave_group": max(0.0, wave(2) - one)}

    def head(self, n: int):
        from klotski.models import layers as L
        if self._head is None:
            self._head = self._copies(("head",))
        x = self._x(n, self.spec.shape.hidden_size)
        return self._cycle([lambda w=w: L.logits(x, w["norm"], w["lm_head"], self.spec.rms_norm_eps)
                            for w in self._head])

    def dequant(self):
        if self.gguf:  # what GgufCodec.decode does per use, for one expert
            from klotski.compress import ggml
            blocks = {n: t.to(self.device) for n, t in self._blocks.items()}
            return lambda: {n: ggml.int4_scales_zeros(b, self.gguf[n], self.dtype) if n in self._held
                            else ggml.dequantize(b, self.gguf[n], self.dtype) for n, b in blocks.items()}
        if self.packed == "mxfp4":
            from klotski.compress import mxfp4
            parts = {f"{m}_{p}": t.to(self.device) for m in mxfp4.MATRICES
                     for p, t in zip(("blocks", "scales"), mxfp4.quantize(self.expert_w[0][m].t().float().cpu()))}
            return lambda: {m: mxfp4.dequantize(parts[f"{m}_blocks"], parts[f"{m}_scales"], self.dtype)
                            for m in mxfp4.MATRICES}
        from klotski.compress import hqq as quant
        if self._packed is None:  # quantized once per profile, not once per round
            self._packed = quant.quantize_group(self.expert_w[0], quant.QuantSpec())  # on the device, where it is decoded
        parts = self._packed
        return lambda: quant.dequantize_group(parts, self.dtype)


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _held_form(form, experts: list[dict]) -> list[dict]:
    """Experts as a CPU's resident stack holds them: in `form` (models/prepacked.py) where it
    takes them, else as they are."""
    return [form.pack_expert(w) for w in experts] if form is not None and form.packs(experts[0]) else experts


def _stacked(experts: list[dict]) -> dict:
    """Experts stacked as placement.cache.ExpertStack holds them: a tensor per weight name, or a
    list of rows where they are held in a form of one matrix an expert (not stackable)."""
    import torch
    return {n: torch.stack([w[n] for w in experts]) if experts[0][n].layout == torch.strided
            else [w[n] for w in experts] for n in experts[0]}
