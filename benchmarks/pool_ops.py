"""Op counts of the fine-grained job (issue 45) with every expert streamed from host memory, at
the planner's minimum device budget for that placement and at 12 MiB, 128 against 8 experts
(top-8, equal FLOPs per token): the expert pool's measure (docs/benchmarks.md).

    python benchmarks/pool_ops.py [--budgets BYTES ...] [--out PATH]

The minimum is the least device budget (to a KiB) at which the planner's working set in its
"minimum" mode, beside the exact resident bytes, holds one expert slot
(planning.expert_pool_slots); without --budgets it is found per model and 12 MiB added.
Counts do not depend on the machine's load; `--budgets` runs given ones (e.g. on an older
commit, which lacks the function that finds the minimum)."""
import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from klotski.bench.op_count import build_fine_and_coarse, job_ops

PROMPT = "item {i} of the list, a passage about things"


def minimum_budget(model) -> int:
    """The least device budget whose planned working set holds one expert slot (KiB steps)."""
    from klotski import planning
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.requests import Request
    from klotski.schedule.sequences import prepare
    from placement.placement import Placement
    from placement.tiers import detect_budgets
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=8, num_batches=4)
    ckpt = Checkpoint.open(str(model))
    seqs, _ = prepare([Request(id=f"r{i}", line=i + 1, prompt=PROMPT.format(i=i), messages=None, max_new_tokens=24)
                       for i in range(32)], ckpt.tokenizer, ckpt.spec, cfg)
    placement = Placement.by_kind(ckpt.spec.group_keys(), expert="host")
    budgets = detect_budgets("cpu", None, None)
    longest = max(len(s.prompt_ids) for s in seqs)

    def slots(b):
        return planning.expert_pool_slots(cfg, ckpt, torch.float32, dataclasses.replace(budgets, device=b), placement,
                                          bs=8, n=4, chunk=None, longest_prompt=longest, gen_len=24)
    lo, hi = 0, 64 << 20
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if slots(mid) else (mid, hi)
    return -(-hi // 1024) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="*")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = build_fine_and_coarse(Path(tmp))
        for e, model in models.items():
            budgets = args.budgets or [minimum_budget(model), 12 << 20]
            for b in budgets:
                ops = job_ops(model, experts_on_host=True, device_memory=b)
                rows[f"{e} experts, {b} bytes"] = {"ops": ops["ops"], "kernels": ops["kernels"],
                                                   "outputs": ops["outputs"]}
                print(f"{e} experts, device budget {b}: {ops['ops']} ops, {ops['kernels']} kernels", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
