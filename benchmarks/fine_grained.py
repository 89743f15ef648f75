"""Fine-grained MoE at the cost of coarse (issue 45): two Qwen3-shaped models with equal FLOPs
per token — 128 experts top-8 and 8 experts top-8, each 128 wide — run the same 32-line job
(24 new tokens a line, 4 batches of 8). Per model and regime (every expert resident; every
expert streamed from host memory through a 12 MiB device budget): the ATen ops the compute
thread issues for the whole job (all, and kernels: not views), and decode seconds on one
thread (median of --repeats, timed without the op counter).

    python benchmarks/fine_grained.py [--repeats 3] [--load N] [--out benchmarks/results/fine_grained.json]

`--load N` also runs the 128-expert resident job beside N spinning processes, with the
thread count the engine picks (util/threads.py) and with 2 threads forced, and idle."""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from klotski.assemble import open_engine
from klotski.measure.op_count import COARSE, FINE, build_fine_and_coarse, job_ops

REGIMES = {"resident": dict(experts_on_host=False), "streamed 12 MiB": dict(experts_on_host=True, device_memory=12 << 20)}


def _decode_s(model, repeats: int, **kw) -> float:
    """Median decode seconds of `repeats` runs (the op counter off: it slows every op)."""
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.requests import Request
    from placement.placement import Placement
    keys = Checkpoint.open(str(model)).spec.group_keys()
    placement = Placement.by_kind(keys, expert="host" if kw.get("experts_on_host") else "device")
    times = []
    for _ in range(repeats):
        cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=8, num_batches=4,
                        device_memory=kw.get("device_memory"), threads=kw.get("threads", 1))
        reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list, a passage about things", messages=None,
                        max_new_tokens=24) for i in range(32)]
        engine, seqs, _ = open_engine(cfg, reqs, placement=placement)
        try:
            list(engine.run(seqs))
            times.append(engine.stats.decode_s)
            history = engine.threads.history if engine.threads else None
        finally:
            engine.close()
    return statistics.median(times), history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="spinning processes for the loaded-machine rows")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fine_grained.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = build_fine_and_coarse(Path(tmp))
        for regime, kw in REGIMES.items():
            for e, model in models.items():
                ops = job_ops(open_engine, model, **kw)
                rows[f"{regime}, {e} experts"] = {"ops": ops["ops"], "kernels": ops["kernels"],
                                                  "decode_s": _decode_s(model, args.repeats, **kw)[0]}
        if args.load:
            loaded = {"idle, threads auto": _decode_s(models[FINE], args.repeats, experts_on_host=False, threads=None)}
            spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
            try:
                time.sleep(2)
                loaded[f"load {args.load}, threads auto"] = _decode_s(models[FINE], args.repeats, experts_on_host=False,
                                                                      threads=None)
                loaded[f"load {args.load}, 2 threads"] = _decode_s(models[FINE], args.repeats, experts_on_host=False,
                                                                   threads=2)
            finally:
                for proc in spin:
                    proc.kill()
            rows["loaded"] = {k: {"decode_s": v[0], "threads": v[1]} for k, v in loaded.items()}
    print("| regime, model | ATen ops | kernels | decode s (1 thread) |\n|---|---|---|---|")
    for name, r in rows.items():
        if name != "loaded":
            print(f"| {name} | {r['ops']} | {r['kernels']} | {r['decode_s']:.3f} |")
    for regime in REGIMES:
        fine, coarse = rows[f"{regime}, {FINE} experts"], rows[f"{regime}, {COARSE} experts"]
        print(f"{regime}: {FINE}/{COARSE} ops {fine['ops'] / coarse['ops']:.2f}x, kernels "
              f"{fine['kernels'] / coarse['kernels']:.2f}x, decode {fine['decode_s'] / coarse['decode_s']:.2f}x")
    for name, r in rows.get("loaded", {}).items():
        print(f"128 experts resident, {name}: decode {r['decode_s']:.3f} s, threads {r['threads']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
