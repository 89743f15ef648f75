"""Issue 60 item 1: a quantized weight times m rows on the CPU, each way it can be computed.

For each stored form (GGUF Q4_0, Q4_K, Q8_0, Q5_K, Q6_K, MXFP4, HQQ 4-bit g64) at an
[out, in] shape and m rows, the median time of:

  dequant+mm   today's path: the blocks decoded into a full copy (ggml.dequantize /
               hqq.dequantize_tensor), then F.linear
  int4pack     torch's weight-only kernel (_weight_int4pack_mm_for_cpu) over the codes
               repacked once (compress/int4.py), the per-use scales and zeros built from
               the stored scale fields included (4-bit forms only; bf16 only: fp32 stays exact)
  kept copy    F.linear over a dequantized copy kept in RAM (a placement choice)

in fp32 and bf16 activations, one torch thread (other jobs share the cores). Weights are
cycled through enough copies to exceed the last-level cache, as a decode step reads them.

    .venv/bin/python benchmarks/quantized_kernels.py [--shapes 1536x576,14336x4096] [--rows 1,8,32]
        [--forms Q4_0,Q4_K,HQQ4,Q8_0,Q5_K,Q6_K,MXFP4] [--reps 9]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from klotski.compress import ggml, hqq, int4
from klotski.models import int4 as int4mm

COLD_BYTES = 96 << 20


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def cycling(items):
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]
    return nxt


def gguf_weight(qtype: str, out: int, inp: int, gen) -> torch.Tensor:
    """Random bytes of `qtype` blocks with sane scales (fp16 ~1e-2), [out, row bytes]."""
    _, block, size = ggml.BY_NAME[qtype]
    raw = torch.randint(0, 256, (out * inp // block, size), dtype=torch.uint8, generator=gen)
    scale = torch.full((raw.shape[0], 1), 0.01, dtype=torch.float16).view(torch.uint8)
    for at, kind in ggml.scale_bytes(qtype):
        if kind == "f16":
            raw[:, at:at + 2] = scale
        else:
            raw[:, at] = 120
    return raw.reshape(out, -1)


def run(shapes, rows, reps, forms=("Q4_0", "Q4_K", "HQQ4", "Q8_0", "Q5_K", "Q6_K", "MXFP4")):
    gen = torch.Generator().manual_seed(0)
    print(f"# uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("form   shape        m  dtype  dequant+mm_ms  int4pack_ms  kept_copy_ms")
    for out, inp in shapes:
        for form in forms:
            if form != "HQQ4" and inp % ggml.BY_NAME[form][1]:
                print(f"{form:6s} {out}x{inp:<6d} (rows of {inp} are not whole {form} blocks)")
                continue
            if form == "HQQ4":
                w = torch.randn(out, inp, generator=gen) * 0.02
                parts = hqq.quantize_tensor(w)
                n = max(1, COLD_BYTES // max(1, hqq.packed_nbytes(parts)))
                stored = [parts] + [{k: v.clone() for k, v in parts.items()} for _ in range(min(n, 8) - 1)]
            else:
                raw = gguf_weight(form, out, inp, gen)
                n = max(1, COLD_BYTES // raw.numel())
                stored = [raw] + [raw.clone() for _ in range(min(n, 8) - 1)]
            for dtype in (torch.float32, torch.bfloat16):
                if form == "HQQ4":
                    def deq(s, dtype=dtype):
                        return hqq.dequantize_tensor(s, dtype)
                else:
                    def deq(s, dtype=dtype, form=form):
                        return ggml.dequantize(s, form, dtype)
                kept = [deq(s) for s in stored]
                packed = None
                if dtype != torch.float32 and form in ggml.INT4_FORMS:
                    packed = [ggml.int4_from_blocks(s, form) for s in stored]
                elif dtype != torch.float32 and form == "HQQ4":
                    packed = [int4.from_hqq(s) for s in stored]
                for m in rows:
                    x = torch.randn(m, inp, generator=gen).to(dtype)
                    nxt_s, nxt_k = cycling(stored), cycling(kept)
                    t_deq = timed(lambda: F.linear(x, deq(nxt_s())), reps)
                    t_kept = timed(lambda: F.linear(x, nxt_k()), reps)
                    t_int4 = float("nan")
                    if packed is not None:
                        nxt_p = cycling(packed)
                        scales = int4.hqq_scales_zeros if form == "HQQ4" else \
                            (lambda meta, dtype, form=form: ggml.int4_scales_zeros(meta, form, dtype))

                        def per_use(dtype=dtype, scales=scales):  # the decode that remains: scales and zeros
                            codes, meta = nxt_p()
                            return int4mm.product(x, codes, scales(meta, dtype))
                        t_int4 = timed(per_use, reps)
                    print(f"{form:6s} {out}x{inp:<6d} {m:3d}  {str(dtype)[6:]:8s} {t_deq * 1e3:10.3f} "
                          f"{t_int4 * 1e3:12.3f} {t_kept * 1e3:12.3f}", flush=True)
                del kept, packed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1536x576,576x1536,14336x4096")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--forms", default="Q4_0,Q4_K,HQQ4,Q8_0,Q5_K,Q6_K,MXFP4")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    run(shapes, [int(r) for r in a.rows.split(",")], a.reps, a.forms.split(","))


if __name__ == "__main__":
    main()
