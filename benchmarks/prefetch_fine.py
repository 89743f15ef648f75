"""Hot-expert predictors on a fine-grained MoE (128 experts, top-8) with skewed routing.

Builds a small 128-expert top-8 test model, then runs one job through the engine in this
process with each predictor: the exact-path correlation table, the per-expert
co-occurrence table (what `--prefetch correlation` picks for this model), frequency
counts, next-gate speculation and no prefetch, round-robin, under a device budget smaller
than the model and an emulated host->device link, so prefetch has to earn its keep.
Repetition 0 warms up on other prompts of the same corpus, and every measured run starts
from what the warm-up learned, as a saved table is loaded by the next job (a measured run
starting from a table that had seen the same job would let the exact-path table recall
every token's path). Medians are printed as a Markdown table with the prefetch metrics
(`engine.predictor.report()`), decode tokens/s, the share of compute time spent waiting
on transfers and the host->device megabytes moved per generated token.

    python benchmarks/prefetch_fine.py                 # results: benchmarks/results/prefetch-fine.json
    python benchmarks/prefetch_fine.py --sweep         # exact-path vs co-occurrence over (experts, top-k)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

PREDICTORS = ("exact-path", "co-occurrence", "frequency", "next-gate", "none")


def model_dir(work: Path, experts: int, top_k: int, a) -> Path:
    from klotski.builtin.tiny import build_checkpoint
    return build_checkpoint(work / f"m{experts}x{top_k}", "tiny", routing="skewed", num_local_experts=experts,
                            num_experts_per_tok=top_k, hidden_size=a.hidden, intermediate_size=a.inter,
                            num_hidden_layers=a.layers)


def _counting(table, found: list) -> None:
    """Count, in found = [hits, lookups], the exact-path lookups that found the token's own path."""
    inner = table._lookup

    def lookup(layer, key):
        found[0] += key in table.counts[layer]
        found[1] += 1
        return inner(layer, key)
    table._lookup = lookup


def make_predictor(name: str, spec, learned: dict, found: list):
    """A predictor for one run, starting from (a copy of) what `learned` holds for it; None
    for next-gate and none, which the engine builds from the config."""
    from klotski.prefetch.cooccurrence import CooccurrenceTable
    from klotski.prefetch.predictors import CorrelationPredictor, CorrelationTable, FrequencyPredictor
    shape = (spec.shape.num_layers, spec.shape.num_experts, spec.shape.top_k)
    if name == "exact-path":
        table = copy.deepcopy(learned.get(name)) or CorrelationTable(*shape)
        _counting(table, found)
        return CorrelationPredictor(table)
    if name == "co-occurrence":
        return CorrelationPredictor(copy.deepcopy(learned.get(name)) or CooccurrenceTable(*shape))
    if name == "frequency":
        p = FrequencyPredictor(spec.shape.num_layers, spec.shape.num_experts)
        if name in learned:
            p.counts = learned[name].clone()
        return p
    return None


def learned_state(name: str, predictor):
    """What a finished run learned, to start later runs from (without the hit counter)."""
    if predictor is None:
        return None
    if name == "frequency":
        return predictor.counts
    table = predictor.table
    table.__dict__.pop("_lookup", None)
    return table


def run_once(model: Path, prompts: list[str], name: str, learned: dict, a) -> dict:
    from klotski.assemble import open_engine
    from klotski.io.checkpoint import Checkpoint
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    spec = Checkpoint.open(model).spec
    prefetch = name if name in ("next-gate", "none") else "correlation"
    config = RunConfig(model=str(model), progress=False, batch_size=a.bs, num_batches=a.n,
                       max_new_tokens=a.max_new_tokens, prefetch=prefetch, emulate_link_gbps=a.link,
                       device_memory=a.device_memory, host_memory=a.host_memory)
    requests = [Request(id=str(i), line=i + 1, prompt=p, messages=None) for i, p in enumerate(prompts)]
    found = [0, 0]
    predictor = make_predictor(name, spec, learned, found)
    engine, seqs, _ = open_engine(config, requests, predictor=predictor)
    tokens = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    s = engine.stats
    return {"decode_tok_s": s.generated_tokens / s.decode_s, "bubble": engine.trace.bubble_share(),
            "h2d_mb_per_token": engine.trace.bytes.get("host_to_device", 0) / 1e6 / s.generated_tokens,
            "report": engine.predictor.report(), "tokens": tokens, "found": found,
            "learned": learned_state(name, predictor),
            "sets_held": sum(map(len, predictor.table.counts)) if name == "exact-path" else None}


