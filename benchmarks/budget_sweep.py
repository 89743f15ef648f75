"""Device-budget sweep of `klotski generate`, as a user runs it: for each budget, the run
either finishes (tokens compared with transformers' greedy generate, peak device bytes
against the budget) or is refused; a refusal's named minimum is then run as typed.

    python benchmarks/budget_sweep.py [--out benchmarks/results/budget-sweep.json]

The model and job are the budgets issue's: hidden 96, 5 layers, 6 experts top-2, 6 query
heads on 2 KV heads (~6.4 MB fp32), 24 prompts of 10-56 tokens, batch size 4, fp32.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

NEW = 8


def _generate(model, jobs, out, budget) -> tuple[int, str, dict | None]:
    report = out.with_suffix(".report.json")
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "--model", str(model), "-o", str(out),
           "--batch-size", "4", "--dtype", "float32", "--max-new-tokens", str(NEW), "--no-progress",
           "--no-resume", "--include-token-ids", "--device-memory", budget, "--report", str(report)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return r.returncode, r.stderr.strip(), json.loads(report.read_text()) if r.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "budget-sweep.json"))
    a = ap.parse_args()
    from conftest import reference_tokens
    from test_budgets import SHAPE, budget_prompts

    from klotski.builtin import tiny
    from placement.store import TensorStore
    work = Path(tempfile.mkdtemp(prefix="klotski-sweep-"))
    model = tiny.build_checkpoint(work / "model", "tiny", **SHAPE)
    prompts = budget_prompts(model)
    jobs = work / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    ref = reference_tokens(model, prompts, NEW)
    total = sum(e.nbytes for e in TensorStore(model).entries.values())
    rows = []
    for parts in (1, 2, 4, 8, 12, 16, 24, 32):  # of 32
        budget = f"{total * parts // 32}B"
        out = work / f"out-{parts}.jsonl"
        code, err, report = _generate(model, jobs, out, budget)
        row = {"budget_bytes": total * parts // 32, "share_of_model": parts / 32}
        if code == 2 and "--device-memory" in err:
            minimum = err.split("--device-memory ")[1].split()[0]
            row.update(refused=err, named_minimum=minimum)
            code, err, report = _generate(model, jobs, out, minimum)
            row["minimum_run"] = "finished" if code == 0 else f"exit {code}: {err}"
        if report:
            got = {json.loads(l)["id"]: json.loads(l) for l in out.read_text().splitlines()}
            same = sum(got[f"q{i}"]["token_ids"] == ref[i] for i in range(len(prompts)))
            row.update(peak_device_bytes=report["memory"]["peak_device_bytes"],
                       budget_device_bytes=report["memory"]["budget_device_bytes"],
                       prefill_chunk=report["plan"]["prefill_chunk"], buffers=report["plan"]["buffers"],
                       tokens_per_s=report["tokens_per_s"], prompts_equal_to_transformers=same)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model_bytes": total, "prompts": len(prompts), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
