"""Issue 64, item 1: adaptive gating (--adaptive-gating, AdapMoE) against exact top-k, offloaded
with an emulated link, on two models:

  distinct  `smollm2-moe-distinct` (klotski/builtin/smollm.py: SmolLM2-135M-Instruct upcycled,
            each expert the dense MLP times (1 + 0.05·z)), chat questions, fp32;
  mixtral   the `small` preset (hidden 256, 8 experts top-2) at 8 layers, skewed routing, fp32.

    python benchmarks/adaptive_gating.py [--models distinct,mixtral] [--reps 2] [--agreement 0.95]
    python benchmarks/adaptive_gating.py --variant   # the distinct model itself, by transformers

A first gated run calibrates (its thresholds are saved beside its output and reused by the
later gated runs, which write the same output path); then exact and gated runs alternate,
`--reps` rounds, each in its own process; a row is the median of its rounds, the load average
before each run beside it. Agreement is over the whole job: the gated runs' greedy tokens
against the exact run's, position by position.

--variant: transformers' own greedy answers of the distinct model with its top-2 routing (read
them), its top-1 routing (every second expert dropped, renormalised: `num_experts_per_tok=1`),
and the dense SmolLM2 it was made from; the share of greedy tokens top-1 keeps equal.
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

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "Give three tips for staying healthy.", "What is 12 times 7?", "Name a famous painter and one of their works.",
    "Why is the sky blue?", "What is a prime number?", "Describe a cat in two sentences.",
    "How do airplanes fly?", "What causes rain?", "Suggest a name for a coffee shop.",
    "What is the boiling point of water?", "Translate 'good morning' into Spanish.",
    "What does a computer's CPU do?", "List three fruits that are red.",
    "Why do leaves change color in autumn?", "What is the largest planet in our solar system?",
    "Give me a simple recipe for pancakes.", "What is gravity?", "Write one sentence about the moon.",
    "How many days are in a leap year?", "What is the difference between a virus and a bacterium?",
    "Name three musical instruments.",
]
MODELS = {  # name -> (--model or None: the small Mixtral-shaped preset, job, budget, link GB/s, new tokens)
    "distinct": ("smollm2-moe-distinct", "chat", "900MiB", "4", 32),
    "mixtral": (None, "wikitext", "97MB", "1", 16),
}


def chat_jobs(out: Path, count: int) -> Path:
    out.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                           for i, q in enumerate(QUESTIONS[:count])))
    return out


def tokens_of(out: Path) -> dict:
    return {json.loads(line)["id"]: json.loads(line)["token_ids"] for line in out.read_text().splitlines()}


def agreement(exact: dict, other: dict) -> float:
    sys.path.insert(0, str(ROOT))
    from klotski.schedule.gating import agreement_of
    ids = sorted(exact)
    return agreement_of([exact[i] for i in ids], [other[i] for i in ids])


def measure(name: str, a, work: Path) -> dict:
    model, job, budget, link, new = MODELS[name]
    if model is None:
        from klotski.builtin import tiny
        path = work / "small"
        if not (path / "config.json").exists():
            tiny.build_checkpoint(path, "small", routing="skewed", dtype="float32", num_hidden_layers=8)
        model = str(path)
    jobs = (chat_jobs(work / f"{name}.jsonl", a.prompts) if job == "chat"
            else write_jobs(ROOT / "jobs" / "wikitext.jsonl", a.prompts, work / f"{name}.jsonl"))
    common = ["--model", model, "--emulate-link", link, "--device-memory", budget, "--host-memory", "8GiB",
              "--max-new-tokens", str(new), "--dtype", "float32", "--include-token-ids"]
    common += [x for x in a.extra.split(",") if x]
    gated_args = common + ["--adaptive-gating", str(a.agreement)]
    cal = generate(jobs, work / f"{name}-gated.json", gated_args)  # calibrates, saves the thresholds
    calibration = cal["adaptive_gating"]["calibration"]
    print(f"{name}: calibrated: agreement {calibration['agreement']} at q {calibration['q']}, "
          f"skipped {calibration['skipped_share']} of the calibration group's pairs", flush=True)
    runs = {"exact": [], "gated": []}
    exact_tokens = gated_tokens = None
    for rep in range(a.reps):
        for kind, args in (("exact", common), ("gated", gated_args)):
            load = os.getloadavg()[0]
            report = generate(jobs, work / f"{name}-{kind}.json", args)
            report["load_before"], report["load_after"] = load, os.getloadavg()[0]
            runs[kind].append(report)
            toks = tokens_of(work / f"{name}-{kind}.out.jsonl")
            if kind == "exact":
                exact_tokens = toks
            else:
                gated_tokens = toks
                assert report["adaptive_gating"]["calibration"]["reused"], "the gated run calibrated again"
            print(f"{name} {kind:5s} rep {rep}: {report['tokens_per_s']:7.2f} tok/s  "
                  f"h2d {report['io']['bytes'].get('host_to_device', 0) / 1e6:8.1f} MB  "
                  f"experts loaded {report['io']['experts_loaded']}  load {load:.1f}", flush=True)
    med = lambda xs: round(statistics.median(xs), 4)
    rows = {}
    for kind, reports in runs.items():
        rows[kind] = {"tokens_per_s": med([r["tokens_per_s"] for r in reports]),
                      "decode_s": med([r["decode_s"] for r in reports]),
                      "prefill_s": med([r["prefill_s"] for r in reports]),
                      "host_to_device_bytes": med([r["io"]["bytes"].get("host_to_device", 0) for r in reports]),
                      "experts_loaded": med([r["io"]["experts_loaded"] for r in reports]),
                      "bubble_decode_share": med([r["bubble"]["decode_share"] for r in reports]),
                      "load_before": [round(r["load_before"], 2) for r in reports]}
    for kind, reports in runs.items():
        rows[kind]["load_after"] = [round(r["load_after"], 2) for r in reports]
        rows[kind]["tokens_per_s_runs"] = [r["tokens_per_s"] for r in reports]
    g = runs["gated"][0]["adaptive_gating"]
    rows["gated"].update({"pairs_skipped_share": g["skipped_share"], "experts_not_loaded": g["experts_not_loaded"],
                          "link_bytes_not_loaded": g["link_bytes_not_loaded"]})
    thresholds = json.loads((work / f"{name}-gated.out.jsonl.gating.json").read_text())["thresholds"]
    forced = teacher_forced(model, jobs, thresholds, exact_tokens, new) if a.teacher_forced else None
    return {"model": model, "budget": budget, "extra": a.extra, "teacher_forced_agreement_gated_vs_exact": forced, "link_gbps": link, "prompts": a.prompts, "new_tokens": new,
            "reps": a.reps, "agreement_bound": a.agreement, "calibration": calibration,
            "job_agreement_gated_vs_exact": round(agreement(exact_tokens, gated_tokens), 4),
            "tokens_per_s_ratio": round(rows["gated"]["tokens_per_s"] / rows["exact"]["tokens_per_s"], 3),
            "link_bytes_ratio": round(rows["gated"]["host_to_device_bytes"] / rows["exact"]["host_to_device_bytes"], 3)
            if rows["exact"]["host_to_device_bytes"] else None,
            "rows": rows}


def teacher_forced(model: str, jobs: Path, thresholds: list, exact: dict, new: int) -> float:
    """Teacher-forced next-token agreement: each line's exact-top-k tokens forced through the
    gated model (every expert resident: tokens do not depend on where experts live), the share
    of positions whose greedy pick (the argmax, read as the top log-probability) is the exact
    run's token there. Free-running agreement loses a line's rest after one flip; this does not."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.jobs import read_jobs
    cfg = RunConfig(model=model, dtype="float32", max_new_tokens=new, device_memory=8 << 30, progress=False)
    requests, bad = read_jobs(jobs)
    assert not bad, bad
    engine, seqs, errors = open_engine(cfg, requests)
    assert not errors, errors
    engine.pipeline.set_gating(thresholds)
    seqs = [s for s in seqs if exact.get(s.request.id)]
    for s in seqs:
        s.forced, s.max_new_tokens, s.top_logprobs = list(exact[s.request.id]), len(exact[s.request.id]), 1
    for _ in engine.run(seqs):
        pass
    engine.close()
    same = sum(lp[2][0][0] == t for s in seqs for lp, t in zip(s.logprobs, exact[s.request.id]))
    return round(same / sum(len(exact[s.request.id]) for s in seqs), 4)