def compare(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="klotski-fine-"))
    model = model_dir(work, 128, 8, a)
    lines = Path(a.jobs).read_text().splitlines()
    count = a.bs * a.n * a.groups
    job = [json.loads(l)["prompt"] for l in lines[:count]]
    warmup = [json.loads(l)["prompt"] for l in lines[count:2 * count]]
    names = a.predictors.split(",")
    runs, learned = {n: [] for n in names}, {}
    for rep in range(a.reps + 1):
        for name in names:
            r = run_once(model, job if rep else warmup, name, learned, a)
            if not rep:
                learned[name] = r["learned"]
            print(f"rep {rep} {name:14s} {r['decode_tok_s']:7.2f} decode tok/s  precision {r['report']['precision']}",
                  file=sys.stderr)
            if rep:
                runs[name].append(r)
    first = runs[names[0]][0]["tokens"]
    same = all(r["tokens"] == first for rs in runs.values() for r in rs)
    print(f"| predictor | precision | hot accuracy | served share | decode tok/s (median of {a.reps}) | spread "
          f"| bubble | H2D MB per token |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, rs in runs.items():
        pf, tps = rs[-1]["report"], [r["decode_tok_s"] for r in rs]
        print(f"| {name} | {pf['precision']} | {pf['hot_accuracy']} | {pf['served_share']} "
              f"| {statistics.median(tps):.2f} | {min(tps):.2f}–{max(tps):.2f} "
              f"| {statistics.median(r['bubble'] for r in rs):.2f} | {rs[-1]['h2d_mb_per_token']:.1f} |")
        rows.append({"predictor": name, "reports_as": pf["predictor"], "precision": pf["precision"],
                     "hot_accuracy": pf["hot_accuracy"], "served_share": pf["served_share"],
                     "decode_tok_s": [round(x, 3) for x in tps], "bubble": [round(r["bubble"], 4) for r in rs],
                     "h2d_mb_per_token": round(rs[-1]["h2d_mb_per_token"], 2), "per_group": pf["per_group"],
                     "sets_held": rs[-1]["sets_held"], "lookups_found": rs[-1]["found"]})
        if name == "exact-path":
            hits, lookups = rs[-1]["found"]
            print(f"exact-path table: {rs[-1]['sets_held']} sets held, {hits}/{lookups} lookups found their set",
                  file=sys.stderr)
    print(f"identical tokens across all measured runs: {same}")
    shutil.rmtree(work, ignore_errors=True)
    return {"model": f"tiny preset, 128 experts top-8, skewed routing, hidden {a.hidden}, "
                     f"intermediate {a.inter}, {a.layers} layers, fp32",
            "args": vars(a), "identical_tokens": same, "rows": rows}


def sweep(a) -> dict:
    """Exact-path against co-occurrence as the number of possible expert sets grows: the
    measurement behind klotski.prefetch.correlate.EXACT_PATH_MAX_SETS. No link or budget: only the
    metrics, the exact table's size and the predictors' own time matter here."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    work = Path(tempfile.mkdtemp(prefix="klotski-sweep-"))
    prompts = [json.loads(l)["prompt"] for l in Path(a.jobs).read_text().splitlines()[: a.bs * a.n * a.groups]]
    print("| experts | top-k | sets C(E,k) | table | precision | hot accuracy | served share "
          "| lookups that found their set | exact sets held | table JSON MB | predictor s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for experts, top_k in [(8, 2), (16, 4), (32, 4), (64, 6), (64, 8), (128, 8)]:
        model = model_dir(work, experts, top_k, a)
        for name in ("exact-path", "co-occurrence"):
            found, spent = [0, 0], [0.0]
            predictor = make_predictor(name, _spec(model), {}, found)
            _time_calls(predictor, spent)
            config = RunConfig(model=str(model), progress=False, batch_size=a.bs, num_batches=a.n,
                               max_new_tokens=a.max_new_tokens)
            requests = [Request(id=str(i), line=i + 1, prompt=p, messages=None) for i, p in enumerate(prompts)]
            engine, seqs, _ = open_engine(config, requests, predictor=predictor)
            list(engine.run(seqs))
            engine.close()
            pf, table = predictor.report(), predictor.table
            share = f"{found[0] / found[1]:.2f}" if found[1] else "–"
            held = sum(map(len, table.counts)) if name == "exact-path" else "–"
            mb = len(json.dumps(table.to_json("x"))) / 1e6
            print(f"| {experts} | {top_k} | {math.comb(experts, top_k)} | {name} | {pf['precision']} "
                  f"| {pf['hot_accuracy']} | {pf['served_share']} | {share} | {held} | {mb:.2f} | {spent[0]:.2f} |")
            rows.append({"experts": experts, "top_k": top_k, "table": name, "precision": pf["precision"],
                         "hot_accuracy": pf["hot_accuracy"], "served_share": pf["served_share"],
                         "found_share": share, "sets_held": held, "json_mb": round(mb, 3),
                         "predictor_s": round(spent[0], 3), "tokens_seen": table.tokens_seen()})
    shutil.rmtree(work, ignore_errors=True)
    return {"model": f"tiny preset, skewed routing, hidden {a.hidden}, intermediate {a.inter}, {a.layers} layers",
            "args": vars(a), "rows": rows}


def _spec(model):
    from klotski.io.checkpoint import Checkpoint
    return Checkpoint.open(model).spec


def _time_calls(predictor, spent: list) -> None:
    """Add the time the predictor spends in predict and observe (the hot path) to spent[0]."""
    for method in ("predict", "observe"):
        inner = getattr(predictor, method)

        def timed(*args, _inner=inner, **kw):
            t = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        setattr(predictor, method, timed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=str(ROOT / "jobs/wikitext.jsonl"))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4, help="batch groups in the job (prompts = bs * n * groups)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--link", type=float, default=0.7, help="emulated host->device GB/s")
    ap.add_argument("--device-memory", default="48MiB")
    ap.add_argument("--host-memory", default="4GiB")
    ap.add_argument("--reps", type=int, default=3)
    # Matmuls this small gain nothing from a second thread, and a spinning second thread
    # makes every timing depend on whatever else the machine runs (measured 25 us per expert
    # matmul with 1 thread, 830 us with 2 while another process used a core).
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--predictors", default=",".join(PREDICTORS))
    ap.add_argument("--sweep", action="store_true", help="exact-path vs co-occurrence over (experts, top-k)")
    ap.add_argument("--json", help="default: benchmarks/results/prefetch-fine[-sweep].json")
    a = ap.parse_args()
    from planner import units
    a.device_memory, a.host_memory = units.parse_size(a.device_memory), units.parse_size(a.host_memory)
    cache = None
    if "XDG_CACHE_HOME" not in os.environ:  # hardware profiles go to a scratch cache, not the user's
        cache = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="klotski-fine-cache-")
    import torch
    torch.set_num_threads(a.threads)
    result = sweep(a) if a.sweep else compare(a)
    out = Path(a.json or ROOT / "benchmarks" / "results" / f"prefetch-fine{'-sweep' if a.sweep else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
