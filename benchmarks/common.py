"""Shared by the benchmark scripts: the job subset they run and how a run is launched."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_jobs(source: str | Path, count: int, out: Path) -> Path:
    """The first `count` prompts of `source`, ids and prompts only, so every run generates the
    same number of tokens per prompt (the run's --max-new-tokens)."""
    lines = Path(source).read_text().splitlines()[:count]
    out.write_text("".join(json.dumps({"id": json.loads(l)["id"], "prompt": json.loads(l)["prompt"]}) + "\n"
                           for l in lines))
    return out


def generate(jobs: Path, report: Path, args: list[str]) -> dict:
    """`klotski generate` in its own process; returns its run report."""
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "-o", str(report.with_suffix(".out.jsonl")),
           "--no-resume", "--no-progress", "--report", str(report)] + args
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return json.loads(report.read_text())
