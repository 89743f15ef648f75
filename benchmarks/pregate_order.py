"""Issue 64, items 4 and 5: the pre-gate fitted on the run (--prefetch pregate) against next-gate
speculation, and routing-aware order (--order routing) against the file's order.

    python benchmarks/pregate_order.py [--part pregate|order|both] [--reps 1] [--trained smollm2-moe-distinct]
                                       [--out benchmarks/results/pregate-order.json]

pregate: each model offloaded under --emulate-link, --prefetch next-gate then --prefetch pregate
(each run in its own process); the pregate run scores next-gate's speculation on the same
layer-steps (report: prefetch.alongside), so precision and recall of both come from one run,
and each run's own prefetch precision and tok/s beside them. Models: the `small` preset at 8
layers (hidden 256, 8 experts top-2, Mixtral's layout), skewed routing, fp32; and the box's
trained model (`--trained`).

order: the trained model offloaded under --emulate-link, on a job interleaving four topics
(code, recipes, sports, maths: one line of each in turn), --order length (all lines one length
budget, so the file's order) then --order routing; distinct experts per MoE layer-step (decode
and prefill steps), decode link bytes per generated token and tok/s.

Each row: the median of its --reps rounds, the 1-minute load average before each run beside it;
token ids compared between the runs of a part (both options only move bytes or rows).
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

TOPICS = {
    "code": ["Write a Python function that returns the sum of a list of integers",
             "Explain what a for loop does in Python code",
             "In C, a pointer holds the address of a variable; the function below",
             "The following JavaScript code sorts an array of numbers",
             "def fibonacci(n): return n if n < 2 else",
             "A compiler turns source code into machine code by"],
    "recipes": ["To bake a simple loaf of bread, mix flour, water, yeast and salt",
                "For a tomato soup, chop two onions and fry them in olive oil",
                "Whisk three eggs with sugar until pale, then fold in the flour",
                "A good pancake batter needs milk, eggs, flour and a pinch of salt",
                "Slice the potatoes thinly, layer them with cream and garlic, and bake",
                "Simmer the rice in stock, stirring often, then add butter and parmesan"],
    "sports": ["The football match ended in a draw after a late goal from the striker",
               "In tennis, a player must win six games to take a set",
               "The marathon runner crossed the finish line in just over two hours",
               "The basketball team scored forty points in the final quarter",
               "At the Olympic Games the swimmer won three gold medals",
               "The cricket captain declared the innings after lunch on the second day"],
    "maths": ["The derivative of x squared with respect to x is",
              "A prime number is a natural number greater than one whose only divisors are",
              "To solve the equation 3x + 5 = 20, subtract five from both sides",
              "The area of a circle of radius r equals pi times",
              "The sum of the angles of a triangle is 180 degrees, so",
              "A matrix is invertible exactly when its determinant is"],
}


def topic_job(out: Path, per_topic: int) -> Path:
    """One line of each topic in turn: the file's order mixes them."""
    names = list(TOPICS)
    lines = [{"id": f"{t}-{i}", "prompt": TOPICS[t][i % len(TOPICS[t])]} for i in range(per_topic) for t in names]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def token_ids(report_path: Path) -> dict:
    """Each line's token ids by its id (records are written as lines finish, not in file order)."""
    out = report_path.with_suffix(".out.jsonl")
    return {r["id"]: r.get("token_ids") for r in map(json.loads, out.read_text().splitlines())}


def run_rows(name, configs, jobs, common, work, reps, summarise):
    """Each configuration `reps` times, the configurations in turn within each round (so a pair's
    runs meet the same load); a row: medians, the first run's counts."""
    runs = {cname: [] for cname in configs}
    ids = {cname: [] for cname in configs}
    for rep in range(reps):
        for cname, extra in configs.items():
            load = os.getloadavg()[0]
            path = work / f"{name}-{cname}-{rep}.json".replace(" ", "_")
            report = generate(jobs, path, common + extra)
            report["load_before"], report["load_after"] = load, os.getloadavg()[0]
            runs[cname].append(report)
            ids[cname].append(token_ids(path))
            print(f"{name} {cname} rep {rep}: {report['tokens_per_s']} tok/s (load {load:.1f}) "
                  f"{json.dumps(summarise(report))}", flush=True)
    rows = {}
    for cname, reports in runs.items():
        rows[cname] = {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in reports), 3),
                       "decode_s": round(statistics.median(r["decode_s"] for r in reports), 3),
                       "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
                       "load_before": [round(r["load_before"], 1) for r in reports],
                       "load_after": [round(r["load_after"], 1) for r in reports], **summarise(reports[0])}
        key = "distinct_experts_per_decode_layer_step"
        if key in rows[cname]:
            rows[cname][key + "_runs"] = [summarise(r)[key] for r in reports]
        rows[cname]["_ids"] = ids[cname][0]
    first = next(iter(rows.values()))["_ids"]
    same = all(r.pop("_ids") == first for r in list(rows.values()))
    return {"rows": rows, "same_tokens": same, "command_common": common}


