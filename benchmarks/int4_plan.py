"""Issue 60 item 3: `klotski generate`'s planned tokens/s against its measured tokens/s on a
CPU-only run of a quantized GGUF model in bf16, each way its experts can be computed, each run
in its own process (the profile, measured on first use at the model's shapes and the path's
expert form, is cached between runs: pass --fresh-cache to measure it anew in an empty
XDG_CACHE_HOME, as a profile measured in a busy moment is kept):

  kept    a bf16 copy decoded once and kept in host RAM (`--decoded-copies auto`, where it applies)
  int4    torch's int4 kernel over the codes (Q4_0/Q4_K; `--decoded-copies off`)
  blocks  the blocks decoded per use (`--decoded-copies off`, KLOTSKI_NO_INT4_KERNEL=1)
  off     `--decoded-copies off` (for a file whose experts are floats: computed as read, a wave each)

The model: `--model FILE.gguf`, else a random Qwen3-MoE GGUF file at the trained model's layer
shapes (hidden 576, 9 heads of 64, 3 KV heads, experts 1536 wide, 8 experts top-2;
tests/gguf_models.py), experts `--qtype`, the rest F32. Prompts: wikitext lines short enough for
the random model's 256-token context, or, with --model, the first wikitext lines as they are.

    .venv/bin/python benchmarks/int4_plan.py [--model F.gguf] [--layers 6] [--prompts 32] [--new 16]
        [--reps 3] [--modes kept,int4,blocks] [--threads 1] [--fresh-cache]
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
MODES = {"kept": ([], {}), "int4": (["--decoded-copies", "off"], {}), "off": (["--decoded-copies", "off"], {}),
         "blocks": (["--decoded-copies", "off"], {"KLOTSKI_NO_INT4_KERNEL": "1"})}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default="kept,int4,blocks")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--fresh-cache", action="store_true")
    ap.add_argument("--out", help="a JSON file for every run's figures")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    jobs = tmp / "jobs.jsonl"
    if a.model:
        model = Path(a.model)
        write_jobs(str(ROOT / "jobs/wikitext.jsonl"), a.prompts, jobs)
    else:
        import gguf_models as gm
        model = gm.write(tmp / "model.gguf", a.qtype, dict(SHAPE, layers=a.layers))
        # prompts that fit the test model's 256-token context (its tokenizer: ~1 token per 2 bytes)
        short = tmp / "short.jsonl"
        lines = [ln for ln in (ROOT / "jobs/wikitext.jsonl").read_text().splitlines() if len(json.loads(ln)["prompt"]) <= 200]
        short.write_text("\n".join(lines) + "\n")
        write_jobs(str(short), a.prompts, jobs)
    env = dict(os.environ)
    if a.fresh_cache:
        env["XDG_CACHE_HOME"] = str(tmp / "cache")
    print(f"# model {model}; uptime before: {uptime()}", flush=True)
    print("| experts computed as | bs | n | decoded copies | predicted tok/s | measured tok/s (median) | runs | "
          "predicted/measured |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    found = {}
    for mode in a.modes.split(","):
        flags, extra = MODES[mode]
        args = ["--model", str(model), "--dtype", "bfloat16", "--max-new-tokens", str(a.new), "--device", "cpu",
                *flags, *(["--threads", str(a.threads)] if a.threads else [])]
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env, **extra)
        try:
            runs = [generate(jobs, tmp / f"{mode}-{rep}.json", args) for rep in range(a.reps)]
        finally:
            os.environ.clear()
            os.environ.update(saved)
        measured = statistics.median(r["tokens_per_s"] for r in runs)
        predicted = statistics.median(r["predicted_tokens_per_s"] for r in runs)
        plan = runs[0]["plan"]
        copies = plan.get("decoded_copies", {})
        found[mode] = {"runs": [{k: r.get(k) for k in ("tokens_per_s", "predicted_tokens_per_s", "prefill_s",
                                                        "decode_s", "predicted_prefill_s", "predicted_decode_s")}
                                for r in runs], "decoded_copies": copies, "bs": plan["batch_size"]}
        print(f"| {mode} | {plan['batch_size']} | {plan['num_batches']} | {copies.get('mode', '-')} | "
              f"{predicted:.2f} | {measured:.2f} | {', '.join(format(r['tokens_per_s'], '.1f') for r in runs)} | "
              f"{predicted / measured:.2f} |", flush=True)
    print(f"# uptime after: {uptime()}")
    if a.out:
        Path(a.out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
