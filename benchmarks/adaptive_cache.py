"""Issue 64, items 2 and 3: the device's resident experts divided among layers by each layer's
hits (--expert-split dp|even) and prefetches that yield the link to demand loads at chunk
boundaries (--transfer-chunk-ms, 0 = whole transfers), on an offloaded Mixtral-shaped random
model with an emulated link, at a device budget whose plan keeps about a third of the experts
resident.

    python benchmarks/adaptive_cache.py [--budget 126MB] [--reps 2] [--out benchmarks/results/adaptive-cache.json]
    python benchmarks/adaptive_cache.py --only chunk --extra=--hot-experts=4 --out .../adaptive-cache-hot4.json

The model: the `small` preset (hidden 256, 8 experts top-2) at 8 layers, skewed routing (a few
experts take most tokens, deeper layers flatter), fp32, 155 MB. A first run teaches the model's
correlation table (the routing the split is divided by); then the four configurations run in
turn, `--reps` rounds, each in its own process; each row is the median of its rounds, with the
load average before each run beside it. Token ids are compared across every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402

CONFIGS = {  # name -> (--expert-split, --transfer-chunk-ms)
    "even, whole transfers": ("even", "0"),
    "dp, whole transfers": ("dp", "0"),
    "even, chunked": ("even", "0.25"),
    "dp, chunked": ("dp", "0.25"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="97MB")
    ap.add_argument("--link", default="1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", choices=("all", "chunk", "split"), default="all",
                    help="chunk: only the two dp rows, whole transfers against chunked; split: only the two "
                         "chunked rows, even against dp")
    ap.add_argument("--no-teach", action="store_true", help="the model's correlation table has seen the job already")
    ap.add_argument("--extra", default="", help="more generate flags, comma-separated (e.g. --hot-experts=4)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adaptive-cache.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from klotski.builtin import tiny
    work = Path(a.work or tempfile.mkdtemp(prefix="klotski-h64-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        tiny.build_checkpoint(model, "small", routing="skewed", dtype="float32", num_hidden_layers=8)
    jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", a.prompts, work / "jobs.jsonl")
    common = ["--model", str(model), "--emulate-link", a.link, "--device-memory", a.budget, "--host-memory", "8GiB",
              "--max-new-tokens", str(a.new), "--dtype", "float32", "--include-token-ids"]
    common += [x for x in a.extra.split(",") if x]
    configs = {k: v for k, v in CONFIGS.items()
               if a.only == "all" or (a.only == "chunk" and k.startswith("dp")) or (a.only == "split" and v[1] != "0")}
    if not a.no_teach:  # teaches the correlation table (without one yet, the split is even)
        first = generate(jobs, work / "first.json", common)
        print(f"teaching run: {first['tokens_per_s']} tok/s, split {first['experts']['split']}", flush=True)
    runs: dict = {name: [] for name in configs}
    tokens = {}
    for rep in range(a.reps):
        for name, (split, chunk) in configs.items():
            load = os.getloadavg()[0]
            report = generate(jobs, work / f"{rep}-{split}-{chunk}.json",
                              common + ["--expert-split", split, "--transfer-chunk-ms", chunk])
            out = work / f"{rep}-{split}-{chunk}.out.jsonl"
            tokens[name, rep] = [json.loads(l).get("token_ids") for l in out.read_text().splitlines()]
            report["load_before"], report["load_after"] = load, os.getloadavg()[0]
            runs[name].append(report)
            link, experts = report["link"], report["experts"]
            print(f"{name:24s} rep {rep}: {report['tokens_per_s']:7.2f} tok/s  hit {experts['hit_rate']}  "
                  f"demand wait {link['demand_wait_s']} s p99 {link['demand_wait_p99_ms']} ms  "
                  f"bubble {report['bubble']['decode_share']}  load {load:.1f}", flush=True)
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    med = lambda xs: round(statistics.median(xs), 4)
    rows = {}
    for name, reports in runs.items():
        r0 = reports[0]
        rows[name] = {
            "tokens_per_s": med([r["tokens_per_s"] for r in reports]),
            "decode_s": med([r["decode_s"] for r in reports]),
            "resident_hit_rate": r0["experts"]["hit_rate"],
            "hit_rate_per_layer": r0["experts"]["hit_rate_per_layer"],
            "resident_per_layer": r0["experts"]["resident_per_layer"],
            "split": r0["experts"]["split"],
            "experts_loaded": med([r["io"]["experts_loaded"] for r in reports]),
            "demand_loads": med([r["link"]["demand_loads"] for r in reports]),
            "demand_wait_s": med([r["link"]["demand_wait_s"] for r in reports]),
            "demand_wait_p50_ms": med([r["link"]["demand_wait_p50_ms"] for r in reports]),
            "demand_wait_p99_ms": med([r["link"]["demand_wait_p99_ms"] for r in reports]),
            "prefetch_yields": med([r["link"]["prefetch_yields"] for r in reports]),
            "bubble_decode_share": med([r["bubble"]["decode_share"] for r in reports]),
            "bubble_s": med([r["bubble"]["seconds"] for r in reports]),
            "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
            "demand_wait_s_runs": [r["link"]["demand_wait_s"] for r in reports],
            "bubble_decode_share_runs": [r["bubble"]["decode_share"] for r in reports],
            "load_before": [r["load_before"] for r in reports],
            "load_after": [r["load_after"] for r in reports],
            "placement": r0["plan"]["placement"],
        }
    result = {"budget": a.budget, "link_gbps": a.link, "extra": a.extra, "prompts": a.prompts, "new_tokens": a.new, "reps": a.reps,
              "tokens_identical_across_runs": same, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {m: v for m, v in r.items() if m not in ("placement", "hit_rate_per_layer")}
                      for k, r in rows.items()}, indent=1))
    print("tokens identical across runs:", same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
