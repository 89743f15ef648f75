"""Planner prediction vs measurement on this machine (issue 4).

Runs `klotski generate` on the medium preset with an emulated link for the planner's own
choice (`--num-batches auto`) and for a few fixed (batch size, n) points, each in its own
process, and prints predicted vs measured tokens/s (medians) as a Markdown table.

    python benchmarks/planner_accuracy.py --link 2 --reps 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="medium-mixtral")
    ap.add_argument("--jobs", default=str(ROOT / "jobs/wikitext.jsonl"))
    ap.add_argument("--link", type=float, default=2.0)
    ap.add_argument("--points", default="auto,4x2,8x4", help="auto or BSxN, comma separated")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--device-memory", default="900MB")
    ap.add_argument("--host-memory", default="8GiB")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    jobs = tmp / "jobs.jsonl"
    write_jobs(a.jobs, a.prompts, jobs)
    rows = {}
    for rep in range(a.reps):
        for point in a.points.split(","):
            flags = [] if point == "auto" else ["--batch-size", point.split("x")[0], "--num-batches", point.split("x")[1]]
            r = generate(jobs, tmp / f"{point}-{rep}.json",
                         ["--model", a.model, "--max-new-tokens", str(a.max_new_tokens), "--emulate-link",
                          str(a.link), "--device-memory", a.device_memory, "--host-memory", a.host_memory] + flags)
            rows.setdefault(point, []).append(r)
            print(f"rep {rep} {point}: bs {r['plan']['batch_size']} n {r['plan']['num_batches']} "
                  f"measured {r['tokens_per_s']:.2f} predicted {r['predicted_tokens_per_s']:.2f}", file=sys.stderr)
    print("| point | bs | n | predicted tok/s | measured tok/s (median) | error |")
    print("|---|---|---|---|---|---|")
    out = []
    for point, rs in rows.items():
        measured = statistics.median(r["tokens_per_s"] for r in rs)
        predicted = statistics.median(r["predicted_tokens_per_s"] for r in rs)
        bs, n = rs[0]["plan"]["batch_size"], rs[0]["plan"]["num_batches"]
        print(f"| {point} | {bs} | {n} | {predicted:.2f} | {measured:.2f} | {(predicted - measured) / measured:+.0%} |")
        out.append({"point": point, "batch_size": bs, "num_batches": n, "predicted": predicted, "measured": measured,
                    "runs": [r["tokens_per_s"] for r in rs]})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
