"""Op times and byte sizes for one model on one machine.

Every time is a roofline, max(FLOPs / effective FLOP/s, bytes / effective memory B/s),
plus a fixed per-call overhead (kernel launches, Python dispatch). When the profile was
measured on this very model shape, the roofline is multiplied by a correction factor
interpolated from the measurements (inverse-distance in log space), so the model is exact
at measured points and scales like the roofline between and beyond them. Built-in hardware
profiles have no measurements: pure roofline from published peaks × stated efficiencies.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.routing import marginals_from_sample, marginals_from_weights
from planner.shapes import as_shape

LINKS = ("disk_to_host", "host_to_device", "device_to_host")
# The terms runs refit (planner/calibrate.py): an op kind's term, the pipeline's own cost, a link.
TERM_OF = {"attend": "attention", "project": "attention"}


def hqq_bytes(params: int, bits: int = 4, group: int = 64, meta_group: int = 128, meta_bits: int = 8) -> int:
    """Bytes of an HQQ-quantized weight: `bits` per weight; one scale and one zero per
    `group` weights, themselves quantized to `meta_bits` in groups of `meta_group` with an
    fp32 scale and zero per meta-group (HQQ's quant_scale/quant_zero)."""
    groups = math.ceil(params / group)
    meta_groups = math.ceil(groups / meta_group)
    return math.ceil(params * bits / 8) + 2 * math.ceil(groups * meta_bits / 8) + 2 * meta_groups * 2 * 4


def popularity_marginals(num_experts: int, top_k: int, popularity=None) -> list[float]:
    """Per-token selection probability per expert (sums to top_k) from: None (uniform),
    marginals (already summing to top_k), first-choice weights (summing to 1), or a routing
    sample (one collection of expert ids per token)."""
    if popularity is None:
        return [min(1.0, top_k / num_experts)] * num_experts
    pop = list(popularity)
    if pop and not isinstance(pop[0], (int, float)):
        return marginals_from_sample(pop, num_experts)
    if len(pop) != num_experts:
        raise ValueError(f"popularity has {len(pop)} entries for {num_experts} experts")
    total = sum(pop)
    if top_k > 1 and abs(total - top_k) < 1e-6 * top_k:
        return [float(x) for x in pop]
    return marginals_from_weights([x / total for x in pop], top_k)


def expected_distinct_experts(tokens: float, num_experts: int, top_k: int, popularity=None) -> float:
    """Expected number of experts chosen at least once by `tokens` tokens. Uniform:
    E·(1−(1−k/E)^tokens); in general Σ_e 1−(1−m_e)^tokens with m_e the per-token marginal
    (tokens choose independently; within one token the choices are distinct)."""
    if tokens <= 0:
        return 0.0
    m = popularity_marginals(num_experts, top_k, popularity)
    return sum(1.0 - (1.0 - min(1.0, x)) ** tokens for x in m)


@dataclass(frozen=True)
class GroupBytes:
    """Bytes of one copy of each tensor-group kind as it sits in a tier and crosses a link
    (packed when quantized), and the dequantized copy a quantized group is expanded into per
    use (0 otherwise). The engine measures these on its checkpoint, so the planner places
    exactly what the engine reserves; without one they follow from the shape."""
    attention: int   # input norm + q, k, v, o
    gate: int        # post-attention norm + router
    expert: int
    head: int        # final norm + LM head (a tied head is still a copy of its own on the device)
    embed: int       # the embedding table, gathered from on the host
    attention_decoded: int = 0
    expert_decoded: int = 0
    expert_workspace: int = 0  # temporaries while one expert decodes (MXFP4, GGUF, HQQ), held for the call only
    attention_workspace: int = 0  # temporaries while a quantized attention group decodes (HQQ)


class CostModel:
    """t_attn, t_gate, t_expert, t_io and byte sizes of tensor groups for (profile, shape)."""

    def __init__(self, profile, shape, *, quant_bits: int | None = None, sizes: GroupBytes | None = None):
        self.profile = profile
        self.shape = s = as_shape(shape)
        self.quant_bits = quant_bits
        b = s.dtype_bytes
        self._q, kv = s.attention_widths
        self._kv = kv // 2
        if sizes is None:
            # Experts and attention projections are what HQQ quantizes (the paper's preset);
            # norms, gates and embeddings stay in dtype.
            # MXFP4 experts (gpt-oss) stay packed as shipped and decode per use, like HQQ's.
            quant, mx = quant_bits is not None, s.expert_format == "mxfp4"
            sizes = GroupBytes(
                attention=self._qbytes(s.attention_params - s.hidden_size) + s.hidden_size * b,
                gate=s.gate_params * b, expert=s.expert_nbytes() if mx or not quant else self._qbytes(s.expert_params),
                head=(s.vocab_size + 1) * s.hidden_size * b, embed=s.vocab_size * s.hidden_size * b,
                attention_decoded=s.attention_params * b if quant else 0,
                expert_decoded=(s.expert_params + s.expert_bias_params) * b if quant or mx else 0)
        self.sizes = sizes
        self.attention_bytes, self.gate_bytes, self.expert_bytes = sizes.attention, sizes.gate, sizes.expert
        self.head_bytes, self.embed_bytes = sizes.head, sizes.embed
        self.attention_decoded, self.expert_decoded = sizes.attention_decoded, sizes.expert_decoded
        self.expert_workspace, self.attention_workspace = sizes.expert_workspace, sizes.attention_workspace
        # MLA: the latent and rotary key only; a hybrid: its full-attention layers' keys and values
        # spread over every layer (the linear layers keep none), so x num_layers is the whole cache
        hybrid = bool(getattr(s, "linear_layers", ()))
        self.kv_bytes_per_token_layer = s.kv_width * b * s.attention_layers / s.num_layers if hybrid else s.kv_width * b
        # a hybrid's recurrent state per sequence, counted as this many more positions of every
        # sequence (a constant: it does not grow with the text); 0 for every other model
        state = s.recurrent_bytes_per_sequence(b) if hybrid else 0
        self.state_positions = state / (self.kv_bytes_per_token_layer * s.num_layers) if state else 0
        measured_here = getattr(profile, "shape_key", None) == s.key()
        self._samples = profile.samples if measured_here else {}
        # what runs on this machine taught (planner/calibrate.py): a factor per term, 1 where none
        self.factors = (getattr(profile, "calibration", None) or {}).get("factors", {}) if measured_here else {}

    # ---- sizes --------------------------------------------------------------------------
    def _qbytes(self, params: int) -> int:
        if self.quant_bits is None:
            return params * self.shape.dtype_bytes
        return hqq_bytes(params, self.quant_bits)

    def layer_bytes(self) -> int:
        return self.attention_bytes + self.gate_bytes + self.shape.num_experts * self.expert_bytes

    def weights_bytes(self) -> int:
        return self.shape.num_layers * self.layer_bytes() + self.embed_bytes + self.head_bytes

    def kv_bytes(self, tokens: float, layers: int | None = None) -> float:
        """KV cache of `tokens` token positions over `layers` layers (default all)."""
        return tokens * self.kv_bytes_per_token_layer * (self.shape.num_layers if layers is None else layers)

    def kv_context(self, ctx: int) -> int:
        """Positions kept and read per sequence: all of them (a sliding window is a mask over
        the whole cache in the engine, which keeps every slot), and a hybrid's recurrent state as
        the constant number of positions its bytes make (`state_positions`)."""
        return ctx + self.state_positions if self.state_positions else ctx

    def kv_loaded(self, bs: int, ctx: int, new_tokens: int = 1) -> float:
        """Bytes of one batch's KV prefix a step loads for one layer, its cache on the host:
        a decode step reads every old slot; a prefill pass over a prompt of `ctx` tokens in
        chunks of `new_tokens` reads the chunks before it, (passes − 1)·chunk/2 slots on
        average (none for a prompt in one pass)."""
        if new_tokens == 1:
            return self.kv_bytes(bs * self.kv_context(ctx), 1)
        prefix = (math.ceil(ctx / new_tokens) - 1) * new_tokens / 2
        return self.kv_bytes(bs * prefix, 1)

    # ---- compute ------------------------------------------------------------------------
    def work(self, kind: str, point: Sequence[float]) -> tuple[float, float]:
        """(FLOPs, bytes touched) of one call of op `kind` at `point`:
        attention (bs, ctx, new_tokens), gate/expert/head (tokens,), dequant (params,)."""
        s, b = self.shape, self.shape.dtype_bytes
        if kind == "attend":  # the core alone: scores and weighted values over the cached keys
            bs, ctx, new = point
            keys, toks = self.kv_context(int(ctx)), bs * new
            scored = keys - (new - 1) / 2 if new > 1 else keys
            return 4 * toks * scored * self._q, bs * keys * self.kv_bytes_per_token_layer + 2 * toks * self._q * b
        if kind == "project":  # an attention layer without its core: norms, q/k/v/o, rotary
            bs, new = point
            toks = bs * new
            return (2 * toks * s.hidden_size * (2 * self._q + 2 * self._kv),
                    s.attention_params * b + 4 * toks * s.hidden_size * b)
        if kind == "attention":
            bs, ctx, new = point
            keys, toks = self.kv_context(int(ctx)), bs * new
            # Causal prefill kernels skip the masked half of the score matrix.
            scored = keys - (new - 1) / 2 if new > 1 else keys
            flops = 2 * toks * s.hidden_size * (2 * self._q + 2 * self._kv) + 4 * toks * scored * self._q
            return flops, (s.attention_params * b + bs * keys * self.kv_bytes_per_token_layer
                           + 4 * toks * s.hidden_size * b)
        (n,) = point
        if kind == "gate":  # the router, and a shared expert where the family has one
            return (2 * n * s.hidden_size * (s.num_experts + 3 * s.shared_intermediate_size),
                    s.gate_params * b + n * (s.hidden_size + 3 * s.shared_intermediate_size) * b)
        if kind == "expert":
            return (6 * n * s.hidden_size * s.intermediate_size,
                    s.expert_params * b + n * (2 * s.hidden_size + 3 * s.intermediate_size) * b)
        if kind == "head":
            return 2 * n * s.hidden_size * s.vocab_size, s.vocab_size * s.hidden_size * b + n * s.vocab_size * 4
        if kind == "dequant":
            # Unpack, subtract zero, multiply scale: a few FLOPs per weight; read q, write dtype.
            return 4 * n, hqq_bytes(int(n), self.quant_bits or 4) + n * b
        raise KeyError(kind)

    def t_attn(self, bs: int, ctx: int, new_tokens: int = 1) -> float:
        """One attention layer for one batch: q/k/v/o projections, rotary, softmax attention
        of `new_tokens` queries per sequence over `ctx` positions (decode: 1; prefill: ctx)."""
        return self.t_op("attention", (bs, self.kv_context(ctx), new_tokens))

    def t_attn_proj(self, bs: int, new_tokens: int = 1) -> float:
        """One attention layer for one batch whose core runs elsewhere (on the host, next to
        its KV): the projections, rotary and norms on the device. Measured profiles time
        whole layers only, so this is the roofline (and the profile's 'project' overhead)."""
        return self.t_op("project", (bs, new_tokens))

    def t_host_attend(self, bs: int, ctx: int, new_tokens: int = 1) -> float:
        """The attention core of one batch computed by the host over its host-resident KV,
        with the link time of its inputs down and its output up."""
        moved = self.attend_link_bytes(bs, ctx, new_tokens)["host"]
        return (self.t_host("attend", (bs, self.kv_context(ctx), new_tokens))
                + sum(self.t_io(nb, link) for link, nb in moved.items()))

    def t_host_expert(self, tokens: float) -> float:
        """One host-resident expert computed on the host: its tokens down, outputs up."""
        if tokens <= 0:
            return 0.0
        acts = tokens * self.shape.hidden_size * self.shape.dtype_bytes
        return self.t_host("expert", (max(1.0, tokens),)) + self.t_io(acts, "device_to_host") + self.t_io(acts)

    def t_gate(self, tokens: int) -> float:
        """Router for `tokens` tokens: linear, softmax, top-k."""
        return self.t_op("gate", (max(1, tokens),))

    def t_expert(self, tokens: float) -> float:
        """One expert FFN over `tokens` tokens; 0 for none (the expert is not run)."""
        return 0.0 if tokens <= 0 else self.t_op("expert", (max(1.0, tokens),))

    # ---- waves: many experts in one grouped call, as the engine computes them -----------
    def t_wave(self, experts: float, pairs: float, calls: float = 1.0) -> float:
        """A wave of `experts` experts sharing `pairs` (token, slot) pairs evenly, in `calls`
        grouped calls: each call's fixed part, then each expert's part (`t_wave_expert`)."""
        if experts <= 0 or pairs <= 0:
            return 0.0
        return calls * self.t_wave_call() + experts * self.t_wave_expert(pairs / experts)

    def t_wave_call(self) -> float:
        """The fixed part of one grouped expert call (its kernels' launches and dispatch), paid
        once a call whatever its experts. Measured: the intercept of the timed waves over 1 and
        over several experts at equal pairs an expert. Inferred where the profile timed no wave
        (a built-in profile, one measured before PROFILE_VERSION 10 or at other shapes): the
        `wave` overhead if it states one, else a single expert call's fixed cost (the `expert`
        overhead: the grouped call launches the kernels one expert's call does)."""
        fit = self._wave_fit()
        o = self.profile.overhead_s
        call = fit[0] if fit is not None else float(o.get("wave", o.get("expert", 0.0)))
        return call * self.factors.get("expert", 1.0)  # a run's expert phase corrects its waves whole

    def t_wave_expert(self, pairs: float) -> float:
        """What one expert with `pairs` pairs adds to a wave: its share of the grouped kernel
        (per-group work: on a CPU the kernel loops over groups) and its pairs' FLOPs and weight
        bytes. Measured: the timed waves' per-expert part relative to the single-expert op
        (`t_expert`) at the same pairs, interpolated in log pairs and scaled by `t_expert`
        beyond. Inferred without them: `t_expert` less the call's fixed part (where the profile
        states a `wave_group` overhead: less the `expert` overhead, plus that)."""
        if pairs <= 0:
            return 0.0
        fit = self._wave_fit()
        if fit is None:
            o = self.profile.overhead_s
            if "wave_group" in o:
                return max(0.0, self.t_expert(pairs) - o.get("expert", 0.0)) + o["wave_group"]
            return max(0.0, self.t_expert(pairs) - self.t_wave_call())
        f = self.factors.get("expert", 1.0)  # the fit's parts are as measured: scaled like t_expert
        ratios = sorted((n, f * per / max(self.t_expert(n), 1e-12)) for n, per in fit[1].items())
        at = math.log(max(1.0, pairs))
        lo = max((r for r in ratios if math.log(r[0]) <= at), default=ratios[0])
        hi = min((r for r in ratios if math.log(r[0]) >= at), default=ratios[-1])
        if hi[0] == lo[0]:
            ratio = lo[1]
        else:
            ratio = lo[1] + (hi[1] - lo[1]) * (at - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
        return self.t_expert(pairs) * ratio

    def t_wave_slot(self) -> float:
        """What an empty group costs a grouped call (a resident wave's every call passes the
        layer's whole stack, most of it empty in a decode's call): on a CPU the kernel still
        visits it. Measured: a wave over g experts with every pair in the first, less the wave
        of one at those pairs, over g − 1, held within 0 and an expert's part at one pair.
        Inferred without that sample: 0 (a GPU's grouped kernel skips an empty group)."""
        rows = self._samples.get("wave_empty") or []
        single = {p: t for g, p, t in self._samples.get("wave") or [] if g == 1}
        slots = [(t - single[p]) / (g - 1) for g, p, t in rows if g > 1 and p in single]
        return min(max(0.0, slots[0]) * self.factors.get("expert", 1.0), self.t_wave_expert(1)) if slots else 0.0

    def _wave_fit(self) -> tuple[float, dict[float, float]] | None:
        """(the call's fixed part, {pairs an expert: one expert's part}) from the profile's timed
        waves at this shape, or None. At each pairs an expert, waves over 1 and over g experts
        give the intercept (g·t₁ − t_g)/(g − 1); the median is the call's part, held between 0
        and the fastest single-expert wave timed (noise where the weights' bytes dwarf it; a
        disturbance only adds time, so the fastest is never one). A wave OUTLIER times off the
        median ratio of the waves to their experts' `t_expert` was disturbed, not measured, and
        is left out."""
        if "_wave" not in self.__dict__:
            timed = self._samples.get("wave") or []
            fastest = min((t for g, _, t in timed if g == 1), default=math.inf)
            rows = [(g, p, t / (g * max(self.t_expert(p / g), 1e-12)), t) for g, p, t in timed]
            median = sorted(r for _, _, r, _ in rows)[len(rows) // 2] if rows else 0.0
            rows = [(g, p, t) for g, p, r, t in rows if median / OUTLIER <= r <= median * OUTLIER]
            single = {p: t for g, p, t in rows if g == 1}
            many = {p / g: (g, t) for g, p, t in rows if g > 1}
            fits = [(g * single[n] - t) / (g - 1) for n, (g, t) in many.items() if n in single]
            if not fits:
                self._wave = None
            else:
                call = max(0.0, min(sorted(fits)[len(fits) // 2], fastest))
                self._wave = (call, {n: max(0.0, t - call) / g for n, (g, t) in many.items()})
        return self._wave

    def t_pipeline(self, batch_layers: float = 0, expert_calls: float = 0, transfers: float = 0,
                   steps: float = 0, kv_layers: float = 0, tokens: float = 0) -> float:
        """What the engine's pipeline adds around the ops (routing bookkeeping, gathers, the
        residency cache, submitting and awaiting transfers), per batch-layer, expert call,
        transfer, step, batch-layer whose KV cache comes from the host and token-layer beyond
        one a row (`tokens`: a prefill's), as a measured profile records it (`overhead_s`;
        klotski/measure/overhead.py), each term at least its counted launches times the
        device's per-launch cost. Noise on a big model, most of a step on a tiny one; 0 where
        the profile has none."""
        o, n, launch = self.profile.overhead_s, self.profile.launches, self.profile.launch_s

        def term(kind: str, ops: float | None = None) -> float:  # never below the ops it launches (a GPU waits on them)
            return max(o.get(kind, 0.0), (n.get(kind, 0.0) if ops is None else ops) * launch)
        # a step's seconds hold its layers' own work too; its ops are counted apart (`layer`)
        step_ops = n.get("step", 0.0) + self.shape.num_layers * n.get("layer", 0.0)
        return (batch_layers * term("batch_layer") + expert_calls * term("expert_call")
                + transfers * term("transfer") + steps * term("step", step_ops)
                + kv_layers * term("kv_layer") + tokens * term("token")) * self.factors.get("pipeline", 1.0)

    def launches(self, batch_layers: float = 0, expert_calls: float = 0, steps: float = 0, transfers: float = 0,
                 kv_layers: float = 0, layers: float = 0) -> float:
        """Ops the pipeline launches around the timed ones (the profile's counts), e.g. per step:
        per batch-layer, expert call, step, transfer, batch-layer whose KV comes from the host,
        and layer (what one issues whatever its batches and experts)."""
        n = self.profile.launches
        return (batch_layers * n.get("batch_layer", 0.0) + expert_calls * n.get("expert_call", 0.0)
                + steps * n.get("step", 0.0) + transfers * n.get("transfer", 0.0)
                + kv_layers * n.get("kv_layer", 0.0) + layers * n.get("layer", 0.0))

    def t_head(self, tokens: int) -> float:
        """Final norm + LM head logits for `tokens` tokens (one per sequence per step)."""
        return self.t_op("head", (max(1, tokens),))

    def t_dequant(self, kind: str) -> float:
        """Dequantizing one group ('attention' or 'expert') before use; HQQ weights stay
        quantized wherever they live, so this is paid at every use, resident or not."""
        s = self.shape
        if self.quant_bits is None and not (kind == "expert" and s.expert_format):  # MXFP4, GGUF blocks
            return 0.0
        return self.t_op("dequant", (s.expert_params if kind == "expert" else s.attention_params,))

    # ---- host compute: attention where the KV lives, experts where they live ------------
    def t_host(self, kind: str, point: Sequence[float]) -> float:
        """One call of op `kind` (see `work`) computed by the host CPU next to host RAM. On a
        CPU-only machine the host is the device (same cores, same measured samples); a
        profile without host rates gets infinity, so host compute is never chosen."""
        if self.profile.device == "cpu":
            return self.t_op(kind, point)
        host_flops, host_bw = getattr(self.profile, "host_flops", 0.0), getattr(self.profile, "host_mem_bw", 0.0)
        if not host_flops or not host_bw:
            return math.inf
        flops, byts = self.work(kind, point)
        return max(flops / host_flops, byts / host_bw) + self.profile.overhead_s.get(kind, 0.0)

    def attend_link_bytes(self, bs: int, ctx: int, new_tokens: int = 1) -> dict[str, float]:
        """Link bytes of one batch's attention core whose KV is on the host, each way, for
        "device" (the KV prefix comes up; the new keys/values go down) and "host" (q, k, v
        of the new tokens go down; the output comes up)."""
        b, toks = self.shape.dtype_bytes, bs * new_tokens
        new_kv = toks * self.kv_bytes_per_token_layer
        return {"device": {"host_to_device": self.kv_bytes(bs * self.kv_context(ctx), 1), "device_to_host": new_kv},
                "host": {"host_to_device": toks * self._q * b, "device_to_host": toks * self._q * b + new_kv}}

    def attention_on_host(self, bs: int, ctx: int, new_tokens: int = 1) -> bool:
        """Whether one batch's attention core, with its KV on the host, finishes sooner
        computed there than with the KV prefix moved up: link time plus compute on each side."""
        point = (bs, self.kv_context(ctx), new_tokens)
        moved = self.attend_link_bytes(bs, ctx, new_tokens)
        t = {where: sum(self.t_io(n, link) for link, n in moved[where].items()) for where in moved}
        return t["host"] + self.t_host("attend", point) < t["device"] + self.t_op("attend", point)

    def expert_on_host(self, tokens: float, tier: str = "host") -> bool:
        """Whether one expert that is not on the device, with `tokens` tokens this step,
        finishes sooner computed where it lives (the tokens go down, the outputs come up)
        than moved to the device and computed there (Fiddler's choice)."""
        if tier == "device" or tokens <= 0:
            return False
        acts = tokens * self.shape.hidden_size * self.shape.dtype_bytes
        host = self.t_host("expert", (max(1.0, tokens),)) + self.t_io(acts, "device_to_host") + self.t_io(acts)
        if tier == "disk":  # staged to host RAM either way; the window runs ahead of compute
            host = max(host, self.t_io(self.expert_bytes, "disk_to_host"))
        return host < self.t_fetch(self.expert_bytes, tier) + self.t_expert(tokens)

    # ---- transfers ----------------------------------------------------------------------
    def bandwidth(self, link: str) -> float:
        if link not in LINKS:
            raise ValueError(f"link {link!r} is not one of {LINKS}")
        return float(self.profile.links[link])

    def t_io(self, nbytes: float, link: str = "host_to_device") -> float:
        if nbytes <= 0:
            return 0.0
        return ((nbytes / self.bandwidth(link) + float(getattr(self.profile, "link_latency_s", 0.0)))
                * self.factors.get(link, 1.0))

    def t_copy(self, nbytes: float) -> float:
        """Compute time a host->device copy takes from the model's own work: on a CPU-only
        machine the "device" is the same RAM and cores, so every copy (the engine clones a
        host-tier group into the device budget) is memory traffic the compute shares, whether
        or not a link is emulated on top; on a GPU the DMA engine does it (0)."""
        if getattr(self.profile, "device", "cuda") != "cpu" or nbytes <= 0:
            return 0.0
        machine = getattr(self.profile, "machine", {}) or {}
        return nbytes / float(machine.get("measured_host_to_device") or self.profile.links["host_to_device"])

    def t_fetch(self, nbytes: float, tier: str) -> float:
        """Bringing a group to the device from `tier`. Disk-resident groups are staged through
        host by a sliding window that runs ahead, so in steady state the slower link sets
        the pace rather than the sum of both."""
        if tier == "device" or nbytes <= 0:
            return 0.0
        h2d = self.t_io(nbytes, "host_to_device")
        return h2d if tier == "host" else max(h2d, self.t_io(nbytes, "disk_to_host"))

    # ---- roofline + measured correction -------------------------------------------------
    def roofline(self, kind: str, point: Sequence[float]) -> float:
        flops, byts = self.work(kind, point)
        return max(flops / self.profile.flops, byts / self.profile.mem_bw)

    def t_op(self, kind: str, point: Sequence[float]) -> float:
        """One call of op `kind` (see `work`) at `point` on the device: its roofline scaled by
        the profile's samples measured nearest (`_correction`), or plus the profile's fixed
        overhead for the kind where it measured none."""
        base = self.roofline(kind, point)
        samples = self._samples.get(kind)
        factor = self.factors.get(TERM_OF.get(kind, kind), 1.0)
        if not samples:
            return (base + self.profile.overhead_s.get(kind, 0.0)) * factor
        return base * self._correction(kind, samples, point) * factor

    def _correction(self, kind: str, samples, point) -> float:
        """Measured/roofline ratio near `point`: the 4 nearest samples of the same mode
        (decode and prefill attention behave differently), weighted 1/d² in log space."""
        cache = self.__dict__.setdefault("_corr_cache", {})
        if kind not in cache:
            rows = [(self._mode(kind, row[:-1]), [math.log(max(x, 1e-9)) for x in row[:-1]],
                     row[-1] / max(self.roofline(kind, row[:-1]), 1e-12)) for row in samples]
            cache[kind] = [r for r in rows if not _outlier(r, rows)]
        mode = self._mode(kind, point)
        logp = [math.log(max(x, 1e-9)) for x in point]
        near = sorted((sum((a - c) ** 2 for a, c in zip(pt, logp)), r)
                      for m, pt, r in cache[kind] if m == mode)[:4]
        if not near:
            return 1.0
        if near[0][0] < 1e-12:
            return near[0][1]
        wsum = sum(1 / d for d, _ in near)
        return math.exp(sum(math.log(r) / d for d, r in near) / wsum)

    @staticmethod
    def _mode(kind, point) -> int:
        return int(kind == "attention" and point[2] > 1)


OUTLIER = 10.0  # a sample this many times off its kind's median ratio was disturbed, not measured


def _outlier(row, rows) -> bool:
    """A sample whose measured/roofline ratio is OUTLIER times off the median of its kind and
    mode: on a shared machine one op of a grid can be caught by another process for every
    repetition (a 0.8 ms attention call at bs 4 next to 102 ms at bs 16 was seen); left in,
    the nearest-sample correction would carry it to every point around it."""
    ratios = sorted(r for m, _, r in rows if m == row[0])
    median = ratios[len(ratios) // 2]
    return len(ratios) >= 3 and not median / OUTLIER <= row[2] <= median * OUTLIER
