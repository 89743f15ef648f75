"""The planner weighs precision: the same job planned once per precision the weights can take
(the checkpoint's own, HQQ 4-bit, a GGUF file's own types), each option's placement, bytes
over the link, predicted tokens/s and measured quality cost side by side, and `--quantize
auto`'s choice among them.

`auto` takes the fastest option that predicts at least AUTO_SPEEDUP x the exact one's tokens/s
(the checkpoint's own precision); below that, fewer bits are not worth their quality cost and
the exact plan stays. When the exact plan does not fit the budgets at all, the fastest option
that does is taken. A quality bound (`QualityBound`: a largest log-prob gap, a smallest greedy
agreement) further limits auto to the options whose measured cost keeps within it; an option
never measured cannot show it does, so a bound rules it out. The checkpoint's own precision is
what the user chose and is never ruled out. Quality costs are measured, not predicted: a
committed table (klotski/builtin/data/precision_quality.json, benchmarks/precision_quality.py,
measured on one model, which every label names) handed in by the caller, as the planner reads
no engine files.

The hook for checkpoints with their own quant types: an option carries its exact bytes per
group (`sizes`, a costmodel.GroupBytes as the checkpoint stores them) and the quality-table
row it is measured by; the caller lists it beside or instead of the defaults
(`default_options`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.units import format_bytes

AUTO_SPEEDUP = 1.3
QUANTIZE_CHOICES = ("none", "hqq4", "auto")


@dataclass(frozen=True)
class Precision:
    name: str                   # shown: "bfloat16", "hqq4", "Q4_K_M"
    quantize: str = "none"      # what --quantize becomes when this option is chosen
    quant_bits: int | None = None  # HQQ bits: packed sizes follow from the shape
    sizes: object = None        # GroupBytes as stored (a checkpoint's own types), or None: from the shape
    exact: bool = False         # the checkpoint's own precision: what the others are weighed against
    quality: str = ""           # its row in the quality table ("": none; shown "not measured")


@dataclass(frozen=True)
class QualityBound:
    """The quality cost `--quantize auto` may take, as measured (None: no bound on that measure)."""
    max_logprob_gap: float | None = None   # nats/token, reference minus option
    min_agreement: float | None = None     # greedy (argmax) agreement with the reference, 0..1

    def __bool__(self) -> bool:
        return self.max_logprob_gap is not None or self.min_agreement is not None

    def missed_by(self, quality: dict) -> str:
        """Why a measured quality misses the bound, in words ("" when it keeps within it)."""
        if not self:
            return ""
        if "agreement" not in quality:
            return "its quality is not measured"
        misses = []
        if self.max_logprob_gap is not None and quality["logprob_gap"] > self.max_logprob_gap:
            misses.append(f"log-prob gap {quality['logprob_gap']:.3f} > {self.max_logprob_gap:g} nats/token")
        if self.min_agreement is not None and quality["agreement"] < self.min_agreement:
            misses.append(f"greedy agreement {quality['agreement']:.1%} < {self.min_agreement:.1%}")
        return ", ".join(misses)


@dataclass
class Weighed:
    """One option planned: its Plan (or the one-line reason none fits) and the numbers shown."""
    option: Precision
    plan: object = None
    refusal: str = ""
    link_bytes: float = 0.0     # weight bytes to the device per decode step (all layers)
    quality: dict = field(default_factory=dict)
    error: Exception | None = None  # the refusal itself, raised if this option is the one taken

    @property
    def tokens_per_s(self) -> float:
        return self.plan.predicted_tokens_per_s if self.plan is not None else 0.0


def default_options(shape) -> list[Precision]:
    """The checkpoint's own precision (its dtype, or MXFP4 experts as shipped) and HQQ 4-bit."""
    own = "mxfp4 experts" if shape.expert_format == "mxfp4" else shape.dtype
    return [Precision(own, exact=True, quality=own), Precision("hqq4", quantize="hqq4", quant_bits=4, quality="hqq4")]


def link_bytes_per_step(plan, cost) -> float:
    """Weight bytes a decode step moves to the device: every off-device attention and gate
    group, and each layer's expected distinct experts in the share of them kept off the device."""
    s = cost.shape
    tiers, _ = plan.group_tiers(s.num_layers, s.num_experts)
    off = lambda key: tiers[key] != "device"
    total = 0.0
    distinct = plan.per_layer.get("expected_distinct_experts", 0.0)
    for j in range(s.num_layers):
        total += off(("attn", j)) * cost.attention_bytes + off(("gate", j)) * cost.gate_bytes
        experts = s.experts_in(j)
        if experts:
            away = sum(off(("expert", j, e)) for e in range(experts)) / experts
            total += distinct * away * cost.expert_bytes
    return total


