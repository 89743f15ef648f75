"""Schedule ablation on the `medium` tiny preset with an emulated PCIe link.

Each configuration runs in its own process (`klotski generate --report`), in an A/B/A/B
order after a warm-up, and the median tokens/s and bubble share are printed as a Markdown
table. Usage:

    python benchmarks/pipeline.py --link 2 --reps 3 [--ns 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(model, jobs, schedule, n, bs, link, device_mem, host_mem, max_new, report):
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "--model", model, "-o",
           str(report.with_suffix(".out.jsonl")), "--no-resume", "--no-progress", "--report", str(report),
           "--schedule", schedule, "--num-batches", str(n), "--batch-size", str(bs),
           "--max-new-tokens", str(max_new), "--emulate-link", str(link),
           "--device-memory", device_mem, "--host-memory", host_mem]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    r = json.loads(report.read_text())
    return r["tokens_per_s"], r["bubble"]["share"], r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="medium-mixtral")
    ap.add_argument("--jobs", default=str(ROOT / "jobs/wikitext.jsonl"), help="prompts (the first n*bs are used)")
    ap.add_argument("--link", type=float, default=2.0, help="emulated host->device GB/s")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--device-memory", default="900MB")
    ap.add_argument("--host-memory", default="8GiB")
    ap.add_argument("--schedules", default="simple,multibatch,hot-prefetch,klotski")
    a = ap.parse_args()
    ns = [int(x) for x in a.ns.split(",")]
    prompts = [json.loads(l) for l in Path(a.jobs).read_text().splitlines()]
    tmp = Path(tempfile.mkdtemp())
    configs = [(s, 1) for s in a.schedules.split(",") if s == "simple"]
    configs += [(s, n) for s in a.schedules.split(",") if s != "simple" for n in ns]
    results = {c: [] for c in configs}
    for rep in range(a.reps + 1):  # rep 0 is the warm-up
        for schedule, n in configs:
            jobs = tmp / f"jobs{n}.jsonl"
            jobs.write_text("".join(json.dumps({"id": p["id"], "prompt": p["prompt"]}) + "\n"
                                    for p in prompts[: n * a.bs]))
            tps, bubble, _ = run_once(a.model, jobs, schedule, n, a.bs, a.link, a.device_memory,
                                      a.host_memory, a.max_new_tokens, tmp / f"r-{schedule}-{n}.json")
            if rep:
                results[(schedule, n)].append((tps, bubble))
            print(f"rep {rep} {schedule:12s} n={n:<3d} {tps:8.2f} tok/s bubble {bubble:.2f}", file=sys.stderr)
    print(f"| schedule | n | tokens/s (median of {a.reps}) | spread | bubble share |")
    print("|---|---|---|---|---|")
    for (schedule, n), rs in results.items():
        tps = [r[0] for r in rs]
        print(f"| {schedule} | {n} | {statistics.median(tps):.2f} | {min(tps):.2f}–{max(tps):.2f} "
              f"| {statistics.median(r[1] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
