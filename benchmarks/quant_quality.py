"""What HQQ 4-bit costs in quality (issue 5): perplexity on jobs/wikitext.jsonl prompts and
greedy agreement, unquantized vs quantized, on the `small` preset.

The quantized model is transformers' own Mixtral with every attention and expert
projection replaced by `dequantize(quantize(W))` from klotski.compress.hqq — the same arithmetic
the engine runs — so the comparison isolates the quantization error.

    python benchmarks/quant_quality.py --prompts 64 --new-tokens 16
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def quantize_model(model, spec):
    from klotski.compress import hqq as quant
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if base in ("q_proj", "k_proj", "v_proj", "o_proj") and p.dim() == 2:
                p.copy_(quant.dequantize_tensor(quant.quantize_tensor(p.data, spec), p.dtype))
            elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:  # fused experts
                for e in range(p.shape[0]):
                    p[e].copy_(quant.dequantize_tensor(quant.quantize_tensor(p.data[e], spec), p.dtype))


def perplexity(model, tok, prompts):
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in prompts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out = model(ids, labels=ids)
            n = ids.shape[1] - 1
            nll += out.loss.item() * n
            count += n
    return math.exp(nll / count)


def greedy(model, tok, prompts, new_tokens):
    outs = []
    with torch.no_grad():
        for text in prompts:
            ids = tok(text, return_tensors="pt")
            g = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
            outs.append(g[0, ids["input_ids"].shape[1]:].tolist())
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klotski.compress import hqq as quant
    from klotski.builtin.tiny import build_checkpoint
    model_dir = build_checkpoint(Path(tempfile.mkdtemp()) / a.preset, a.preset)
    prompts = [json.loads(l)["prompt"] for l in (ROOT / "jobs/wikitext.jsonl").read_text().splitlines()[: a.prompts]]
    tok = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    for label in ("bf16", "hqq4"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if label == "hqq4":
            quantize_model(model, quant.QuantSpec())
        results[label] = {"perplexity": perplexity(model, tok, prompts), "tokens": greedy(model, tok, prompts, a.new_tokens)}
    a_tok, b_tok = results["bf16"]["tokens"], results["hqq4"]["tokens"]
    same_tokens = sum(x == y for s, t in zip(a_tok, b_tok) for x, y in zip(s, t))
    total = sum(min(len(s), len(t)) for s, t in zip(a_tok, b_tok))
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a_tok, b_tok)]
    summary = {
        "preset": a.preset, "prompts": len(prompts), "new_tokens": a.new_tokens,
        "perplexity_bf16_weights": round(results["bf16"]["perplexity"], 3),
        "perplexity_hqq4": round(results["hqq4"]["perplexity"], 3),
        "token_agreement": round(same_tokens / total, 4),
        "identical_sequences": sum(s == t for s, t in zip(a_tok, b_tok)),
        "mean_identical_prefix": round(sum(prefix) / len(prefix), 2),
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
