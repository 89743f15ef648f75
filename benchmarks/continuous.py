"""Continuous against static batching on a job whose max_new_tokens are heavy-tailed.

    python benchmarks/continuous.py [--prompts 128] [--bs 8] [--n 2] [--link-gbps 2]

The first `--prompts` wikitext prompts; three quarters ask for 4–16 new tokens, a few for
128–256, the rest 16–64 (seeded, in the job file). Both runs use the same model, batch size,
batch count, device budget (small enough that experts and KV live on the host and cross the
link) and emulated link, each in its own `klotski generate` process (the order
alternates per repeat); the script checks that every record's tokens are the same in both
and writes benchmarks/results/continuous.json. A record that ends at EOS before its limit
counts as it is, in both runs alike.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate  # noqa: E402


def heavy_tailed(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    few = max(2, count // 32)
    short = (3 * count) // 4
    lengths = ([rng.randint(128, 256) for _ in range(few)] + [rng.randint(4, 16) for _ in range(short)]
               + [rng.randint(16, 64) for _ in range(count - few - short)])
    rng.shuffle(lengths)
    return lengths


def write_job(count: int, out: Path) -> list[int]:
    lines = (ROOT / "jobs" / "wikitext.jsonl").read_text().splitlines()[:count]
    limits = heavy_tailed(len(lines))
    out.write_text("".join(json.dumps({"id": json.loads(l)["id"], "prompt": json.loads(l)["prompt"],
                                       "max_new_tokens": m}) + "\n" for l, m in zip(lines, limits)))
    return limits


def _median(values):
    """The median, or None where a report had no such figure."""
    values = list(values)
    return None if None in values else statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device-memory", type=int, default=7_000_000,
                    help="bytes; the default puts tiny-mixtral's experts and KV cache on the host (the plan is in the report)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "continuous.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-continuous-"))
    jobs = tmp / "jobs.jsonl"
    limits = write_job(a.prompts, jobs)
    budget = a.device_memory
    common = ["--model", a.model, "--device-memory", str(budget), "--batch-size", str(a.bs), "--num-batches", str(a.n),
              "--emulate-link", str(a.link_gbps), "--dtype", "float32"]
    runs: dict[str, list[dict]] = {"static": [], "continuous": []}
    tokens: dict[str, dict] = {}
    for r in range(a.repeats):
        for mode in (("static", "continuous") if r % 2 == 0 else ("continuous", "static")):
            report = generate(jobs, tmp / f"{mode}{r}.json", common + ["--batching", mode, "--include-token-ids"])
            output = tmp / f"{mode}{r}.out.jsonl"  # where common.generate writes the records
            tokens[mode] = {rec["id"]: rec["token_ids"] for rec in map(json.loads, output.read_text().splitlines())}
            runs[mode].append({
                "tokens_per_s": report["tokens_per_s"], "decode_s": report["decode_s"], "prefill_s": report["prefill_s"],
                "generated": report["tokens"]["generated"],
                "decode_tokens_per_s": report["tokens"]["generated"] / report["decode_s"],
                "slot_utilisation": report["decode_slot_utilisation"], "occupancy": report["decode_occupancy"],
                "wall_s": report["wall_s"], "predicted_tokens_per_s": report["predicted_tokens_per_s"],
                "replayed_tokens_per_s": report["replayed_tokens_per_s"],
                "batching": report["batching"], "output": str(output)})
            print(mode, json.dumps(runs[mode][-1]), flush=True)
    same = tokens["static"] == tokens["continuous"]
    keys = ("tokens_per_s", "decode_tokens_per_s", "slot_utilisation", "occupancy", "wall_s",
            "predicted_tokens_per_s", "replayed_tokens_per_s")
    med = {m: {k: _median(x[k] for x in v) for k in keys} for m, v in runs.items()}
    for m in med.values():  # the planner's rate for the job against the measured one (issue 14, part 3)
        m["predicted_over_measured"] = (m["predicted_tokens_per_s"] / m["tokens_per_s"]
                                        if m["predicted_tokens_per_s"] is not None else None)
    result = {"model": a.model, "device_memory": budget, "prompts": a.prompts, "bs": a.bs, "n": a.n, "link_gbps": a.link_gbps,
              "max_new_tokens": {"min": min(limits), "median": statistics.median(limits), "max": max(limits),
                                 "total": sum(limits)},
              "identical_tokens": same, "median": med, "runs": runs,
              "decode_speedup": med["continuous"]["decode_tokens_per_s"] / med["static"]["decode_tokens_per_s"],
              "end_to_end_speedup": med["continuous"]["tokens_per_s"] / med["static"]["tokens_per_s"]}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("identical_tokens", "median", "decode_speedup", "end_to_end_speedup")},
                     indent=2))


if __name__ == "__main__":
    main()
