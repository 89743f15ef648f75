"""Host compute with the emulated link: attention beside a host KV cache, cold experts where
they live, each on and off, side by side.

    python benchmarks/host_compute.py [--prompts 16] [--max-new-tokens 32] [--bs 4] [--n 2]
                                      [--link-gbps 2] [--repeats 3]

Four runs per repeat (order rotating), each its own `klotski generate` process, at a device
budget too small for the model: off/off, `--host-attention on`, `--host-experts on`, both.
The planner places each configuration within that budget (host attention keeps the KV cache
on the host and frees the device of keys and scores; the placement is in each report). Reported per
configuration (medians over repeats): link bytes per generated token each way, tokens/s,
what host compute did (report["host_compute"]); every run's tokens must be identical.
Writes benchmarks/results/host-compute.json.
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

CONFIGS = {"off": ("off", "off"), "attention": ("on", "off"), "experts": ("off", "on"), "both": ("on", "on")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device-memory", type=int, default=7_000_000,
                    help="bytes; the default holds about half of tiny-mixtral's experts on the device")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host-compute.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-host-compute-"))
    jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", a.prompts, tmp / "jobs.jsonl")
    common = ["--model", a.model, "--device-memory", str(a.device_memory), "--batch-size", str(a.bs),
              "--num-batches", str(a.n), "--emulate-link", str(a.link_gbps), "--dtype", "float32",
              "--max-new-tokens", str(a.max_new_tokens), "--include-token-ids"]
    names = list(CONFIGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    tokens: dict[str, dict] = {}
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            attention, experts = CONFIGS[name]
            report = generate(jobs, tmp / f"{name}{r}.json",
                              common + ["--host-attention", attention, "--host-experts", experts])
            out = tmp / f"{name}{r}.out.jsonl"
            tokens.setdefault(name, {rec["id"]: rec["token_ids"] for rec in map(json.loads, out.read_text().splitlines())})
            gen = report["tokens"]["generated"]
            io = report["io"]["bytes"]
            runs[name].append({
                "tokens_per_s": report["tokens_per_s"], "generated": gen, "wall_s": report["wall_s"],
                "h2d_bytes_per_token": io.get("host_to_device", 0) / gen,
                "d2h_bytes_per_token": io.get("device_to_host", 0) / gen,
                "bubble_share": report["bubble"]["share"], "host_compute": report["host_compute"],
                "placement": report["plan"]["placement"]})
            print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "placement"}), flush=True)
    same = all(tokens[n] == tokens["off"] for n in names)
    keys = ("tokens_per_s", "h2d_bytes_per_token", "d2h_bytes_per_token", "bubble_share")
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
    result = {"model": a.model, "device_memory": a.device_memory, "prompts": a.prompts,
              "max_new_tokens": a.max_new_tokens, "bs": a.bs, "n": a.n, "link_gbps": a.link_gbps,
              "repeats": a.repeats, "identical_tokens": same, "median": med, "runs": runs}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"identical_tokens": same, "median": med}, indent=2))
    if not same:
        sys.exit("tokens differ between configurations")


if __name__ == "__main__":
    main()
