"""The planner's predicted tokens/s against measured, on the benchmark configurations of
docs/benchmarks.md that run on this machine (issue 14, part 3: within ±20% on each).

    python benchmarks/prediction_suite.py [--only NAME,...] [--repeats N] [--out benchmarks/results/prediction-suite.json]

Each configuration runs `--repeats` times (default 1; the row is the run of median measured
tokens/s, the others' measured rates listed beside it), each in its own `klotski generate` process, from the user cache as
it stands (the first run of a model measures its profile: run the suite twice, or once after
the configurations' models were used, to time generation only). Measured is the report's
`tokens_per_s` (generated tokens over prefill + decode time); predicted is the report's
`predicted_tokens_per_s`, the plan's for this job (its prompts, its max_new_tokens replayed
through the group's slots under the run's batching); replayed is the report's
`replayed_tokens_per_s`, the same plan's cost model over the lengths the answers had (EOS
known), which is the cost model's own error.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402
from continuous import write_job as heavy_tailed_job  # noqa: E402

MEDIUM = ["--model", "medium-mixtral", "--emulate-link", "2", "--device-memory", "900MB", "--host-memory", "8GiB",
          "--max-new-tokens", "16"]
TINY_LINK = ["--model", "tiny-mixtral", "--device-memory", "7000000", "--emulate-link", "2", "--dtype", "float32",
             "--batch-size", "8", "--num-batches", "2"]
# name -> (job, flags): the job is "labels" (the demo's), "wikitext:N" (the first N prompts) or
# "heavy:N" (the continuous-batching benchmark's heavy-tailed max_new_tokens)
CONFIGS = {
    "demo (smollm2-moe, 900 MiB)": ("labels", ["--model", "smollm2-moe", "--device-memory", "900MiB"]),
    "continuous, tiny-mixtral 7 MB, link 2": ("heavy:128", TINY_LINK + ["--batching", "continuous"]),
    "static, tiny-mixtral 7 MB, link 2": ("heavy:128", TINY_LINK + ["--batching", "static"]),
    "medium, link 2, planner's choice": ("wikitext:64", MEDIUM),
    "medium, link 2, 4x4": ("wikitext:64", MEDIUM + ["--batch-size", "4", "--num-batches", "4"]),
    "medium, link 2, 8x2": ("wikitext:64", MEDIUM + ["--batch-size", "8", "--num-batches", "2"]),
}


def job_file(job: str, tmp: Path) -> Path:
    out = tmp / (job.replace(":", "-") + ".jsonl")
    if job == "labels":
        return ROOT / "jobs" / "labels.jsonl"
    kind, count = job.split(":")
    if kind == "heavy":
        heavy_tailed_job(int(count), out)
        return out
    return write_jobs(ROOT / "jobs" / "wikitext.jsonl", int(count), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated configuration names (substrings)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prediction-suite.json"))
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-prediction-"))
    rows = []
    for i, (name, (job, flags)) in enumerate(CONFIGS.items()):
        if a.only and not any(part in name for part in a.only.split(",")):
            continue
        runs = sorted((generate(job_file(job, tmp), tmp / f"run{i}-{k}.json", flags) for k in range(a.repeats)),
                      key=lambda run: run["tokens_per_s"])
        r = runs[len(runs) // 2]
        measured, predicted, replayed = r["tokens_per_s"], r["predicted_tokens_per_s"], r.get("replayed_tokens_per_s")
        rows.append({"config": name, "batch_size": r["plan"]["batch_size"], "num_batches": r["plan"]["num_batches"],
                     "generated": r["tokens"]["generated"], "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
                     "measured": measured, "predicted": predicted, "replayed": replayed,
                     "ratio": predicted / measured if measured and predicted else None,
                     "replayed_ratio": replayed / measured if measured and replayed else None,
                     "measured_runs": [run["tokens_per_s"] for run in runs]})
        print(json.dumps(rows[-1]), flush=True)
    print("| configuration | bs × n | measured tok/s | predicted tok/s | predicted / measured "
          "| replayed tok/s | replayed / measured |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda x: f"{x:.2f}" if x else "–"  # noqa: E731
    for row in rows:
        print(f"| {row['config']} | {row['batch_size']} × {row['num_batches']} | {row['measured']:.2f} | "
              f"{fmt(row['predicted'])} | {fmt(row['ratio'])} | {fmt(row['replayed'])} | {fmt(row['replayed_ratio'])} |")
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
