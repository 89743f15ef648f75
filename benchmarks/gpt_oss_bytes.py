"""gpt-oss experts MXFP4 vs bf16: link bytes moved per generated token, measured in one run.

    python benchmarks/gpt_oss_bytes.py [--prompts 8] [--new-tokens 16] [--reps 3]

One small-but-not-trivial gpt-oss (hidden 512, expert width 512, 4 layers, 32 experts top-4,
a 128-token window on alternate layers; klotski.builtin.families built by transformers' own classes)
saved in bf16, and the same checkpoint with its experts packed into the MXFP4 layout OpenAI
publishes (klotski.builtin.families.pack_mxfp4; everything else bf16, as published). Both run in
bf16 with the same placement (every expert on the host, everything else on the device), the
same device budget (the bf16 model + 64 MiB), schedule and prompts, one after the other in this process, each `--reps`
times. Reported per form: host->device bytes per generated token from the run's trace (the
counter the run report's `io.bytes` prints), expert bytes as the cache holds them, and wall
time (median). Results: benchmarks/results/gpt_oss_bytes.json and a Markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
             initializer_range=0.05, swiglu_limit=7.0)
PROMPTS = ["The history of the city begins", "A river is a natural flowing watercourse",
           "Quantum mechanics is a fundamental theory in physics", "The album was recorded in London",
           "Mount Everest is the highest mountain", "Photosynthesis converts light into",
           "The treaty was signed after years of", "In mathematics, a group is a set"]


def run(path: Path, prompts: list[str], new_tokens: int, device_memory: int | None) -> dict:
    from klotski.assemble import open_engine
    from klotski.io.checkpoint import Checkpoint
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    from placement.placement import Placement

    ckpt = Checkpoint.open(str(path))
    spec = ckpt.spec
    ckpt.close()
    placement = Placement.by_kind(spec.group_keys(), expert="host")
    cfg = RunConfig(model=str(path), progress=False, dtype="bfloat16", batch_size=len(prompts), num_batches=1,
                    schedule="klotski", prefetch="none", device_memory=device_memory)
    reqs = [Request(id=str(i), line=i + 1, prompt=p, messages=None, max_new_tokens=new_tokens)
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    engine, seqs, _ = open_engine(cfg, reqs, placement=placement)
    out = {s.request.id: s.out for s in engine.run(seqs)}
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in out.values())
    moved = engine.trace.bytes.get("host_to_device", 0)
    expert = engine.cache.moved[("expert", 0, 0)]
    full = sum(engine.cache.full.values())
    engine.close()
    return {"generated_tokens": generated, "host_to_device_bytes": moved, "bytes_per_token": moved / generated,
            "expert_bytes": expert, "model_bytes_decoded": full, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpt_oss_bytes.json"))
    a = ap.parse_args()
    from klotski.builtin.families import build_family, pack_mxfp4

    prompts = (PROMPTS * (1 + a.prompts // len(PROMPTS)))[:a.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = build_family(Path(tmp) / "bf16", "gpt_oss", dtype="bfloat16", **SHAPE)
        forms = {"bf16": bf16, "mxfp4": pack_mxfp4(bf16, Path(tmp) / "mxfp4")}
        # the same budget for both: the whole bf16 model plus room for activations (the
        # placement, not the budget, keeps the experts on the host)
        probe = run(bf16, prompts[:1], 1, None)
        budget = probe["model_bytes_decoded"] + (64 << 20)
        results: dict = {}
        for rep in range(a.reps):
            for name, path in forms.items():  # interleaved: A B A B
                results.setdefault(name, []).append(run(path, prompts, a.new_tokens, budget))
    summary = {}
    for name, runs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in runs) for k in
                         ("generated_tokens", "host_to_device_bytes", "bytes_per_token", "expert_bytes", "wall_s")}
    ratio = summary["bf16"]["bytes_per_token"] / summary["mxfp4"]["bytes_per_token"]
    report = {"shape": SHAPE, "prompts": a.prompts, "new_tokens": a.new_tokens, "reps": a.reps,
              "device_budget_bytes": budget, "placement": "experts on host, the rest on the device",
              "forms": summary, "bytes_per_token_ratio_bf16_over_mxfp4": ratio}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print("| form | expert bytes | host->device bytes | generated tokens | bytes / token | wall s (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['expert_bytes']:,.0f} | {s['host_to_device_bytes']:,.0f} | "
              f"{s['generated_tokens']:.0f} | {s['bytes_per_token']:,.0f} | {s['wall_s']:.2f} |")
    print(f"\nbf16 / MXFP4 bytes per generated token: {ratio:.2f}x")


if __name__ == "__main__":
    main()
