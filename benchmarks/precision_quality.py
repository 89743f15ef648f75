"""What each precision the planner offers costs in quality (issue 39), measured once on the
built-in trained model `smollm2-moe` and written to klotski/builtin/data/precision_quality.json,
the table `klotski plan` prints beside each option.

Reference: the checkpoint as stored (float32). For each option the expert weights (and, for
hqq4, the attention projections too, as `--quantize hqq4` packs them) are replaced by their
round trip through that format, then every prompt plus the reference's own greedy
continuation is scored teacher-forced, so one early difference does not decide the rest:

  agreement      share of continuation positions where the option's argmax is the reference token
  logprob_gap    mean over those positions of log p_ref(token) - log p_option(token), nats (>= 0: worse)

hqq4 goes through the engine's own codec (klotski.compress.hqq.quantize_group and
dequantize_group, which `--quantize hqq4` calls to build and read its copy), Q8_0 and Q4_0
through gguf.quants.quantize/dequantize, bfloat16 through a cast. smollm2-moe's experts are
copies of one dense MLP per layer (klotski/builtin/smollm.py), so one expert per layer is
round-tripped and copied to the others: the same result as doing each, 8x sooner.

    python benchmarks/precision_quality.py --prompts 32 --new-tokens 32
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "klotski" / "builtin" / "data" / "precision_quality.json"
WHAT = {
    "float32": "the checkpoint as stored (the reference against itself: the noise floor)",
    "bfloat16": "expert weights cast to bfloat16",
    "hqq4": "attention and expert projections through the engine's HQQ 4-bit codec (group 64, 8-bit scales)",
    "Q8_0": "expert weights through gguf.quants Q8_0 (8-bit, one fp16 scale per 32)",
    "Q4_0": "expert weights through gguf.quants Q4_0 (4-bit, one fp16 scale per 32)",
}


def prompts(count: int) -> list[str]:
    lines = (ROOT / "jobs" / "wikitext.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


def experts(model):
    """{(layer, part): the fused [E, rows, cols] expert parameter} (transformers 5 layout)."""
    out = {}
    for j, layer in enumerate(model.model.layers):
        for part in ("gate_up_proj", "down_proj"):
            out[j, part] = getattr(layer.mlp.experts, part)
    return out


def round_trip_gguf(kind: str):
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    qtype = GGMLQuantizationType[kind]

    def f(w: torch.Tensor) -> torch.Tensor:
        a = w.detach().float().numpy().astype(np.float32)
        return torch.from_numpy(quants.dequantize(quants.quantize(a, qtype), qtype).copy()).to(w.dtype)
    return f


def apply(model, option: str, originals: dict, attention: dict) -> None:
    """Set the model's weights to the `option` round trip of the originals (restored first)."""
    from klotski.compress import hqq
    with torch.no_grad():
        for key, p in experts(model).items():
            p.copy_(originals[key])
        for key, p in attention.items():
            p.copy_(originals[key])
        if option == "float32":
            return
        if option == "hqq4":
            spec = hqq.QuantSpec()
            for j, layer in enumerate(model.model.layers):
                # engine names: w1 gate, w3 up, w2 down; q/k/v/o (klotski.compress.hqq.PROJECTIONS)
                gu, down = originals[j, "gate_up_proj"][0], originals[j, "down_proj"][0]
                inter = gu.shape[0] // 2
                group = {"w1": gu[:inter], "w3": gu[inter:], "w2": down}
                back = hqq.dequantize_group(hqq.quantize_group(group, spec), torch.float32)
                layer.mlp.experts.gate_up_proj.copy_(torch.cat([back["w1"], back["w3"]]).expand_as(gu[None]))
                layer.mlp.experts.down_proj.copy_(back["w2"].expand_as(down[None]))
                attn = {n: originals["attn", j, n] for n in "qkvo"}
                back = hqq.dequantize_group(hqq.quantize_group(attn, spec), torch.float32)
                for n in "qkvo":
                    getattr(layer.self_attn, f"{n}_proj").weight.copy_(back[n])
            return
        trip = (lambda w: w.to(torch.bfloat16).float()) if option == "bfloat16" else round_trip_gguf(option)
        for (j, part), p in experts(model).items():
            p.copy_(trip(originals[j, part][0]).expand_as(p))


def score(model, sequences, prompt_lens) -> tuple[float, float, int]:
    """(agreement, mean log-prob gap vs the stored reference log-probs, positions)."""
    agree, total, logps = 0, 0, []
    with torch.no_grad():
        for ids, n in zip(sequences, prompt_lens):
            logits = model(torch.tensor([ids])).logits[0, n - 1:-1].float()
            target = torch.tensor(ids[n:])
            lp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
            agree += int((logits.argmax(dim=-1) == target).sum())
            total += len(target)
            logps.append(lp)
    return agree / total, torch.cat(logps), total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--options", default="float32,bfloat16,Q8_0,hqq4,Q4_0")
    ap.add_argument("--out", default=str(TABLE))
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klotski.io import registry
    torch.manual_seed(0)
    path = registry.resolve("smollm2-moe")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for j, layer in enumerate(model.model.layers):  # the shortcut below relies on identical experts
        assert all(torch.equal(p[0], p[e]) for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
                   for e in range(1, p.shape[0])), f"layer {j}: experts differ"
    originals = {k: p.detach().clone() for k, p in experts(model).items()}
    attention = {}
    for j, layer in enumerate(model.model.layers):
        for n in "qkvo":
            w = getattr(layer.self_attn, f"{n}_proj").weight
            originals["attn", j, n], attention["attn", j, n] = w.detach().clone(), w
    texts = prompts(a.prompts)
    sequences, prompt_lens = [], []
    t0 = time.time()
    with torch.no_grad():  # the reference's greedy continuation of every prompt
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                                 min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            sequences.append(out[0].tolist())
            prompt_lens.append(ids.shape[1])
            print(f"reference {len(sequences)}/{len(texts)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    _, ref_lp, positions = score(model, sequences, prompt_lens)
    rows = {}
    for option in a.options.split(","):
        apply(model, option, originals, attention)
        agreement, lp, _ = score(model, sequences, prompt_lens)
        rows[option] = {"agreement": round(agreement, 4), "logprob_gap": round(float((ref_lp - lp).mean()), 5),
                        "what": WHAT[option]}
        print(f"{option:9s} agreement {agreement:.4f}  log-prob gap {rows[option]['logprob_gap']:.5f} nats",
              file=sys.stderr, flush=True)
    table = {"model": "smollm2-moe", "reference": "float32 (the checkpoint as stored)",
             "prompts": len(texts), "new_tokens": a.new_tokens, "positions": positions,
             "metric": "teacher-forced on the reference's greedy continuation: argmax agreement, mean log-prob "
                       "gap in nats (reference minus option)",
             "command": "python benchmarks/precision_quality.py " + " ".join(sys.argv[1:]),
             "machine": f"{platform.machine()} CPU, torch {torch.__version__}", "seconds": round(time.time() - t0),
             "options": rows}
    Path(a.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
