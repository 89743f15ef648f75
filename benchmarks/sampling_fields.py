"""What the sampling fields cost: decode tokens/s with every field set against none, 64 rows.

    python benchmarks/sampling_fields.py [--model small-mixtral] [--rows 64] [--max-tokens 48] [--repeats 3]

Two jobs of the same `--rows` wikitext prompts, one batch of that many rows, each line asking
for exactly `--max-tokens` tokens (`ignore_eos` in both, so both decode the same number of
steps): "none" sets nothing else (greedy); "every" sets temperature, top_p, top_k, min_p,
repetition, presence and frequency penalties, logit_bias, min_tokens and a seed. Each run is
its own `klotski generate` process, the two alternating; medians side by side. Then, in this
process, the cost of one step's pick (`schedule/sampling.pick`: the batched processing and
the draw) for the same rows over wider vocabularies (32k, Llama/Mixtral; 152k, Qwen3), so
the cost at a real model's vocabulary is on record too. The machine's load (`uptime`) is
printed before and after. Writes benchmarks/results/sampling_fields.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate  # noqa: E402

EVERY = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
         "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {"5": 2.0, "9": -3.0, "11": 1.5},
         "min_tokens": 8, "seed": 1}


def jobs(rows: int, max_tokens: int, tmp: Path) -> dict[str, Path]:
    prompts = [json.loads(x) for x in (ROOT / "jobs" / "wikitext.jsonl").read_text().splitlines()[:rows]]
    out = {}
    for mode, extra in (("none", {}), ("every", EVERY)):
        out[mode] = tmp / f"{mode}.jsonl"
        out[mode].write_text("".join(json.dumps({"id": p["id"], "prompt": p["prompt"], "max_tokens": max_tokens,
                                                 "ignore_eos": True, **extra}) + "\n" for p in prompts))
    return out


def pick_cost(rows: int, vocab: int, repeats: int = 15) -> dict:
    """Median seconds of one step's pick over [rows, vocab] logits, every field set / none."""
    import torch
    from klotski.schedule.sampling import pick
    from klotski.schedule.sequences import Sequence

    def batch(every: bool) -> list:
        fields = dict(top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                      logit_bias=((5, 2.0), (9, -3.0), (11, 1.5)), min_tokens=8) if every else {}
        return [Sequence(None, list(range(100 + i, 400 + i)), 64, 0.8 if every else 0.0, 0.9 if every else 1.0, (),
                         torch.Generator().manual_seed(i) if every else None, out=list(range(i, i + 32)), **fields)
                for i in range(rows)]
    logits = torch.randn(rows, vocab)
    out = {}
    for mode in ("none", "every"):
        b = batch(mode == "every")
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            pick(b, logits, {0})
            times.append(time.perf_counter() - t)
        out[mode] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-mixtral")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampling_fields.json"))
    a = ap.parse_args()
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(load[0], flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="klotski-sampling-"))
    paths = jobs(a.rows, a.max_tokens, tmp)
    args = ["--model", a.model, "--batch-size", str(a.rows), "--num-batches", "1", "--dtype", "float32"]
    generate(paths["none"], tmp / "warmup.json", args)  # (profiles and the model built once, not timed)
    runs: dict[str, list[dict]] = {"none": [], "every": []}
    for r in range(a.repeats):
        for mode in ("none", "every") if r % 2 == 0 else ("every", "none"):
            report = generate(paths[mode], tmp / f"{mode}{r}.json", args)
            generated = report["tokens"]["generated"]
            runs[mode].append({"generated": generated, "decode_s": report["decode_s"],
                               "decode_tokens_per_s": generated / report["decode_s"],
                               "decode_step_ms": 1000 * report["decode_s"] / (generated / a.rows)})
            print(mode, json.dumps(runs[mode][-1]), flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("decode_tokens_per_s", "decode_step_ms", "generated")}
           for m, v in runs.items()}
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.registry import resolve
    vocab = Checkpoint.open(str(resolve(a.model))).spec.shape.vocab_size
    picks = {v: pick_cost(a.rows, v) for v in (vocab, 32000, 151936)}
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    result = {"model": a.model, "rows": a.rows, "max_tokens": a.max_tokens, "fields": EVERY, "median": med,
              "ratio_decode_tokens_per_s": med["every"]["decode_tokens_per_s"] / med["none"]["decode_tokens_per_s"],
              "pick_ms": {str(v): {m: 1000 * s for m, s in p.items()} for v, p in picks.items()},
              "pick_share_of_decode_step": {str(v): p["every"] * 1000 / med["none"]["decode_step_ms"]
                                            for v, p in picks.items()},
              "runs": runs, "uptime": load}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median", "ratio_decode_tokens_per_s", "pick_ms",
                                             "pick_share_of_decode_step", "uptime")}, indent=2))


if __name__ == "__main__":
    main()
