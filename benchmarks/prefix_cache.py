"""A labelling job whose lines share long instructions: with and without the shared-prefix
cache (issue 38, item 1; issue 49: several instructions interleaved line by line).

    python benchmarks/prefix_cache.py [--model smollm2-moe] [--lines 48] [--instruction-tokens 400]
                                      [--instructions 1] [--item-tokens 20] [--new-tokens 4]
                                      [--tight 900MiB] [--reference]

Line i is instruction i mod --instructions (each a numbered task, a rubric and its own few-shot
examples cut to about --instruction-tokens tokens) followed by its own item (a sentence of the
built-in corpus cut to about --item-tokens tokens), each asking for --new-tokens greedy tokens,
fp32. Four
`klotski generate` processes: with and without `--no-prefix-cache`, at the default device
budget and at --tight (where the KV cache lives on the host and crosses the link, so the KV
bytes a decode step loads show). Checks that the four outputs are token for token the same
(and, with --reference, the same as transformers' greedy generate on the same token ids), and
writes benchmarks/results/prefix_cache.json: prefill seconds, the speed-up, the run reports'
`prefix_cache` sections and KV bytes loaded per decode step. The planner keeps the KV cache on
the device whenever it fits, so the KV bytes per decode step are also measured in-process
with the KV placed on the host (--host-kv-lines lines in one batch).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generate  # noqa: E402

RUBRIC = ("You label short items for a dataset. Read the item and answer with exactly one word: positive, "
          "negative or neutral. Positive means the writer approves of what the item describes; negative means "
          "the writer disapproves; neutral means the item states facts without a judgement. Do not explain your "
          "answer. Do not repeat the item. Here are examples of items and their labels.\n")


def corpus_sentences() -> list[str]:
    text = (ROOT / "klotski" / "builtin" / "data" / "corpus.txt").read_text()
    return [s.strip() + "." for s in text.replace("\n", " ").split(". ") if len(s.split()) > 6]


def cut(tokenizer, text: str, tokens: int) -> str:
    """`text` cut to about `tokens` tokens (decoded back: the job file holds text)."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])


def write_job(tokenizer, a, out: Path) -> list[list[int]]:
    sentences = corpus_sentences()
    instructions = []
    for k in range(a.instructions):
        shots = "".join(f"Item: {s}\nLabel: {('positive', 'negative', 'neutral')[(i + k) % 3]}\n"
                        for i, s in enumerate(sentences[13 * k:13 * k + 40]))
        task = f"Task {k + 1}. " if a.instructions > 1 else ""
        instructions.append(cut(tokenizer, task + RUBRIC + shots, a.instruction_tokens) + "\nItem: ")
    first = 13 * (a.instructions - 1) + 40
    items = [cut(tokenizer, s, a.item_tokens) + "\nLabel:" for s in sentences[first:first + a.lines]]
    if len(items) < a.lines:
        raise SystemExit(f"the corpus has {len(items)} items, {a.lines} wanted")
    prompts = [instructions[i % a.instructions] + item for i, item in enumerate(items)]
    out.write_text("".join(json.dumps({"id": f"l{i}", "prompt": p, "max_new_tokens": a.new_tokens}) + "\n"
                           for i, p in enumerate(prompts)))
    return [tokenizer(p)["input_ids"] for p in prompts]


def reference(model_dir: Path, ids: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy generate, fp32, in left-padded batches of 8."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    for i in range(0, len(ids), 8):
        part = ids[i:i + 8]
        width = max(map(len, part))
        x = torch.tensor([[pad] * (width - len(p)) + p for p in part])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
        with torch.no_grad():
            rows = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  pad_token_id=pad)[:, width:].tolist()
        out += [row[:next((j for j, t in enumerate(row) if t in eos), len(row))] for row in rows]
    return out


