"""Throughput of `klotski generate --ray local` with 1 and 2 actors against one process without
Ray, beside what the planner predicts for each actor (it plans per actor, on that actor's own
threads and memory share).

Each configuration is its own `klotski generate` process (a Ray run starts its own local
cluster of this machine's CPUs), in A/B/C order after a warm-up; medians are printed as a
Markdown table and saved as JSON. A Ray run's throughput is taken over its serving time
(every actor started, to the last record), so the cluster's and actors' start-up is apart.
Usage:

    python benchmarks/ray_scale.py --model small-mixtral --prompts 64 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402

# (flags, torch threads of the one process: 1 is what each of 2 actors gets, so the last row's
# gain is told apart from one thread's own gain on a busy 2-core machine)
CONFIGS = {"one process": ([], None), "ray, 1 actor": (["--ray", "local", "--workers", "1"], None),
           "ray, 2 actors": (["--ray", "local", "--workers", "2"], None), "one process, 1 thread": ([], "1")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small-mixtral")
    ap.add_argument("--jobs", default=str(ROOT / "jobs/wikitext.jsonl"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--shard", type=int, default=16, help="job lines per shard (--shard)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ray-scale.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-ray-scale-"))
    jobs = write_jobs(a.jobs, a.prompts, tmp / "jobs.jsonl")
    common = ["--model", a.model, "--max-new-tokens", str(a.max_new_tokens), "--shard", str(a.shard)]
    runs = {name: [] for name in CONFIGS}
    generate(jobs, tmp / "warm.json", common)  # builds the model and measures the profile once
    for rep in range(a.reps):
        for name, (flags, threads) in CONFIGS.items():
            os.environ.pop("OMP_NUM_THREADS", None)
            if threads:
                os.environ["OMP_NUM_THREADS"] = threads
            r = generate(jobs, tmp / f"r{rep}-{name.replace(' ', '').replace(',', '-')}.json", common + flags)
            runs[name].append(_row(r))
            print(f"rep {rep} {name}: {runs[name][-1]}", file=sys.stderr)
    table = {name: _median(rows) for name, rows in runs.items()}
    Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs, "medians": table}, indent=2) + "\n")
    print("| configuration | tokens/s (median) | per actor: measured tok/s while generating | "
          "per actor: planner predicted tok/s | plan per actor (bs x n) | wall s |")
    print("|---|---|---|---|---|---|")
    for name, m in table.items():
        print(f"| {name} | {m['tokens_per_s']:.1f} | {m['measured']} | {m['predicted']} | {m['plans']} | "
              f"{m['wall_s']:.1f} |")


def _row(r: dict) -> dict:
    """One run: the pool's tokens/s, and each engine's own measured and predicted tokens/s."""
    if "ray" not in r:
        plan = r["plan"]
        return {"tokens_per_s": r["tokens_per_s"], "measured": [r["tokens_per_s"]],
                "predicted": [r["predicted_tokens_per_s"]], "plans": [f"{plan['batch_size']}x{plan['num_batches']}"],
                "records": [r["requests"]["ok"]], "wall_s": r["wall_s"]}
    actors = r["ray"]["per_actor"]
    return {"tokens_per_s": r["tokens_per_s"], "measured": [a["tokens_per_s"] for a in actors],
            "predicted": [a["plan"]["predicted_tokens_per_s"] if a["plan"] else None for a in actors],
            "plans": [f"{a['plan']['batch_size']}x{a['plan']['num_batches']}" if a["plan"] else "-" for a in actors],
            "records": [a["records"] for a in actors], "wall_s": r["wall_s"]}


def _median(rows: list[dict]) -> dict:
    def each(key):
        return [round(statistics.median(r[key][i] for r in rows), 1) for i in range(len(rows[0][key]))
                if all(r[key][i] is not None for r in rows)]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows), "measured": each("measured"),
            "predicted": each("predicted"), "plans": rows[-1]["plans"], "records": rows[-1]["records"],
            "wall_s": statistics.median(r["wall_s"] for r in rows)}


if __name__ == "__main__":
    main()
