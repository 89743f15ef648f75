"""Constrained answers against unconstrained ones on the same job: what the grammar masks cost.

    python benchmarks/constrained.py [--model tiny-mixtral] [--prompts 48] [--bs 8] [--n 2]

The first `--prompts` wikitext prompts, each asking for a label: half with a choice
(`structured_outputs.choice`), half with a JSON schema (a label and a free-text reason of at
most 60 characters, so answers run for tens of tokens). A first constrained run (not timed)
finds each answer's length; then the constrained job and its unconstrained twin both ask
each line for exactly that many tokens, so the two timed runs decode the same tokens per
line through the same schedule (continuous batching orders by max_tokens), and tokens/s
compares the step with masks against the step without. The script checks every
constrained answer (one of the choices, or JSON that validates, unless cut at the limit) and
writes benchmarks/results/constrained.json. Each run is its own `klotski generate` process;
`--repeats` alternates their order.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate  # noqa: E402

LABELS = ["history", "science", "geography", "culture", "other"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "reason"],
          "properties": {"label": {"enum": LABELS}, "reason": {"type": "string", "maxLength": 60}}}


def constrained_job(count: int, max_tokens: int, out: Path) -> list[dict]:
    lines = []
    for i, line in enumerate((ROOT / "jobs" / "wikitext.jsonl").read_text().splitlines()[:count]):
        src = json.loads(line)
        prompt = f"Text: {src['prompt']}\nTopic ({', '.join(LABELS)}):"
        shape = ({"structured_outputs": {"choice": LABELS}} if i % 2 == 0 else
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "topic", "schema": SCHEMA}}})
        lines.append({"id": src["id"], "prompt": prompt, "max_tokens": max_tokens, **shape})
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def check(lines: list[dict], records: dict) -> int:
    """Every constrained answer obeys its line; returns how many were cut at the limit."""
    import jsonschema
    cut = 0
    for line in lines:
        rec = records[line["id"]]
        if rec["finish_reason"] == "length":
            cut += 1
        elif "structured_outputs" in line:
            assert rec["completion"] in LABELS, rec
        else:
            jsonschema.validate(json.loads(rec["completion"]), SCHEMA)
    return cut


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "constrained.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-constrained-"))
    common = ["--model", a.model, "--batch-size", str(a.bs), "--num-batches", str(a.n), "--dtype", "float32",
              "--include-token-ids"]
    lines = constrained_job(a.prompts, a.max_tokens, tmp / "constrained.jsonl")
    generate(tmp / "constrained.jsonl", tmp / "discovery.json", common)
    found = {rec["id"]: rec for rec in map(json.loads, (tmp / "discovery.out.jsonl").read_text().splitlines())}
    lengths = {i: max(1, len(rec["token_ids"])) for i, rec in found.items()}
    for mode, keep in (("constrained", True), ("unconstrained", False)):  # the same lines, each its answer's length
        (tmp / f"{mode}.jsonl").write_text("".join(json.dumps(
            {**{k: v for k, v in x.items() if keep or k in ("id", "prompt")}, "max_tokens": lengths[x["id"]]}) + "\n"
            for x in lines))
    runs: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
    for r in range(a.repeats):
        for mode in ("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained", "constrained"):
            report = generate(tmp / f"{mode}.jsonl", tmp / f"{mode}{r}.json", common)
            records = {rec["id"]: rec for rec in map(json.loads, (tmp / f"{mode}{r}.out.jsonl").read_text().splitlines())}
            if mode == "constrained":
                cut = check(lines, records)
                assert all(rec["token_ids"] == found[i]["token_ids"] for i, rec in records.items())
            runs[mode].append({"tokens_per_s": report["tokens_per_s"], "generated": report["tokens"]["generated"],
                               "decode_s": report["decode_s"], "prefill_s": report["prefill_s"],
                               "decode_tokens_per_s": report["tokens"]["generated"] / report["decode_s"],
                               "wall_s": report["wall_s"], **({"cut_at_limit": cut} if mode == "constrained" else {})})
            print(mode, json.dumps(runs[mode][-1]), flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("tokens_per_s", "decode_tokens_per_s", "generated")}
           for m, v in runs.items()}
    result = {"model": a.model, "prompts": a.prompts, "bs": a.bs, "n": a.n, "max_tokens": a.max_tokens,
              "answer_tokens": {"median": statistics.median(lengths.values()), "max": max(lengths.values()),
                                "total": sum(lengths.values())},
              "median": med, "runs": runs,
              "ratio_tokens_per_s": med["constrained"]["tokens_per_s"] / med["unconstrained"]["tokens_per_s"],
              "ratio_decode_tokens_per_s": (med["constrained"]["decode_tokens_per_s"]
                                            / med["unconstrained"]["decode_tokens_per_s"])}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("answer_tokens", "median", "ratio_tokens_per_s",
                                             "ratio_decode_tokens_per_s")}, indent=2))


if __name__ == "__main__":
    main()
