"""MoE-Gen's setting on paper: `python -m planner.moegen`.

MoE-Gen (arXiv 2503.09716) keeps the KV cache in host RAM, computes attention on the CPU
next to it and runs each module over very large token batches; on one A5000 with 512 GB of
host RAM, prompt 512 and decode 256, it reports Mixtral-8x7B at 2,790 prefill / 469 decode
tokens/s and Mixtral-8x22B at 907 / 91. This replays that job with our planner and
simulator on MoE-Gen's machine (`a5000-pcie4-512g`) and on the Klotski paper's
(`rtx3090-pcie4`), with host attention and host experts allowed (auto) and not (off), and
prints a Markdown table beside both papers' figures. Everything here is simulated from
datasheet peaks × stated efficiencies: on paper, not measured.
"""
from __future__ import annotations

import argparse
import sys

from planner.costmodel import CostModel
from planner.profile import load_profile
from planner.routing import RoutingSample
from planner.shapes import KNOWN_MODELS
from planner.simulate import simulate
from planner.solve import Budgets, Infeasible, solve

SETTINGS = {"a5000-pcie4-512g": "A5000 + 512 GB (MoE-Gen's)", "rtx3090-pcie4": "3090 + 256 GB (Klotski's)"}
MODELS = ("mixtral-8x7b", "mixtral-8x22b")
# MoE-Gen, on its A5000 + 512 GB machine, prompt 512 / decode 256: (prefill, decode) tokens/s.
MOEGEN = {("mixtral-8x7b", "a5000-pcie4-512g"): (2790, 469), ("mixtral-8x22b", "a5000-pcie4-512g"): (907, 91)}
# Klotski paper, Table 3, end-to-end tokens/s on the 3090 (prompt 512, output 32).
KLOTSKI = {("mixtral-8x7b", "rtx3090-pcie4"): 22.414, ("mixtral-8x22b", "rtx3090-pcie4"): 1.325}


def run(model: str, hardware: str, host: str, *, prompt_len: int = 512, gen_len: int = 256, skew: float = 1.0,
        seed: int = 0) -> dict:
    """Plan with host compute `host` (auto | off) and replay the plan: {"plan", "sim", "error"}."""
    shape, profile = KNOWN_MODELS[model], load_profile(hardware)
    cost = CostModel(profile, shape)
    routing = RoutingSample.synthetic(shape.num_layers, shape.num_experts, shape.top_k, skew=skew, seed=seed)
    try:
        plan = solve(shape, cost, Budgets.from_profile(profile), prompt_len=prompt_len, gen_len=gen_len,
                     popularity=sorted(routing.marginals(0), reverse=True), host_attention=host, host_experts=host)
    except Infeasible as e:
        return {"plan": None, "sim": None, "error": str(e)}
    sim = simulate(cost, shape, bs=plan.batch_size, n=plan.num_batches, prompt_len=prompt_len, gen_len=gen_len,
                   routing=routing, placement=plan)
    return {"plan": plan, "sim": sim, "error": None}


def markdown(results: dict) -> str:
    """results: {(model, hardware, host): run(...)} → one Markdown table."""
    lines = ["| setting | model | host compute | plan (bs × n, where) | prefill tok/s | decode tok/s | "
             "end-to-end tok/s | MoE-Gen prefill / decode | Klotski paper end-to-end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (model, hw, host), r in results.items():
        mg = MOEGEN.get((model, hw))
        kl = KLOTSKI.get((model, hw))
        ref = (f"{mg[0]:,} / {mg[1]:,}" if mg else "-", f"{kl:g} (output 32)" if kl else "-")
        if r["sim"] is None:
            lines.append(f"| {SETTINGS[hw]} | {model} | {host} | infeasible | - | - | - | {ref[0]} | {ref[1]} |")
            continue
        p, s = r["plan"], r["sim"]
        where = "attention on host" if p.host_attention else "attention on device"
        dev = p.placement_summary["device"]["groups"]
        lines.append(f"| {SETTINGS[hw]} | {model} | {host} | {p.batch_size} × {p.num_batches}, {where}; device: {dev} "
                     f"| **{s.prefill_tokens_per_s:,.0f}** | **{s.decode_tokens_per_s:,.1f}** | {s.tokens_per_s:,.1f} "
                     f"| {ref[0]} | {ref[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m planner.moegen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf skew of synthetic routing (0 = uniform)")
    ap.add_argument("--hardware", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args(argv)
    results = {(m, hw, host): run(m, hw, host, skew=args.skew)
               for hw in args.hardware for m in MODELS for host in ("auto", "off")}
    print(f"Simulated, on paper: prompt 512, decode 256, routing Zipf skew {args.skew}; "
          "prefill = prompt tokens / prefill time, decode = generated rows / decode time.\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
