"""Op counts of the fine-grained job (issue 45) with every expert streamed from host memory, at
the planner's minimum device budget for that placement and at 12 MiB, 128 against 8 experts
(top-8, equal FLOPs per token): the expert pool's measure (docs/benchmarks.md).

    python benchmarks/pool_ops.py [--budgets BYTES ...] [--out PATH] [--quantize hqq4] [--lines N --tokens N]

The minimum is the least device budget (to a KiB) at which the planner's working set in its
"minimum" mode, beside the exact resident bytes, holds one expert slot
(planning.expert_pool_slots); without --budgets it is found per model and 12 MiB added.
Counts do not depend on the machine's load; `--budgets` runs given ones (e.g. on an older
commit, which lacks the function that finds the minimum). `--quantize hqq4`: experts packed
(HQQ 4-bit, quantized into a temporary directory), the packed pool's measure."""
import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from klotski.assemble import open_engine
from klotski.measure.op_count import build_fine_and_coarse, job_ops

PROMPT = "item {i} of the list, a passage about things"


def minimum_budget(model) -> int:
    """The least device budget whose planned working set holds one expert slot (KiB steps)."""
    from klotski.bench.pool_budget import pool_minimum_budget
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.requests import Request
    from placement.placement import Placement
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=8, num_batches=4)
    keys = Checkpoint.open(str(model)).spec.group_keys()
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=PROMPT.format(i=i), messages=None, max_new_tokens=24)
            for i in range(32)]
    return pool_minimum_budget(cfg, reqs, Placement.by_kind(keys, expert="host"))


def tokens_digest(outputs: dict) -> str:
    """One digest of every line's tokens (the same before and after: the tokens did not change)."""
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="*")
    p.add_argument("--out", type=Path)
    p.add_argument("--quantize", default="none")
    p.add_argument("--lines", type=int, default=32)
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = build_fine_and_coarse(Path(tmp))
        for e, model in models.items():
            budgets = args.budgets or [minimum_budget(model), 12 << 20]
            for b in budgets:
                packed = {} if args.quantize == "none" else {"quantize": args.quantize,
                                                              "offload_dir": str(Path(tmp) / f"q{e}")}
                ops = job_ops(open_engine, model, experts_on_host=True, device_memory=b, lines=args.lines, tokens=args.tokens,
                              **packed)
                rows[f"{e} experts, {b} bytes"] = {"ops": ops["ops"], "kernels": ops["kernels"],
                                                   "outputs_sha256": tokens_digest(ops["outputs"])}
                print(f"{e} experts, device budget {b}: {ops['ops']} ops, {ops['kernels']} kernels", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
