"""Quality of bf16, HQQ 4-bit and sparse attention on a *trained* model (`smollm2-moe`).

The tiny presets have random weights, so agreement and perplexity measured on them say
little. `smollm2-moe` is SmolLM2-135M-Instruct upcycled into a Mixtral (klotski/builtin/smollm.py),
whose greedy output is the trained dense model's; this script measures on it:

* Greedy agreement with the fp32 run, all through `klotski generate` (one process each):
  the first `--prompts` passages of jobs/wikitext.jsonl as chat messages
  "Summarize this passage in one short sentence.\\n\\n<passage>", `--new-tokens` each.
  Variants: `--dtype bfloat16` (the fp32 `smollm2-moe` checkpoint cast to bf16 at load,
  not the separate `smollm2-moe-bf16` checkpoint; same weights, as that one is the
  cast of this one), `--quantize hqq4` with fp32 compute, and `--attention sink:4,window:32`
  with fp32 compute. Per variant: prompts whose completion is token-identical to fp32,
  the share of token positions that agree (over the longer of the two completions of
  each prompt, a missing token counting as a disagreement; `token_agreement_min_len`
  is quant_quality.py's measure, over the shorter), and the mean identical prefix.
* Perplexity with transformers on held-out text, passages `--ppl-start`.. of
  jobs/wikitext.jsonl (0-based line indices; default 100-163, ids wt-0101..wt-0164),
  each passage scored on its own as plain text: fp32 (`dtype=torch.float32`), bf16
  (`dtype=torch.bfloat16`) and HQQ 4-bit (fp32 with every attention and expert
  projection replaced by dequantize(quantize(W)), quant_quality.py's `quantize_model`).

Every process runs with `--threads` intra-op threads (default 1: on a shared 2-core box,
all-core OpenMP ran 3x slower than one thread here).

    XDG_CACHE_HOME=/tmp/smolcache .venv/bin/python benchmarks/real_quality.py \\
        --json benchmarks/results/real-quality.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import child_env, code_state, machine_info  # noqa: E402
from common import ROOT, generate  # noqa: E402

MODEL = "smollm2-moe"
INSTRUCTION = "Summarize this passage in one short sentence.\n\n"
VARIANTS = {  # label -> extra `klotski generate` flags (the reference is "fp32")
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "hqq4": ["--dtype", "float32", "--quantize", "hqq4"],
    "sink4-window32": ["--dtype", "float32", "--attention", "sink:4,window:32"],
}


def passages(start: int, count: int) -> list[dict]:
    lines = (ROOT / "jobs/wikitext.jsonl").read_text().splitlines()[start:start + count]
    return [json.loads(l) for l in lines]


def write_chat_jobs(count: int, new_tokens: int, out: Path) -> Path:
    """The first `count` passages as one-turn chat jobs asking for a one-sentence summary."""
    out.write_text("".join(json.dumps({"id": p["id"], "messages": [{"role": "user", "content": INSTRUCTION + p["prompt"]}],
                                       "max_new_tokens": new_tokens}) + "\n" for p in passages(0, count)))
    return out


def read_tokens(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["token_ids"] for r in map(json.loads, Path(path).read_text().splitlines())}


def agreement(ref: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    ids = sorted(ref)
    same = union = total_min = 0
    prefix = []
    for i in ids:
        a, b = ref[i], other.get(i, [])
        hits = sum(x == y for x, y in zip(a, b))
        same += hits
        union += max(len(a), len(b))
        total_min += min(len(a), len(b))
        prefix.append(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {
        "identical_sequences": sum(ref[i] == other.get(i) for i in ids), "prompts": len(ids),
        "token_agreement": round(same / union, 4) if union else None,
        "token_agreement_min_len": round(same / total_min, 4) if total_min else None,
        "mean_identical_prefix": round(sum(prefix) / len(prefix), 2),
        "mean_tokens_fp32": round(sum(len(ref[i]) for i in ids) / len(ids), 2),
        "mean_tokens": round(sum(len(other.get(i, [])) for i in ids) / len(ids), 2),
    }


def run_klotski(jobs: Path, work: Path) -> dict:
    runs = {}
    for label, flags in VARIANTS.items():
        report = work / f"{label}.report.json"
        t0 = time.perf_counter()
        try:
            rep = generate(jobs, report, ["--model", MODEL, "--include-token-ids"] + flags)
            runs[label] = {"flags": flags, "process_s": round(time.perf_counter() - t0, 1),
                           "tokens_per_s": rep["tokens_per_s"], "out": str(report.with_suffix(".out.jsonl"))}
        except subprocess.CalledProcessError as e:  # report the failure, keep the others
            err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
            runs[label] = {"flags": flags, "process_s": round(time.perf_counter() - t0, 1),
                           "error": err[-1] if err else f"exit {e.returncode}", "stderr_tail": err[-15:]}
        print(f"klotski {label}: {runs[label].get('error') or 'ok'} ({runs[label]['process_s']} s)", flush=True)
    return runs


def run_perplexity(texts: list[str], threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quant_quality  # noqa: E402  (benchmarks/quant_quality.py: quantize_model, perplexity)
    from klotski.compress import hqq as quant
    from klotski.builtin.smollm import ensure

    torch.set_num_threads(threads)
    model_dir = ensure(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("hqq4", torch.float32)):
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if label == "hqq4":
            quant_quality.quantize_model(model, quant.QuantSpec())
        out[label] = {"perplexity": round(quant_quality.perplexity(model, tok, texts), 4),
                      "seconds": round(time.perf_counter() - t0, 1)}
        print(f"perplexity {label}: {out[label]['perplexity']} ({out[label]['seconds']} s)", flush=True)
        del model
    out["scored_tokens"] = sum(len(tok(t)["input_ids"]) - 1 for t in texts)
    return out


def markdown(summary: dict) -> str:
    rows = ["| variant | identical completions | token agreement | mean identical prefix | perplexity |",
            "|---|---|---|---|---|"]
    ppl = summary["perplexity"]
    n, new = summary["prompts"], summary["new_tokens"]
    for label in VARIANTS:
        run = summary["klotski"][label]
        p = ppl.get(label, {}).get("perplexity", "—") if ppl else "—"
        if label == "fp32":
            mean = next((a["mean_tokens_fp32"] for a in summary["agreement"].values()), "—")
            rows.append(f"| fp32 (reference) | {n}/{n} | 100% | (mean length {mean}) | {p} |")
            continue
        if "error" in run:
            rows.append(f"| {label} | failed: {run['error']} | | | {p} |")
            continue
        a = summary["agreement"][label]
        rows.append(f"| {label} | {a['identical_sequences']}/{n} | {a['token_agreement']:.1%} | "
                    f"{a['mean_identical_prefix']} of ≤{new} tokens | {p} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--ppl-start", type=int, default=100)
    ap.add_argument("--ppl-count", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument("--work", help="folder for jobs and outputs (default: a temporary one)")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    os.environ.update(child_env(a.threads))  # every `klotski generate` child inherits it
    t_start = time.perf_counter()
    work = Path(a.work or tempfile.mkdtemp(prefix="real-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = write_chat_jobs(a.prompts, a.new_tokens, work / "jobs.jsonl")

    runs = run_klotski(jobs, work)
    agree = {}
    if "error" not in runs["fp32"]:
        ref = read_tokens(Path(runs["fp32"]["out"]))
        for label in VARIANTS:
            if label != "fp32" and "error" not in runs[label]:
                agree[label] = agreement(ref, read_tokens(Path(runs[label]["out"])))
    held_out = passages(a.ppl_start, a.ppl_count)
    ppl = None if a.skip_perplexity else run_perplexity([p["prompt"] for p in held_out], a.threads)

    summary = {
        "model": MODEL, "prompts": a.prompts, "new_tokens": a.new_tokens,
        "job": f"chat: {INSTRUCTION!r} + passage, jobs/wikitext.jsonl lines 1-{a.prompts}",
        "bf16_variant": "fp32 smollm2-moe checkpoint with --dtype bfloat16 (weights cast at load)",
        "agreement_definition": "token_agreement: equal tokens at the same position / sum over prompts of the "
                                "longer completion's length (EOS excluded, missing = disagree); "
                                "token_agreement_min_len: over the shorter, as quant_quality.py",
        "agreement": agree,
        "perplexity_text": {"passages": f"jobs/wikitext.jsonl[{a.ppl_start}:{a.ppl_start + a.ppl_count}]",
                            "ids": [held_out[0]["id"], held_out[-1]["id"]] if held_out else None,
                            "method": "transformers MixtralForCausalLM, each passage scored alone, exp(mean NLL)"},
        "perplexity": ppl,
        "klotski": {k: {x: v for x, v in r.items() if x != "out"} for k, r in runs.items()},
        "threads": a.threads,
        "total_s": round(time.perf_counter() - t_start, 1),
        "machine": machine_info(),
        "code": code_state(),
    }
    table = markdown(summary)
    summary["markdown"] = table
    print(table)
    print(json.dumps({k: summary[k] for k in ("agreement", "perplexity", "total_s")}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
