"""`klotski plan`'s kernels and channel submissions per decode layer against a real run of
the plan (issue 45, item 4): the regimes of tests/test_plan_ops.py, printed as a table.

    python benchmarks/plan_ops.py

Counts, not seconds: the same on any machine. Model: Qwen3-shaped, 32 experts top-8, 3
layers, fp32; 2 batches of 4 rows, 6 new tokens; the plan's placement run as planned."""
import tempfile
from pathlib import Path

import torch

from klotski.assemble import open_engine
from klotski.measure.op_count import counted_profile, decode_layer_counts
from klotski.builtin.families import build_family
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.planning import engine_placement, make_plan
from planner.shapes import as_shape

REGIMES = (("every expert resident", 1 << 30), ("experts streamed from host", 4_000_000),
           ("experts and KV on host", 2_000_000))


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_family(Path(tmp) / "q32", "qwen3_moe", num_experts=32, num_experts_per_tok=8,
                             moe_intermediate_size=64, num_hidden_layers=3)
        spec = Checkpoint.open(str(model)).spec
        profile = counted_profile(open_engine, model)
        print("| regime | device budget | kernels predicted | counted | submissions predicted | counted |")
        print("|---|---|---|---|---|---|")
        for name, budget in REGIMES:
            cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=4, num_batches=2,
                            batching="static", device_memory=budget, host_memory=1 << 32)
            plan = make_plan(as_shape(spec), profile, device_memory=budget, host_memory=1 << 32, prompt_len=32,
                             longest_prompt=40, gen_len=8, config=cfg)
            reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list, a passage", messages=None,
                            max_new_tokens=6) for i in range(8)]
            kernels, submissions = decode_layer_counts(open_engine, cfg, reqs, engine_placement(plan, spec))
            want = plan.per_layer
            print(f"| {name} | {budget:,} B | {want['kernels']['decode']:.1f} | {kernels:.1f} "
                  f"({kernels / want['kernels']['decode'] - 1:+.1%}) | {want['submissions']['decode']:.2f} "
                  f"| {submissions:.2f} |")


if __name__ == "__main__":
    main()
