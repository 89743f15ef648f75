"""`klotski bench --preset gpu`: the real-dimension benchmark of issue 46 (Mixtral-8x7B and
Qwen3-30B-A3B layer shapes, a 24 GiB-equivalent budget, the link held to PCIe 4), run by
`benchmarks/gpu_realdims.py`, which needs the source checkout. On a machine without CUDA the
same command runs at widths divided by 16. This module adds the preset's own flags to
`klotski bench` and hands the run over."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_realdims.py"


def add_flags(p) -> None:
    p.add_argument("--layers", type=int, help="gpu: layers built per model (default 4 on CUDA, 2 on CPU)")
    p.add_argument("--num-batches", type=int, metavar="N", help="gpu: force Klotski's n (default: the planner's)")
    p.add_argument("--rows", help="gpu: the rows to run, e.g. mixtral-8x7b:klotski,mixtral-8x7b:simple (default all)")
    p.add_argument("--deadline", type=float, metavar="S", help="gpu: no row starts after S seconds (default 270)")
    p.add_argument("--row-timeout", type=float, metavar="S", help="gpu: seconds one row may run (default 150)")
    p.add_argument("--model-dir", metavar="DIR", help="gpu: where the models are built (default /dev/shm when it has room)")


def run(a) -> int:
    """benchmarks/gpu_realdims.py with the flags given (the others take its defaults)."""
    if not SCRIPT.exists():
        print(f"klotski: error: bench --preset gpu needs the source checkout ({SCRIPT} not found); "
              "run it from a clone of the repository", file=sys.stderr)
        return 2
    cmd = [sys.executable, str(SCRIPT), "--device", a.device or "auto", "--routing", a.routing]
    if a.batch_size not in (None, "auto"):
        cmd += ["--batch-size", a.batch_size]
    for flag, value in (("--prompts", a.prompts), ("--max-new-tokens", a.max_new_tokens),
                        ("--prompt-tokens", a.prompt_tokens), ("--num-batches", a.num_batches),
                        ("--link-gbps", a.emulate_link), ("--layers", a.layers), ("--rows", a.rows),
                        ("--deadline", a.deadline), ("--row-timeout", a.row_timeout), ("--model-dir", a.model_dir), ("--out", a.out),
                        ("--work-dir", a.work_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    return subprocess.call(cmd)
