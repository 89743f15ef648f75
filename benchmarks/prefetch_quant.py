"""Prefetchers and quantization on a skewed-routing model (issue 5).

Builds `medium` with `--routing skewed` (Zipf-like, layer-correlated expert popularity),
then runs `klotski generate` for every `--prefetch` and `--quantize` setting, each in its
own process, round-robin after a warm-up, and prints medians as a Markdown table with the
prefetch metrics and host->device bytes per generated token.

    python benchmarks/prefetch_quant.py --link 2 --reps 2 --n 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate, write_jobs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--jobs", default=str(ROOT / "jobs/wikitext.jsonl"))
    ap.add_argument("--link", type=float, default=2.0)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device-memory", default="900MB")
    ap.add_argument("--host-memory", default="8GiB")
    ap.add_argument("--prefetch", default="none,next-gate,correlation")
    ap.add_argument("--quantize", default="none,hqq4")
    ap.add_argument("--json")
    a = ap.parse_args()
    from klotski.util import cachedir
    from klotski.builtin.tiny import build_checkpoint
    model = cachedir.models() / f"{a.preset}-mixtral-skewed"
    if not (model / "config.json").exists():
        build_checkpoint(model, a.preset, routing="skewed")
    tmp = Path(tempfile.mkdtemp())
    jobs = tmp / "jobs.jsonl"
    write_jobs(a.jobs, a.bs * a.n, jobs)
    configs = [(p, q) for q in a.quantize.split(",") for p in a.prefetch.split(",")]
    runs = {c: [] for c in configs}
    for rep in range(a.reps + 1):  # rep 0 warms up (and builds tables / quantized copies)
        for prefetch, quant in configs:
            r = generate(jobs, tmp / f"{prefetch}-{quant}.json",
                         ["--model", str(model), "--include-token-ids", "--batch-size", str(a.bs),
                          "--num-batches", str(a.n), "--max-new-tokens", str(a.max_new_tokens), "--emulate-link",
                          str(a.link), "--device-memory", a.device_memory, "--host-memory", a.host_memory,
                          "--prefetch", prefetch, "--quantize", quant])
            print(f"rep {rep} {prefetch:12s} {quant:5s} {r['tokens_per_s']:7.2f} tok/s", file=sys.stderr)
            if rep:
                runs[(prefetch, quant)].append(r)
    base = {json.loads(l)["id"]: json.loads(l)["token_ids"]
            for l in (tmp / "none-none.out.jsonl").read_text().splitlines()} if ("none", "none") in runs else {}
    print(f"| prefetch | quantize | tokens/s (median of {a.reps}) | spread | bubble | precision | hot accuracy "
          f"| served share | H2D MB per token | greedy = unquantized |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for (prefetch, quant), rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        pf = rs[-1]["prefetch"]
        mb = rs[-1]["io"]["bytes"].get("host_to_device", 0) / 1e6 / max(1, rs[-1]["tokens"]["generated"])
        ids = {json.loads(l)["id"]: json.loads(l)["token_ids"]
               for l in (tmp / f"{prefetch}-{quant}.out.jsonl").read_text().splitlines()}
        same = sum(ids[k] == v for k, v in base.items()) if base else None
        print(f"| {prefetch} | {quant} | {statistics.median(tps):.2f} | {min(tps):.2f}–{max(tps):.2f} "
              f"| {statistics.median(r['bubble']['share'] for r in rs):.2f} | {pf.get('precision')} "
              f"| {pf.get('hot_accuracy')} | {pf.get('served_share')} | {mb:.1f} | {same}/{len(base)} |")
        out.append({"prefetch": prefetch, "quantize": quant, "tokens_per_s": tps, "prefetch_metrics": pf,
                    "h2d_mb_per_token": mb, "same_tokens_as_unquantized": same})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