def variant(a) -> dict:
    """The distinct model by transformers: answers, and how often top-1 keeps top-2's tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(ROOT))
    from klotski.builtin import smollm
    from klotski.io import registry
    from klotski.schedule.gating import agreement_of
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    path = registry.resolve("smollm2-moe-distinct")
    dense, tok = smollm.dense_model()
    models = {"top2": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
              "top1": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_experts_per_tok=1).eval(),
              "dense": dense}
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    from klotski.schedule.sequences import tokenize
    requests = [Request(id=f"q{i}", line=i + 1, prompt=None, messages=(("user", q),), max_new_tokens=a.variant_tokens) for i, q in enumerate(QUESTIONS[:a.prompts])]
    out = {k: [] for k in models}
    for r in requests:  # the prompt as the engine renders it (its chat template), for every model alike
        ids = torch.tensor([tokenize(tok, r)])
        for k, m in models.items():
            with torch.no_grad():
                row = m.generate(input_ids=ids, max_new_tokens=a.variant_tokens, do_sample=False)[0, ids.shape[1]:]
            out[k].append(row.tolist())
    # the engine on the same folder, offloaded: token for token transformers' top-2
    cfg = RunConfig(model="smollm2-moe-distinct", dtype="float32", max_new_tokens=a.variant_tokens,
                    device_memory=900 << 20, progress=False)
    engine, seqs, errors = open_engine(cfg, requests)
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    eos = {tok.eos_token_id}
    cut = [row[:next((i for i, t in enumerate(row) if t in eos), len(row))] for row in out["top2"]]
    engine_equal = [done[f"q{i}"] == cut[i] for i in range(len(cut))]
    result = {"questions": QUESTIONS[:a.prompts], "new_tokens": a.variant_tokens,
              "engine_tokens_equal_transformers": engine_equal,
              "top1_keeps_top2": round(agreement_of(out["top2"], out["top1"]), 4),
              "top2_equals_dense": round(agreement_of(out["dense"], out["top2"]), 4),
              "answers": {k: [tok.decode(t, skip_special_tokens=True) for t in v] for k, v in out.items()}}
    for q, t2, t1 in zip(result["questions"], result["answers"]["top2"], result["answers"]["top1"]):
        print(f"Q: {q}\n  top-2: {t2!r}\n  top-1: {t1!r}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="distinct,mixtral")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--agreement", type=float, default=0.95)
    ap.add_argument("--variant", action="store_true")
    ap.add_argument("--teacher-forced", action="store_true", help="also the gated model's teacher-forced agreement")
    ap.add_argument("--variant-tokens", type=int, default=32)
    ap.add_argument("--work", default=None)
    ap.add_argument("--extra", default="", help="more generate flags, comma-separated (e.g. --batch-size=4)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adaptive-gating.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    out = Path(a.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["load_at_start"] = os.getloadavg()
    if a.variant:
        result["variant"] = variant(a)
    else:
        work = Path(a.work or tempfile.mkdtemp(prefix="klotski-h64a-"))
        work.mkdir(parents=True, exist_ok=True)
        for name in a.models.split(","):
            result[name] = measure(name, a, work)
            print(json.dumps({k: v for k, v in result[name].items() if k != "calibration"}, indent=1), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
