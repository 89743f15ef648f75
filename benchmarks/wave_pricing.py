"""The planner's predicted prefill and decode seconds against a run's, for 8 and 128 experts at
equal FLOPs (issue: the planner prices the expert phase as the engine runs it, in waves). The
two Qwen3-shaped models of benchmarks/fine_grained.py (128 experts top-8 and 8 experts top-8,
each 128 wide; klotski.measure.op_count.build_fine_and_coarse) run the same 32-line job, 24 new
tokens a line, 4 batches of 8, in fp32 (the engine's thread count), every expert resident and every expert
streamed through a 12 MiB device budget. Each row is the median of --repeats runs of
`klotski generate`; "predicted" is the report's replay of its own plan over the lengths the
answers had (`replayed_prefill_s`, `replayed_decode_s`), so only the cost model's error is left.

    python benchmarks/wave_pricing.py [--repeats 3] [--profiles DIR] [--out benchmarks/results/wave_pricing.json]

`--profiles DIR` plans every run with one saved profile per model (`DIR/<experts>.json`, measured
here with the pipeline's cost and written first where missing): two trees then price the same
measurements, which a shared machine's noise otherwise keeps apart.

The CLI runs as a subprocess with this process's PYTHONPATH, so pointing it at another tree
measures that tree's planner on the same models (run it from outside either tree: `python -m`
puts the working directory first). The models are built in --models (kept, so a
profile measured for their shapes is measured once for both trees' runs)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from klotski.measure.op_count import COARSE, FINE, build_fine_and_coarse

REGIMES = {"resident": [], "streamed 12 MiB": ["--device-memory", "12MiB"]}
FIELDS = ("replayed_prefill_s", "prefill_s", "replayed_decode_s", "decode_s")
# `klotski generate` with the planner's profile fixed to the saved one (KLOTSKI_BENCH_PROFILE)
FIXED = ("import os, sys; from planner.profile import Profile; from klotski import planning; "
         "saved = Profile.from_json(open(os.environ['KLOTSKI_BENCH_PROFILE']).read()); "
         "planning.measure_here = lambda shape, **kw: saved; from klotski.cli.main import main; "
         "sys.exit(main(sys.argv[1:]))")


def _saved_profile(model: Path, where: Path) -> Path:
    """The profile the runs of `model` plan with: saved in `where`, or measured here first."""
    import dataclasses

    from klotski import assemble, planning
    from klotski.io.checkpoint import Checkpoint
    from planner.shapes import as_shape
    path = where / f"{model.name}.json"
    if not path.exists():  # planned in the runs' dtype, as klotski.planning does
        shape = dataclasses.replace(as_shape(Checkpoint.open(str(model)).spec), dtype="float32")
        where.mkdir(parents=True, exist_ok=True)
        path.write_text(planning.measure_here(shape, device="cpu", pipeline_cost=assemble.pipeline_cost).to_json())
    return path


def _run(model: Path, flags: list[str], tmp: Path, tag: str, profile: Path | None = None) -> dict:
    jobs = tmp / "jobs.jsonl"
    if not jobs.exists():
        jobs.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"item {i} of the list, a passage about things",
                                            "max_new_tokens": 24}) + "\n" for i in range(32)))
    report = tmp / f"{tag}.report.json"
    start = [sys.executable, "-c", FIXED] if profile else [sys.executable, "-m", "klotski.cli.main"]
    cmd = [*start, "generate", str(jobs), "--model", str(model), "--device", "cpu",
           "--dtype", "float32", "--batch-size", "8", "--num-batches", "4", "--no-progress",
           "--no-resume", "-o", str(tmp / f"{tag}.out.jsonl"), "--report", str(report), *flags]
    env = os.environ | ({"KLOTSKI_BENCH_PROFILE": str(profile)} if profile else {})
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(report.read_text())
    return {k: r[k] for k in FIELDS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wave_pricing.json")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "klotski-wave-pricing")
    p.add_argument("--profiles", type=Path, help="plan with one saved profile per model (written first if missing)")
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {e: args.models / f"qwen3-{e}" for e in (FINE, COARSE)}
        if not all((m / "config.json").exists() for m in models.values()):
            models = build_fine_and_coarse(args.models)
        for regime, flags in REGIMES.items():
            for e, model in models.items():
                profile = _saved_profile(model, args.profiles) if args.profiles else None
                runs = [_run(model, flags, tmp, f"{e}-{i}", profile) for i in range(args.repeats)]
                rows[f"{regime}, {e} experts"] = {k: statistics.median(r[k] for r in runs) for k in FIELDS}
    print("| regime, model | prefill predicted | prefill measured | decode predicted | decode measured |\n"
          "|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['replayed_prefill_s']:.3f} | {r['prefill_s']:.3f} | {r['replayed_decode_s']:.3f} "
              f"| {r['decode_s']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
