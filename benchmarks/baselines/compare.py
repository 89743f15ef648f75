"""Do several systems produce the same greedy tokens? Compare their output JSONL files.

    python benchmarks/baselines/compare.py klotski=k.jsonl accelerate=a.jsonl [...]

Each file holds one record per id with `token_ids` (Klotski writes them with
`--include-token-ids`; accelerate_run.py always does). The first file is the reference;
every other one is compared with it id by id. Exit status 1 if anything disagrees.

Token ids, not text, are compared: two systems can decode the same text from different
ids, and the first differing position is what tells a numerics drift (late, one
position) from a real bug (early, everywhere).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load_tokens(path) -> tuple[dict[str, list[int] | None], list[str]]:
    """id -> token_ids (None when the record has none), and ids in file order.

    Error records (Klotski's `{"id", "error"}`) are skipped: there is nothing to compare.
    """
    tokens, order = {}, []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "error" in rec or rec.get("id") is None:
            continue
        key = str(rec["id"])
        if key in tokens:  # a system should not write an id twice; keep its first answer
            continue
        tokens[key] = rec.get("token_ids")
        order.append(key)
    return tokens, order


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a prefix differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_pair(ref: dict, ref_order: list[str], other: dict) -> dict:
    missing = [i for i in ref_order if i not in other]
    extra = sorted(set(other) - set(ref))
    no_tokens = [i for i in ref_order if i in other and (ref[i] is None or other[i] is None)]
    differing, first = [], None
    for i in ref_order:
        if i not in other or i in no_tokens:
            continue
        pos = first_difference(ref[i], other[i])
        if pos is None:
            continue
        differing.append(i)
        if first is None:
            first = {"id": i, "position": pos,
                     "expected": ref[i][pos] if pos < len(ref[i]) else None,
                     "got": other[i][pos] if pos < len(other[i]) else None}
    compared = len(ref_order) - len(missing) - len(no_tokens)
    return {"compared": compared, "differing": len(differing), "differing_ids": differing,
            "first_difference": first, "missing_ids": missing, "extra_ids": extra,
            "without_token_ids": no_tokens,
            "identical": not (differing or missing or extra or no_tokens)}


def compare_outputs(paths: dict[str, Path]) -> dict:
    """Compare every output with the first one (dicts keep insertion order)."""
    if len(paths) < 2:
        raise ValueError("need at least two outputs to compare")
    (ref_name, ref_path), *others = paths.items()
    ref, ref_order = load_tokens(ref_path)
    pairs = {name: compare_pair(ref, ref_order, load_tokens(path)[0]) for name, path in others}
    return {"reference": ref_name, "ids": len(ref_order), "pairs": pairs,
            "all_identical": all(p["identical"] for p in pairs.values())}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not all("=" in a for a in args):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    result = compare_outputs({name: Path(p) for name, p in (a.split("=", 1) for a in args)})
    print(json.dumps(result, indent=2))
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
