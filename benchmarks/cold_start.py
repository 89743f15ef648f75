"""First use of a model: what the first `klotski generate` costs against a second, warm run of
the same job, in CPU time (user + system of the child process), with the tokens compared.

    python benchmarks/cold_start.py [--reps 3] [--out benchmarks/results/cold-start.json]

Per repetition, in a fresh cache directory (XDG_CACHE_HOME), interleaved:
  empty   nothing cached: the hardware profile is measured and the correlation table learned
          from the job itself (no warm-up pass over the weights);
  table   the profile cached, no table: the cost of learning the table alone;
  warm    both cached (the run after `empty`).
Model: the medium preset with skewed routing (8 layers, 8 experts, bf16, ~1.4 GB), device
budget 400 MiB so most experts stream in; 48 wikitext prompts, 8 new tokens, 3 groups of
2 x 8. Each run's report gives the prefetch precision of every group (cold first group vs
the later ones).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_jobs  # noqa: E402

ARGS = ["--device-memory", "400MiB", "--batch-size", "8", "--num-batches", "2", "--max-new-tokens", "8",
        "--include-token-ids", "--no-progress", "--no-resume"]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(model: Path, jobs: Path, cache: Path, out: Path) -> dict:
    report = out.with_suffix(".report.json")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    before = _cpu()
    subprocess.run([sys.executable, "-m", "klotski.cli", "generate", str(jobs), "--model", str(model), "-o", str(out),
                    "--report", str(report), *ARGS], check=True, capture_output=True, cwd=ROOT, env=env)
    cpu = _cpu() - before
    rep = json.loads(report.read_text())
    tokens = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return {"cpu_s": round(cpu, 2), "wall_s": rep["wall_s"], "tokens_per_s": rep["tokens_per_s"],
            "precision": rep["prefetch"]["precision"],
            "per_group": [{k: g[k] for k in ("predictor", "precision", "hot_accuracy")}
                          for g in rep["prefetch"]["per_group"]], "tokens": tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cold-start.json"))
    a = ap.parse_args()
    from klotski.builtin import tiny
    work = Path(tempfile.mkdtemp(prefix="klotski-cold-"))
    model = tiny.build_checkpoint(work / "model", "medium", routing="skewed")
    jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", 48, work / "jobs.jsonl")
    rows = {"empty": [], "table": [], "warm": []}
    for rep in range(a.reps):
        cache = work / f"cache{rep}"
        rows["empty"].append(run(model, jobs, cache, work / f"empty{rep}.jsonl"))
        rows["warm"].append(run(model, jobs, cache, work / f"warm{rep}.jsonl"))
        profile_only = work / f"profile-only{rep}"
        shutil.copytree(cache / "klotski" / "profiles", profile_only / "klotski" / "profiles")
        rows["table"].append(run(model, jobs, profile_only, work / f"table{rep}.jsonl"))
    tokens = [r.pop("tokens") for rs in rows.values() for r in rs]
    median = {k: statistics.median(r["cpu_s"] for r in rs) for k, rs in rows.items()}
    result = {
        "model": "medium preset, skewed routing, bfloat16", "args": ARGS, "prompts": 48, "reps": a.reps,
        "identical_tokens": all(t == tokens[0] for t in tokens),
        "median_cpu_s": median,
        "ratio_empty_to_warm": round(median["empty"] / median["warm"], 3),
        "ratio_table_to_warm": round(median["table"] / median["warm"], 3),
        "runs": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"| first run | CPU s (median of {a.reps}) | vs warm |\n|---|---|---|")
    for k in rows:
        print(f"| {k} | {median[k]:.1f} | {median[k] / median['warm']:.2f}x |")
    print(f"identical tokens in all {len(tokens)} runs: {result['identical_tokens']}")
    for k in ("empty", "warm"):
        groups = rows[k][0]["per_group"]
        print(f"{k}: " + "; ".join(f"group {i}: {g['precision']} ({g['predictor']})" for i, g in enumerate(groups)))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
