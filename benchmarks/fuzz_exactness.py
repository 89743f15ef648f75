"""Exactness under random configurations: fp32 greedy tokens must equal transformers' whatever
the family, schedule, n, batch size, batching, prefill chunk, budget, prefetcher, host compute
and shared-prefix setting. Each trial draws one of each, runs the engine in-process and compares
with transformers' batched greedy generate (tests/conftest.reference_tokens) on the same prompts.

    python benchmarks/fuzz_exactness.py --minutes 20 [--seed 0] [--out benchmarks/results/fuzz.json]

A budget the planner refuses is run again at the minimum it names (a refusal is the promise's
other half). A mismatch is reported with the configuration that reproduces it and, from
transformers' logits, the margin between the two best tokens where the outputs part: a margin
near fp32 rounding (< 1e-4) is a near-tie that a different summation order may flip, not a bug.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

WORDS = ("river mountain paper glass salt wind music bread train winter star gold rain stone city "
         "forest ocean light shadow garden window letter number story table horse cloud").split()
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "minimax_m2")


def draw_prompts(rng: random.Random) -> list[str]:
    """3-12 prompts of 2-40 words; often a shared instruction (or two) before each."""
    shared = [" ".join(rng.choices(WORDS, k=rng.randint(8, 30))) for _ in range(rng.randint(0, 2))]
    out = []
    for _ in range(rng.randint(3, 12)):
        item = " ".join(rng.choices(WORDS, k=rng.randint(2, 40)))
        out.append((rng.choice(shared) + " : " + item) if shared and rng.random() < 0.8 else item)
    return out


def draw_config(rng: random.Random, model_bytes: int) -> dict:
    cfg = dict(schedule=rng.choice(["klotski", "klotski", "multibatch", "simple"]),
               batching=rng.choice(["continuous", "continuous", "static"]),
               batch_size=rng.choice([None, 1, 2, 3, 4, 6]),
               num_batches=rng.choice([None, 1, 2, 3]),
               prefill_chunk=rng.choice([None, None, 1, 3, 8, 16]),
               prefetch=rng.choice(["correlation", "next-gate", "none"]),
               prefix_cache=rng.random() < 0.7)
    if rng.random() < 0.7:  # a device budget: from an eighth of the model to all of it
        cfg["device_memory"] = int(model_bytes * rng.choice([0.05, 0.125, 0.25, 0.4, 0.6, 1.0]))
        cfg["host_attention"] = rng.choice(["off", "off", "on"])
        cfg["host_experts"] = rng.choice(["off", "off", "on"])
    return cfg


def margin_at(model_dir: str, prompt: str, ref: list[int], ours: list[int]) -> tuple[int, float | None]:
    """Where the outputs part, and transformers' gap between its two best logits there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    at = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
    if at >= len(ref):
        return at, None
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"] + ref[:at]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return at, float(top[0] - top[1])


def trial(rng: random.Random, models: dict, refs: dict) -> dict:
    from conftest import engine_tokens, reference_tokens
    from klotski.planning import BudgetRefused
    from placement.store import TensorStore
    from planner.units import format_size_flag, parse_size

    family = rng.choice(FAMILIES)
    if family not in models:
        from klotski.builtin.families import build_family
        models[family] = str(build_family(Path(tempfile.mkdtemp(prefix=f"fuzz-{family}-")), family))
    model = models[family]
    prompts, new = draw_prompts(rng), rng.randint(1, 12)
    size = sum(e.nbytes for e in TensorStore(model).entries.values())
    cfg = draw_config(rng, size)
    out = {"family": family, "prompts": prompts, "max_new_tokens": new, "config": cfg}
    key = (family, tuple(prompts), new)
    if key not in refs:
        refs[key] = reference_tokens(model, prompts, new)
    ref = refs[key]
    try:
        try:
            ours, engine = engine_tokens(model, prompts=prompts, max_new_tokens=new, **cfg)
        except BudgetRefused as e:
            out["refused"] = str(e)
            cfg = {**cfg, "device_memory": parse_size(format_size_flag(e.needed))}
            out["config_run"] = cfg
            ours, engine = engine_tokens(model, prompts=prompts, max_new_tokens=new, **cfg)
    except Exception as e:  # a configuration the engine refuses in words, or a bug: both are listed
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=6)
        return out
    budget = cfg.get("device_memory")
    out["within_budget"] = budget is None or engine.memory.peak <= budget
    out["plan"] = [engine.batch_size, engine.num_batches]
    bad = [i for i, (a, b) in enumerate(zip(ref, ours)) if a != b]
    out["equal"] = not bad
    if bad:
        out["mismatches"] = [{"prompt": i, "ref": ref[i], "ours": ours[i],
                              "at_margin": margin_at(model, prompts[i], ref[i], ours[i])} for i in bad]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    a = ap.parse_args()
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    rng, models, refs, results = random.Random(a.seed), {}, {}, []
    end = time.time() + 60 * a.minutes
    while time.time() < end:
        r = trial(rng, models, refs)
        results.append(r)
        status = ("ERROR " + r["error"][:160] if "error" in r else "ok" if r["equal"] and r["within_budget"]
                  else "OVER BUDGET" if not r["within_budget"] else "MISMATCH " + json.dumps(r["mismatches"])[:300])
        print(f"{len(results):4d} {r['family']:12s} {json.dumps(r['config'])} -> {status}", flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if "error" in r or not r["equal"] or not r["within_budget"]]
    print(f"{len(results)} trials, {len(bad)} to look at; {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
