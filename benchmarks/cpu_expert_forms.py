"""Issue 60: other forms of a CPU's expert products, tried on the kept bf16 copy without building
them into the product: each replaces `grouped.grouped_swiglu` for 16-bit waves (an expert at a
time) and is measured by decode speed on the llama.cpp side by side's job, or by greedy agreement
with the trained model's own fp32 run (benchmarks/gguf_agreement.py's measure).

Forms (`--form`):
  kept         the product as it is (the reference run)
  fbgemm       int8 weights per output channel, activations quantized per tensor
               (torch.ops.quantized.linear_dynamic over prepacked weights)
  int_mm       int8 weights per output channel, activations per row, torch._int_mm
  weights      only the weights requantized per channel (activations exact, fp32 product)
  activations  only the activations quantized per row (the weights as decoded)
  prepacked    the bf16 weights reordered once by oneDNN (torch.ops.mkldnn._reorder_linear_weight)

Each form converts an expert's matrix at its first use and keeps it beside the kept copy (not
budget-honest: a measurement only).

    .venv/bin/python benchmarks/cpu_expert_forms.py speed --form fbgemm --model smollm2-moe-Q8_0.gguf
    .venv/bin/python benchmarks/cpu_expert_forms.py agreement --form int_mm --model smollm2-moe-Q8_0.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (int8 codes, fp32 scale per output channel)."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes, fp32 scale per row)."""
    x = x.float()
    scale = (x.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(x / scale).to(torch.int8), scale


def fbgemm_pack(w):
    torch.backends.quantized.engine = "fbgemm"
    codes, scale = per_channel_int8(w)
    q = torch._make_per_channel_quantized_tensor(codes, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(q, None)


FORMS = {  # name -> (convert a [N, K] matrix once, product of x [M, K] with it)
    "fbgemm": (fbgemm_pack, lambda x, p: torch.ops.quantized.linear_dynamic(x.float(), p, False)),
    "int_mm": (per_channel_int8,
               lambda x, p: (lambda xq: torch._int_mm(xq[0], p[0].t()) * xq[1] * p[1])(rows_int8(x))),
    "weights": (per_channel_int8, lambda x, p: F.linear(x.float(), p[0].float() * p[1][:, None])),
    "activations": (lambda w: w.float(), lambda x, p: F.linear((lambda q: q[0].float() * q[1])(rows_int8(x)), p)),
    "prepacked": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 8),
                  lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")),
}


def install(form: str) -> dict:
    """Route 16-bit SwiGLU waves (not the int4 form, not a long prefill's) through `form`; the
    returned dict counts the waves that went so (`calls`)."""
    seen = {"calls": 0}
    if form == "kept":
        return seen
    from klotski.models import grouped
    convert, product = FORMS[form]
    done: dict = {}
    original = grouped.grouped_swiglu

    def matrix(stack: torch.Tensor, g: int):
        # an expert's matrix by where it lives: a wave's weights are row slices of the layer's stack
        key = (stack.untyped_storage().data_ptr(), stack.storage_offset() // stack[0].numel() + g)
        if key not in done:
            done[key] = convert(stack[g])
        return done[key]

    def swiglu(x, w, groups):
        if x.dtype == torch.float32 or "w1.int4_scales_zeros" in w or (form == "prepacked" and len(x) > 64):
            return original(x, w, groups)
        seen["calls"] += 1
        counts = groups.host_counts()
        parts = []
        for g, part in enumerate(x[:sum(counts)].split(counts)):
            if len(part):
                up = F.silu(product(part, matrix(w["w1"], g))) * product(part, matrix(w["w3"], g))
                parts.append(product(up, matrix(w["w2"], g)).to(x.dtype))
        if sum(counts) < len(x):
            parts.append(x.new_zeros(len(x) - sum(counts), x.shape[-1]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    grouped.grouped_swiglu = swiglu
    return seen


def speed(a) -> None:
    """One `klotski generate` of the side by side's job (32 lines x 128 random ids, 64 new tokens,
    one batch, one thread) in this process with `--form` installed: its decode and prefill tok/s."""
    from llamacpp_side_by_side import NPL, bench_lock, write_jobs

    from klotski.cli.main import main
    seen = install(a.form)
    work = Path(tempfile.mkdtemp())
    jobs, report = write_jobs(work / "jobs.jsonl"), work / "report.json"
    with bench_lock():
        load = os.getloadavg()[0]
        main(["generate", str(jobs), "-o", str(work / "out.jsonl"), "--no-resume", "--no-progress", "--report",
              str(report), "--model", a.model, "--device", "cpu", "--threads", "1", "--batch-size", str(NPL),
              "--no-prefix-cache"])
    r = json.loads(report.read_text())
    print(json.dumps({"form": a.form, "model": Path(a.model).name, "load_before": load,
                      "decode_tok_s": round((r["tokens"]["generated"] - r["requests"]["ok"]) / r["decode_s"], 1),
                      "prefill_tok_s": round(r["tokens"]["prompt"] / r["prefill_s"], 1),
                      "waves_in_the_form": seen["calls"]}))


def agreement(a) -> None:
    """Greedy agreement of the GGUF file in bf16 with `--form` installed against the trained
    model's own fp32 run (gguf_agreement.run: every group on the device, one batch, one thread)."""
    from gguf_agreement import run
    from int4_agreement import agreement as share
    ref, _ = run("smollm2-moe", "float32", a.prompts, a.new)
    seen = install(a.form)
    got, copies = run(a.model, "bfloat16", a.prompts, a.new)
    same = sum(g == r for g, r in zip(got, ref))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"| {Path(a.model).name} | {a.form} | decoded copies {copies} | {share(got, ref):.3f} | "
          f"{same}/{len(ref)} | {seen['calls']} waves in the form | {uptime} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["speed", "agreement"])
    p.add_argument("--form", choices=["kept", *FORMS], default="kept")
    p.add_argument("--model", required=True, help="a GGUF file (llamacpp_side_by_side.py writes them)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    a = p.parse_args()
    speed(a) if a.what == "speed" else agreement(a)


if __name__ == "__main__":
    main()
