"""Issue 60 item 3: greedy agreement of the trained model in the box as GGUF files (llama.cpp's own
converter and quantizer: benchmarks/llamacpp_side_by_side.py writes them) against the model's own
fp32 run (`smollm2-moe`), each file run as a CPU run runs it by default (bf16: experts kept decoded
where `--decoded-copies auto` keeps them, the int4 kernel or the blocks otherwise), and each also in
fp32. Every group on the device (a given placement: no plan, no profile), one batch, one thread.
Agreement: the share of generated positions whose token is the reference's, position by position
(after a first difference the texts diverge, so it is a strict measure).

    .venv/bin/python benchmarks/gguf_agreement.py --files F16.gguf,Q8_0.gguf,Q4_0.gguf [--prompts 8] [--new 32]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_agreement import PROMPTS, agreement  # noqa: E402


def run(model: str, dtype: str, prompts: int, new: int):
    """(tokens per prompt, the run's decoded-copies decision) of one in-process run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import requests
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.registry import resolve
    from placement.placement import Placement
    path = model if Path(model).exists() else str(resolve(model))
    ckpt = Checkpoint.open(path)
    keys = ckpt.spec.group_keys()
    ckpt.close()
    cfg = RunConfig(model=path, progress=False, dtype=dtype, batch_size=prompts, num_batches=1, threads=1)
    engine, seqs, errors = open_engine(cfg, requests(PROMPTS[:prompts], new), placement=Placement.by_kind(keys))
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(prompts)], engine.setup.decoded_copies.get("mode", "-")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--files", required=True, help="GGUF files, comma-separated")
    p.add_argument("--reference", default="smollm2-moe")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    a = p.parse_args()
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    ref, _ = run(a.reference, "float32", a.prompts, a.new)
    print(f"| file | dtype | decoded copies | agreement with {a.reference} fp32 | prompts identical |")
    print("|---|---|---|---|---|", flush=True)
    for f in a.files.split(","):
        for dtype in a.dtypes.split(","):
            got, copies = run(f, dtype, a.prompts, a.new)
            same = sum(g == r for g, r in zip(got, ref))
            print(f"| {Path(f).name} | {dtype} | {copies} | {agreement(got, ref):.3f} | {same}/{len(ref)} |",
                  flush=True)
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