def choose(weighed: list[Weighed], mode: str, bound: QualityBound = QualityBound()) -> tuple[Weighed, str]:
    """(the option the run takes, why, in words). `mode` is --quantize: none, hqq4 or auto;
    under auto only options whose measured quality keeps within `bound` are taken."""
    exact = next(w for w in weighed if w.option.exact)
    if mode != "auto":
        picked = exact if mode == "none" else next(w for w in weighed if w.option.quantize == mode)
        why = "--quantize none: the checkpoint's own precision (the default; --quantize auto weighs 4-bit)" \
            if mode == "none" else f"--quantize {mode} (set by hand)"
        return picked, why
    fits = [w for w in weighed if w.plan is not None]
    missed = {id(w): w.option.name + ": " + bound.missed_by(w.quality) for w in fits
              if not w.option.exact and bound.missed_by(w.quality)}
    ruled_out = f"; ruled out by the quality bound: {'; '.join(missed.values())}" if missed else ""
    fits = [w for w in fits if id(w) not in missed]
    if not fits:
        return exact, "no precision fits the budgets" + ruled_out
    fastest = max(fits, key=lambda w: w.tokens_per_s)
    if exact.plan is None:
        return fastest, (f"--quantize auto: {exact.option.name} does not fit ({exact.refusal}); "
                         f"{fastest.option.name} is the fastest option that does{_cost(fastest)}{ruled_out}")
    best = max((w for w in fits if not w.option.exact), key=lambda w: w.tokens_per_s, default=None)
    if best is None:
        return exact, (f"--quantize auto: {exact.option.name} kept" + (ruled_out or " (the only option)"))
    ratio = best.tokens_per_s / exact.tokens_per_s if exact.tokens_per_s else float("inf")
    if ratio >= AUTO_SPEEDUP:
        return best, (f"--quantize auto: {best.option.name} predicts {best.tokens_per_s:.3g} tokens/s, "
                      f"{ratio:.2f}x {exact.option.name}'s {exact.tokens_per_s:.3g} (>= {AUTO_SPEEDUP}x)"
                      f"{_cost(best)}{ruled_out}")
    return exact, (f"--quantize auto: {exact.option.name} kept; the fastest other option, {best.option.name}, "
                   f"predicts {best.tokens_per_s:.3g} tokens/s, {ratio:.2f}x (< {AUTO_SPEEDUP}x){ruled_out}")


def _cost(w: Weighed) -> str:
    """The quality a taken option costs, and where that was measured."""
    return f"; quality cost {_quality_text(w.quality)}"


def quality_row(table: dict | None, option: Precision) -> dict:
    """The option's measured quality from the table (agreement, logprob_gap, and `measured_on`:
    the model and reference it was measured with), {} where it was not measured."""
    row = ((table or {}).get("options") or {}).get(option.quality)
    if not row:
        return {}
    return {**row, "measured_on": f"{table['model']} vs {table['reference']}"}


def _quality_text(q: dict) -> str:
    if "agreement" not in q:
        return "not measured"
    return (f"{q['agreement']:.1%} greedy agreement, {q['logprob_gap']:.3f} nats/token "
            f"(measured on {q['measured_on'].split(' vs ')[0]})")


def placement_text(plan) -> str:
    """Where the plan keeps each kind of group, tier by tier."""
    parts = []
    for tier in ("device", "host", "disk"):
        groups = plan.placement_summary.get(tier, {}).get("groups", "-")
        if groups != "-":
            parts.append(f"{tier}: {groups}")
    return "; ".join(parts)


def to_dict(weighed: list[Weighed], chosen: Weighed, why: str, table: dict | None = None) -> dict:
    """The weighing as the plan's JSON, the run report and `format_options` carry it."""
    return {"chosen": chosen.option.name, "quantize": chosen.option.quantize, "why": why,
            "quality_of": f"{table['model']} vs {table['reference']}" if table else None,
            "options": [{"name": w.option.name, "quantize": w.option.quantize, "exact": w.option.exact,
                         "tokens_per_s": w.tokens_per_s if w.plan is not None else None,
                         "link_bytes_per_step": w.link_bytes if w.plan is not None else None,
                         "placement": placement_text(w.plan) if w.plan is not None else None,
                         "refusal": w.refusal or None, "quality": w.quality} for w in weighed]}


def format_options(d: dict) -> str:
    """The options table `klotski plan` prints above the chosen plan (from `to_dict`)."""
    of = f" on {d['quality_of']}" if d.get("quality_of") else ""
    lines = [f"precision options (quality{of}):",
             f"  {'option':<16}{'tokens/s':>10}{'link/step':>12}  quality; placement"]
    for o in d["options"]:
        mark = "*" if o["name"] == d["chosen"] else " "
        if o["tokens_per_s"] is None:
            lines.append(f"{mark} {o['name']:<16}{'-':>10}{'-':>12}  does not fit: {o['refusal']}")
            continue
        lines.append(f"{mark} {o['name']:<16}{o['tokens_per_s']:>10.3g}{format_bytes(o['link_bytes_per_step']):>12}  "
                     f"{_quality_text(o['quality'])}; {o['placement']}")
    lines.append(f"chosen: {d['chosen']}: {d['why']}")
    return "\n".join(lines)
