"""Model families: bf16 greedy agreement with transformers per family, and the schedules on a
Qwen3-style model (128 experts top-8) bigger than the device budget, over an emulated link.

    python benchmarks/families.py [--prompts 24] [--reps 3] [--link 2] [--parts agreement,schedules]

Agreement: each family's small random checkpoint (klotski.builtin.families) saved in fp32 and in
bf16; the same left-padded prompts through transformers' greedy generate and through Klotski
in that dtype (one batch, defaults). Reported: prompts whose tokens are all identical, and the
share of generated tokens before each prompt's first difference (bf16 sums in other orders
round differently, so a difference may appear; in fp32 the tests demand none).

Schedules: a Qwen3-MoE-shaped model (hidden 512, 4 layers, 128 experts of width 384, top-8,
bf16, 0.61 GB) with the device budget at a third of it, each schedule in its own process in
A/B/A/B order after a warm-up (benchmarks/pipeline.py's runner); decode tokens/s is the
median over reps. Results: benchmarks/results/families.json and a Markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, write_jobs  # noqa: E402
from pipeline import run_once  # noqa: E402

QWEN3_STYLE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                   num_experts=128, num_experts_per_tok=8, moe_intermediate_size=384, initializer_range=0.05)


def agreement(family: str, prompts: list[str], new_tokens: int, tmp: Path, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    from klotski.builtin.families import build_family

    path = build_family(tmp / f"{family}-{dtype}", family, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    enc = tok(prompts, return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    eos = tok.eos_token_id
    ref = [[t for t in row[:next((i for i, t in enumerate(row) if t == eos), len(row))]]
           for row in out[:, enc["input_ids"].shape[1]:].tolist()]
    cfg = RunConfig(model=str(path), progress=False, dtype=dtype, batch_size=len(prompts))
    reqs = [Request(id=str(i), line=i + 1, prompt=p, messages=None, max_new_tokens=new_tokens)
            for i, p in enumerate(prompts)]
    engine, seqs, _ = open_engine(cfg, reqs)
    ours = {int(s.request.id): s.out for s in engine.run(seqs)}
    engine.close()
    prefix = [next((i for i, (a, b) in enumerate(zip(r, ours[k])) if a != b), min(len(r), len(ours[k])))
              for k, r in enumerate(ref)]
    return {"family": family, "dtype": dtype, "prompts": len(prompts), "identical": sum(r == ours[k] for k, r in enumerate(ref)),
            "tokens_before_first_difference": round(sum(prefix) / max(1, sum(map(len, ref))), 4)}


def schedules(a, tmp: Path) -> list[dict]:
    from klotski.builtin.families import build_family
    model = build_family(tmp / "qwen3-style", "qwen3_moe", dtype="bfloat16", **QWEN3_STYLE)
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    device = f"{total // 3}B"
    configs = [("simple", 1), ("multibatch", a.n), ("klotski", a.n)]
    runs = {c: [] for c in configs}
    for rep in range(a.reps + 1):  # rep 0 warms up
        for schedule, n in configs:
            jobs = write_jobs(ROOT / "jobs/wikitext.jsonl", n * a.bs, tmp / f"jobs{n}.jsonl")
            tps, bubble, report = run_once(str(model), jobs, schedule, n, a.bs, a.link, device, "8GiB",
                                           a.max_new_tokens, tmp / f"r-{schedule}.json")
            # each sequence's first token comes out of its prefill; the rest are decode steps
            decode = round((report["tokens"]["generated"] - n * a.bs) / report["decode_s"], 3)
            print(f"rep {rep} {schedule:10s} n={n} {tps:.2f} tok/s (decode {decode}) bubble {bubble:.2f}",
                  file=sys.stderr)
            if rep:
                runs[(schedule, n)].append((tps, decode, bubble))
    return [{"schedule": s, "n": n, "model_bytes": total, "device_budget": device,
             "tokens_per_s": statistics.median(r[0] for r in rs),
             "decode_tokens_per_s": statistics.median(r[1] for r in rs),
             "bubble": statistics.median(r[2] for r in rs)} for (s, n), rs in runs.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="agreement,schedules")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--link", type=float, default=2.0, help="emulated host->device GB/s")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    result = {}
    if "agreement" in a.parts:
        from klotski.builtin.families import FAMILIES
        lines = (ROOT / "jobs/wikitext.jsonl").read_text().splitlines()[:a.prompts]
        prompts = [json.loads(l)["prompt"] for l in lines]
        result["agreement"] = [agreement(f, prompts, a.new_tokens, tmp, d) for f in FAMILIES
                               for d in ("float32", "bfloat16")]
        print("| family | dtype | prompts identical | generated tokens before the first difference |")
        print("|---|---|---|---|")
        for r in result["agreement"]:
            print(f"| {r['family']} | {r['dtype']} | {r['identical']}/{r['prompts']} | "
                  f"{r['tokens_before_first_difference']:.1%} |")
    if "schedules" in a.parts:
        result["schedules"] = schedules(a, tmp)
        print(f"\n| schedule | n | tokens/s (median of {a.reps}) | decode tokens/s | bubble |")
        print("|---|---|---|---|---|")
        for r in result["schedules"]:
            print(f"| {r['schedule']} | {r['n']} | {r['tokens_per_s']:.2f} | {r['decode_tokens_per_s']} | "
                  f"{r['bubble']:.2f} |")
    out = ROOT / "benchmarks/results/families.json"
    kept = json.loads(out.read_text()) if out.exists() else {}  # a part run alone keeps the other's figures
    out.write_text(json.dumps({**kept, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
