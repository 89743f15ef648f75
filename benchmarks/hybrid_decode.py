"""Decode speed of a linear-attention hybrid against its all-attention twin, at growing context
(issue 63): a small Qwen3-Next-shaped model (transformers' own classes, random weights, fp32)
whose layers are 3 Gated DeltaNet to 1 gated full attention, and the same model with every layer
full attention (same dims, same experts). Each decodes `--new` tokens for `--rows` prompts of
about `--contexts` tokens through the engine on the CPU; decode tokens/s is the engine's own
decode time (stats.decode_s) over the tokens those steps produced. The hybrid's state does not
grow with the text; its twin's keys and values do.

    python benchmarks/hybrid_decode.py [--contexts 1024 8192] [--rows 2] [--new 16] [--repeat 3]

Results: benchmarks/results/hybrid_decode.json (medians of `--repeat` runs, alternating models).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DIMS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            max_position_embeddings=16384)


def prompt_of(tok, tokens: int, seed: int) -> str:
    """Words of a fixed corpus from `seed` on, cut to about `tokens` tokens."""
    words = (Path(__file__).resolve().parents[1] / "klotski" / "builtin" / "data" / "corpus.txt").read_text().split()
    text, i = [], seed * 97
    while len(tok(" ".join(text))["input_ids"]) < tokens:
        text += words[i % len(words): i % len(words) + 256]
        i += 256
    ids = tok(" ".join(text))["input_ids"][:tokens]
    return tok.decode(ids)


def decode_speed(path, prompts, new: int) -> float:
    from conftest import engine_tokens
    _, engine = engine_tokens(path, prompts=prompts, max_new_tokens=new, batch_size=len(prompts), num_batches=1,
                              threads=2)
    s = engine.stats
    return s.decode_useful_rows / s.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_decode.json"))
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from klotski.builtin.families import build_family
    tmp = Path(tempfile.mkdtemp())
    types = ["linear_attention"] * 3 + ["full_attention"]
    models = {"hybrid": build_family(tmp / "hybrid", "qwen3_next", layer_types=types * 2, **DIMS),
              "all-attention": build_family(tmp / "attn", "qwen3_next", layer_types=["full_attention"] * 8, **DIMS)}
    tok = AutoTokenizer.from_pretrained(models["hybrid"])
    results = []
    for ctx in a.contexts:
        prompts = [prompt_of(tok, ctx, seed) for seed in range(a.rows)]
        runs = {name: [] for name in models}
        for _ in range(a.repeat):
            for name, path in models.items():
                runs[name].append(decode_speed(path, prompts, a.new))
        row = {"context": ctx, **{name: statistics.median(v) for name, v in runs.items()}, "runs": runs}
        row["ratio"] = row["hybrid"] / row["all-attention"]
        results.append(row)
        print(f"context {ctx}: hybrid {row['hybrid']:.1f} tok/s, all-attention {row['all-attention']:.1f} tok/s, "
              f"ratio {row['ratio']:.2f}", flush=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"dims": DIMS, "rows": a.rows, "new": a.new, "repeat": a.repeat,
                                       "uptime_after": load, "results": results}, indent=1))
    print(f"uptime after: {load}")


if __name__ == "__main__":
    main()
