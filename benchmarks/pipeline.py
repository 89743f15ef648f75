"""Schedule ablation on the `medium` tiny preset with an emulated PCIe link.

Each configuration runs in its own process (`klotski generate --report`), in an A/B/A/B
order after a warm-up, and the median tokens/s and bubble share are printed as a Markdown
table. Usage:

    python benchmarks/pipeline.py --link 2 --reps 3 [--ns 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402


def run_once(model, jobs, schedule, n, bs, link, device_mem, host_mem, max_new, report):
    r = generate(jobs, report, ["--model", model, "--schedule", schedule, "--num-batches", str(n),
                                "--batch-size", str(bs), "--max-new-tokens", str(max_new), "--emulate-link",
                                str(link), "--device-memory", device_mem, "--host-memory", host_mem])
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
    tmp = Path(tempfile.mkdtemp())
    configs = [(s, 1) for s in a.schedules.split(",") if s == "simple"]
    configs += [(s, n) for s in a.schedules.split(",") if s != "simple" for n in ns]
    results = {c: [] for c in configs}
    for rep in range(a.reps + 1):  # rep 0 is the warm-up
        for schedule, n in configs:
            jobs = write_jobs(a.jobs, n * a.bs, tmp / f"jobs{n}.jsonl")
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
