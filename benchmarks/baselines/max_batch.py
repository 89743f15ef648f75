"""`accelerate_run.py --find-max-batch`: the strongest batch size a user could pick.

accelerate's `max_memory` only plans where weights go; activations and the KV cache grow
with the batch and nothing bounds them. So the search measures instead of trusting it.

Criterion. Batch size b fits when a run of the first batch of size b (the b longest
prompts, the batch Klotski's order also starts with, at the run's --max-new-tokens),
in its own process, exits cleanly and charges the budget no more than device + cpu:

    charged = weights kept resident + (peak RSS during generation - RSS right after loading)

* device + cpu: the total memory Klotski is given (--device-memory + --host-memory);
  accelerate itself only receives the device part, the rest is room for activations.
* The second term is what generation adds: activations, the KV cache, and the disk
  weights of the module running (mapped file pages, counted while mapped: in the GPU
  setting they would occupy device memory too). The kernel's high-water mark is reset
  after loading (/proc/self/clear_refs) so this peak is generation's own.
* The resident weights are charged by size, not by RSS: transformers leaves the whole
  checkpoint mapped and touched after loading, so RSS after loading is mostly page
  cache (medium at 900MB: 2.35 GB RSS for 0.55 GB of resident weights).
* Not charged: the runtime (Python, torch, transformers' modeling code, tokenizer: about
  0.4 GB of RSS with the tiny model, a hundred times its weights), because every system pays
  it and a small budget would otherwise exclude everything; and loading, because
  transformers' MoE weight converter materialises fused experts before re-saving them
  to the offload folder, a one-off spike independent of b. Its peak RSS is reported
  per candidate (`peak_rss_load_bytes`) so a reader can see it.
* The page cache holding the rest of the disk tier is not charged; that is the
  regime's nature (see accelerate_run.py), not a loophole this search opens.

Candidates are powers of two up to --batch-cap (or --batch-candidates), tried in
increasing order; memory grows with b, so the search stops at the first failure. It
also stops when the job file has fewer prompts than the next candidate needs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = Path(__file__).with_name("accelerate_run.py")


def candidates(cap: int, explicit: str | None = None) -> list[int]:
    if explicit:
        return sorted({int(x) for x in explicit.split(",") if x.strip()})
    out, b = [], 1
    while b <= cap:
        out.append(b)
        b *= 2
    return out


def _runner_cmd(a, batch_size: int, out: Path, report: Path) -> list[str]:
    cmd = [sys.executable, str(RUNNER), "--model", str(a.model), "--jobs", str(a.jobs),
           "--out", str(out), "--report", str(report), "--batch-size", str(batch_size),
           "--max-batches", "1", "--max-new-tokens", str(a.max_new_tokens),
           "--max-memory-device", a.max_memory_device, "--max-memory-cpu", a.max_memory_cpu,
           "--offload-folder", str(a.offload_folder), "--dtype", a.dtype]
    return cmd + (["--threads", str(a.threads)] if a.threads else [])


def try_batch(a, batch_size: int, budget: int, tmp: Path) -> dict:
    report = tmp / f"bs{batch_size}.json"
    proc = subprocess.run(_runner_cmd(a, batch_size, tmp / f"bs{batch_size}.jsonl", report),
                          capture_output=True, text=True)
    row = {"batch_size": batch_size, "returncode": proc.returncode}
    if proc.returncode != 0 or not report.exists():
        # A negative code is a signal: -9 is usually the kernel's OOM killer.
        row.update(fits=False, reason=f"run failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        return row
    r = json.loads(report.read_text())
    used = r["budget_used_bytes"]
    row.update(fits=used <= budget, used_bytes=used, over_budget_bytes=max(0, used - budget),
               resident_weight_bytes=r["resident_weight_bytes"],
               generate_growth_bytes=used - r["resident_weight_bytes"],
               peak_rss_bytes=r["peak_rss_bytes"],
               peak_rss_load_bytes=r["peak_rss_load_bytes"],
               tokens_per_s=r["tokens_per_s"], time_to_first_token_s=r["time_to_first_token_s"],
               rows=r["requests"]["ok"])
    if not row["fits"]:
        row["reason"] = f"peak RSS over budget by {row['over_budget_bytes']} bytes"
    return row


def find_max_batch(a) -> dict:
    from klotski.config import parse_size
    from klotski.io.jobs import read_jobs

    budget = parse_size(a.max_memory_device) + parse_size(a.max_memory_cpu)
    n_jobs = len(read_jobs(a.jobs)[0])
    rows, best, stopped = [], None, "cap"
    with tempfile.TemporaryDirectory(prefix="accel-maxbatch-") as tmp:
        for b in candidates(a.batch_cap, a.batch_candidates):
            if b > n_jobs:
                stopped = f"job file has only {n_jobs} prompts"
                break
            row = try_batch(a, b, budget, Path(tmp))
            rows.append(row)
            print(f"batch {b}: {'fits' if row['fits'] else 'does not fit'}"
                  f" ({row.get('used_bytes', '?')} of {budget} bytes)", file=sys.stderr, flush=True)
            if not row["fits"]:
                stopped = row["reason"]
                break
            best = b
    return {"system": "accelerate", "mode": "find-max-batch", "ok": best is not None,
            "best_batch_size": best, "budget_bytes": budget, "stopped_by": stopped,
            "criterion": "resident weights + (generation peak RSS - RSS after load) <= device + cpu budget",
            "max_new_tokens": a.max_new_tokens, "candidates": rows}