def host_kv_bytes(model: str, jobs: Path, new: int) -> dict:
    """KV bytes a decode step loads with the KV cache placed on the host (attention on the
    device, so every step moves it), with and without the prefix, in this process: the CLI's
    planner keeps the KV on the device whenever it fits. Static batching, all lines in one batch."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.registry import resolve
    from klotski.io.requests import Request
    from placement.placement import Placement
    lines = [json.loads(line) for line in jobs.read_text().splitlines()]
    ckpt = Checkpoint.open(str(resolve(model)))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="device", expert="host")
    ckpt.close()
    out, tokens = {}, {}
    for prefix in (True, False):
        config = RunConfig(model=model, progress=False, dtype="float32", batch_size=len(lines), num_batches=1,
                           batching="static", prefix_cache=prefix)
        requests = [Request(id=r["id"], line=i + 1, prompt=r["prompt"], messages=None, max_new_tokens=new)
                    for i, r in enumerate(lines)]
        engine, seqs, _ = open_engine(config, requests, placement=placement)
        tokens[prefix] = {s.request.id: list(s.out) for s in engine.run(seqs)}
        engine.close()
        s = engine.stats
        out["prefix" if prefix else "no_prefix"] = s.decode_kv_bytes // s.decode_steps
    out["ratio"] = round(out["prefix"] / out["no_prefix"], 4)
    out["identical_tokens"] = tokens[True] == tokens[False]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-moe")
    ap.add_argument("--lines", type=int, default=48)
    ap.add_argument("--instruction-tokens", type=int, default=400)
    ap.add_argument("--instructions", type=int, default=1, help="instructions interleaved line by line")
    ap.add_argument("--item-tokens", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--tight", default="900MiB", help="the second runs' --device-memory (KV on the host)")
    ap.add_argument("--batching", default="static",
                    help="static (default): every prompt is prefilled by prefill-only steps, so prefill_s is all of it")
    ap.add_argument("--reference", action="store_true", help="also compare with transformers' greedy generate")
    ap.add_argument("--host-kv-lines", type=int, default=8,
                    help="lines of the in-process run with the KV cache placed on the host (0: none)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache.json"))
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from klotski.io.registry import resolve
    model_dir = Path(resolve(a.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="klotski-prefix-"))
    jobs = tmp / "jobs.jsonl"
    ids = write_job(tokenizer, a, jobs)
    common = ["--model", a.model, "--dtype", "float32", "--include-token-ids", "--batching", a.batching]
    runs, tokens = {}, {}
    for budget in (None, a.tight):
        for prefix in (True, False):
            key = f"{'prefix' if prefix else 'no-prefix'}{'' if budget is None else '@' + budget}"
            args = common + ([] if budget is None else ["--device-memory", budget]) + ([] if prefix else
                                                                                       ["--no-prefix-cache"])
            report = generate(jobs, tmp / f"{key}.json", args)
            output = tmp / f"{key}.out.jsonl"
            tokens[key] = {r["id"]: r["token_ids"] for r in map(json.loads, output.read_text().splitlines())}
            runs[key] = {"prefill_s": report["prefill_s"], "decode_s": report["decode_s"], "wall_s": report["wall_s"],
                         "plan": {k: report["plan"][k] for k in ("batch_size", "num_batches", "prefill_chunk",
                                                                 "prefill_passes")},
                         "kv_tier": report["plan"]["placement"].get("kv"), "prefix_cache": report["prefix_cache"]}
            print(key, json.dumps(runs[key]), flush=True)
    first = next(iter(tokens.values()))
    result = {"model": a.model, "lines": a.lines, "instructions": a.instructions,
              "prompt_tokens": {"min": min(map(len, ids)), "max": max(map(len, ids))},
              "new_tokens": a.new_tokens, "batching": a.batching,
              "identical_tokens": all(t == first for t in tokens.values()), "runs": runs}
    for budget in ("", "@" + a.tight):
        on, off = runs["prefix" + budget], runs["no-prefix" + budget]
        result["prefill_speedup" + budget] = round(off["prefill_s"] / on["prefill_s"], 3) if on["prefill_s"] else None
        per_step = (on["prefix_cache"]["decode_kv_bytes_per_step"], off["prefix_cache"]["decode_kv_bytes_per_step"])
        ratio = round(per_step[0] / per_step[1], 4) if per_step[1] else None
        result["decode_kv_bytes_per_step" + budget] = {"prefix": per_step[0], "no_prefix": per_step[1], "ratio": ratio}
    if a.host_kv_lines:
        subset = tmp / "host_kv.jsonl"
        subset.write_text("".join(jobs.read_text().splitlines(keepends=True)[:a.host_kv_lines]))
        result["decode_kv_bytes_per_step@kv-on-host"] = host_kv_bytes(a.model, subset, a.new_tokens)
    if a.reference:
        ref = reference(model_dir, ids, a.new_tokens)
        result["identical_to_transformers"] = [first[f"l{i}"] for i in range(a.lines)] == ref
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