def prefetch_summary(report) -> dict:
    p = report["prefetch"]
    out = {"precision": p["precision"], "recall": p.get("recall"), "served_share": p["served_share"],
           "predictor": p["predictor"], "link_bytes": report["io"]["bytes"].get("host_to_device"),
           "bubble_decode_share": report["bubble"]["decode_share"]}
    if "alongside" in p:
        out["alongside"] = {k: {m: v[m] for m in ("precision", "recall", "served_share")}
                            for k, v in p["alongside"].items()}
        out["pregated_share"] = p["pregated_share"]
    return out


def order_summary(report) -> dict:
    o = report["line_order"]
    return {**{k: v for k, v in o.items() if k != "policy"}, "link_bytes": report["io"]["bytes"].get("host_to_device"),
            "experts_loaded": report["io"]["experts_loaded"], "decode_steps": report["decode_steps"],
            "tokens": report["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("pregate", "order", "both"), default="both")
    ap.add_argument("--trained", default="smollm2-moe-distinct")
    ap.add_argument("--models", default="small,trained", help="the pregate part's models")
    ap.add_argument("--small-budget", default="97MB")
    ap.add_argument("--trained-budget", default="900MiB")
    ap.add_argument("--order-model", default=None, help="the order part's model (default: --trained)")
    ap.add_argument("--order-budget", default=None, help="its device budget (default: --trained-budget)")
    ap.add_argument("--compared", action="store_true",
                    help="the pregate part: also a --prefetch pregate --prefetch-compare row (next-gate scored beside)")
    ap.add_argument("--link", default="1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--per-topic", type=int, default=4)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pregate-order.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from klotski.builtin import tiny
    work = Path(a.work or tempfile.mkdtemp(prefix="klotski-h64c-"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"machine_load_at_start": os.getloadavg(), "args": vars(a)}
    # bs and n fixed: a run's profile learning (learning.learn_from_run) must not change the next
    # run's plan, so every row runs the same batches
    base = ["--emulate-link", a.link, "--host-memory", "8GiB", "--max-new-tokens", str(a.new), "--dtype", "float32",
            "--include-token-ids", "--batch-size", str(a.bs), "--num-batches", str(a.n)]
    predictors = {"next-gate": ["--prefetch", "next-gate"], "pregate": ["--prefetch", "pregate"]}
    if a.compared:
        predictors["pregate, next-gate scored beside"] = ["--prefetch", "pregate", "--prefetch-compare"]
    if a.part in ("pregate", "both"):
        small = work / "small"
        if not (small / "config.json").exists():
            tiny.build_checkpoint(small, "small", routing="skewed", dtype="float32", num_hidden_layers=8)
        jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", a.prompts, work / "wikitext.jsonl")
        if "small" in a.models:
            result["pregate_small"] = run_rows("small", predictors, jobs,
                                               ["--model", str(small), "--device-memory", a.small_budget] + base,
                                               work, a.reps, prefetch_summary)
        if "trained" in a.models:
            result["pregate_trained"] = run_rows("trained", predictors, jobs,
                                                 ["--model", a.trained, "--device-memory", a.trained_budget] + base,
                                                 work, a.reps, prefetch_summary)
    if a.part in ("order", "both"):
        jobs = topic_job(work / "topics.jsonl", a.per_topic)
        orders = {"length (default)": ["--order", "length"], "routing": ["--order", "routing"]}
        model, budget = a.order_model or a.trained, a.order_budget or a.trained_budget
        result["order_trained" if model == a.trained else f"order_{model}"] = run_rows(
            "order", orders, jobs, ["--model", model, "--device-memory", budget] + base, work, a.reps, order_summary)
    result["machine_load_at_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
