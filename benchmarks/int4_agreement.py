"""Issue 60 item 1: greedy agreement and decode speed of 4-bit weights computed as int4 codes
(torch's CPU kernel, compress/int4.py) against the same weights decoded per use, bf16 on a CPU.

  hqq4   the trained model in the box (`smollm2-moe`, --quantize hqq4: attention and experts),
         also against its unquantized fp32 run (the trained model's own tokens)
  Q4_0, Q4_K   small random GGUF Qwen3-MoE files (tests/gguf_models.py: no GGUF of the trained
         model is made here), experts in those blocks

Every group on the device (a given placement: no plan, no profile measured), one batch.
Agreement: the share of generated positions whose token is the same, position by position.

    .venv/bin/python benchmarks/int4_agreement.py [--forms hqq4,Q4_0,Q4_K] [--new 32] [--prompts 8] [--work DIR]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = ["The capital of France is", "Water boils at", "A haiku about the sea:", "def fibonacci(n):",
           "The three primary colours are", "Once upon a time, a small robot", "To make bread you need",
           "The largest planet in the solar system is"]


def run(model: str, dtype: str, prompts: int, new: int, int4_on: bool, **kw):
    """(tokens per prompt, decode tokens/s, the run's seconds) of one in-process run, every group
    on the device."""
    from conftest import requests
    from klotski.assemble import open_engine
    from klotski.compress import ggml, quantized
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.registry import resolve
    from placement.placement import Placement
    path = resolve(model) if not Path(model).exists() else model
    ckpt = Checkpoint.open(str(path))
    keys = ckpt.spec.group_keys()
    ckpt.close()
    saved = ggml.GgufCodec.held_as_int4, quantized.QuantCodec.read
    if not int4_on:  # the blocks (or HQQ's codes) decoded per use, as before issue 60
        ggml.GgufCodec.held_as_int4 = lambda self, ref, qtype: False
        quantized.QuantCodec.read = lambda self, key: quantized.quant.load_quantized(self.directory,
                                                                                      quantized.label(key))
    try:
        cfg = RunConfig(model=str(path), progress=False, dtype=dtype, batch_size=prompts, num_batches=1, **kw)
        engine, seqs, errors = open_engine(cfg, requests(PROMPTS[:prompts], new), placement=Placement.by_kind(keys))
        start = time.perf_counter()
        done = {s.request.id: s.out for s in engine.run(seqs)}
        wall = time.perf_counter() - start
        engine.close()
    finally:
        ggml.GgufCodec.held_as_int4, quantized.QuantCodec.read = saved
    tokens = [done[f"r{i}"] for i in range(prompts)]
    return tokens, engine.stats.decode_useful_rows / max(engine.stats.decode_s, 1e-9), wall


def agreement(a, b) -> float:
    pairs = [(x, y) for r, s in zip(a, b) for x, y in zip(r, s)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--forms", default="hqq4,Q4_0,Q4_K")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--work", help="a folder kept between runs (the HQQ copy is made there once)")
    a = p.parse_args()
    import gguf_models as gm
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    tmp = Path(a.work) if a.work else Path(tempfile.mkdtemp())
    tmp.mkdir(parents=True, exist_ok=True)
    for form in a.forms.split(","):
        if form == "hqq4":
            model, kw = "smollm2-moe", {"quantize": "hqq4", "offload_dir": str(tmp / "hqq4")}
            ref, ref_rate, _ = run(model, "float32", a.prompts, a.new, False)
        else:
            model, kw, ref = str(gm.write(tmp / f"{form}.gguf", form, gm.QWEN3)), {}, None
        kernel, k_rate, k_wall = run(model, "bfloat16", a.prompts, a.new, True, **kw)
        decoded, d_rate, d_wall = run(model, "bfloat16", a.prompts, a.new, False, **kw)
        line = (f"{form:5s} bf16 int4 codes vs decoded per use: agreement {agreement(kernel, decoded):.3f}; "
                f"decode {k_rate:.1f} vs {d_rate:.1f} tok/s ({k_rate / d_rate:.2f}x); run {k_wall:.1f} vs {d_wall:.1f} s")
        if ref is not None:
            line += (f"; vs the unquantized fp32 model: int4 {agreement(kernel, ref):.3f}, "
                     f"decoded {agreement(decoded, ref):.3f}")
        print(line, flush=True)
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
