"""Issue 60 item 3: `klotski generate`'s planned tokens/s against its measured tokens/s on a
CPU-only run of a Q4_0 GGUF model in bf16 (experts as int4 codes: compress/int4.py), and the
same with the int4 kernel off (KLOTSKI_NO_INT4_KERNEL=1: blocks decoded per use), each run in
its own process (the profile, measured on first use at the model's shapes and expert blocks,
is cached between them).

The model: a random Qwen3-MoE GGUF file at the trained model's layer shapes (hidden 576,
9 heads of 64, 3 KV heads, experts 1536 wide, 8 experts top-2; tests/gguf_models.py), experts
Q4_0, the rest F32.

    .venv/bin/python benchmarks/int4_plan.py [--layers 6] [--prompts 32] [--new 16] [--reps 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import ROOT, generate, write_jobs  # noqa: E402

SHAPE = dict(arch="qwen3moe", hidden=576, heads=9, kv_heads=3, head_dim=64, experts=8, top_k=2, moe_inter=1536,
             vocab=384)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default="int4,blocks")
    a = ap.parse_args()
    import gguf_models as gm
    tmp = Path(tempfile.mkdtemp())
    model = gm.write(tmp / "model.gguf", a.qtype, dict(SHAPE, layers=a.layers))
    jobs, short = tmp / "jobs.jsonl", tmp / "short.jsonl"
    # prompts that fit the test model's 256-token context (its tokenizer: ~1 token per 2 bytes)
    lines = [ln for ln in (ROOT / "jobs/wikitext.jsonl").read_text().splitlines() if len(json.loads(ln)["prompt"]) <= 200]
    short.write_text("\n".join(lines) + "\n")
    write_jobs(str(short), a.prompts, jobs)
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("| experts computed as | bs | n | predicted tok/s | measured tok/s | error |")
    print("|---|---|---|---|---|---|")
    for mode in a.modes.split(","):
        saved = os.environ.pop("KLOTSKI_NO_INT4_KERNEL", None)
        if mode == "blocks":
            os.environ["KLOTSKI_NO_INT4_KERNEL"] = "1"
        try:
            runs = [generate(jobs, tmp / f"{mode}-{rep}.json", ["--model", str(model), "--dtype", "bfloat16",
                                                                "--max-new-tokens", str(a.new)])
                    for rep in range(a.reps)]
        finally:
            os.environ.pop("KLOTSKI_NO_INT4_KERNEL", None)
            if saved is not None:
                os.environ["KLOTSKI_NO_INT4_KERNEL"] = saved
        measured = statistics.median(r["tokens_per_s"] for r in runs)
        predicted = statistics.median(r["predicted_tokens_per_s"] for r in runs)
        plan = runs[0]["plan"]
        print(f"| {mode} | {plan['batch_size']} | {plan['num_batches']} | {predicted:.2f} | {measured:.2f} | "
              f"{(predicted - measured) / measured:+.0%} |", flush=True)
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
