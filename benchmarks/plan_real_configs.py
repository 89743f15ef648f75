"""The planner on the published configs of the families people download (issue 63): a 24 GB card
with 256 GB of RAM, each model as its hub config.json states it (planner/configs/*.json and the
shapes in planner/shapes.KNOWN_MODELS), no weights read.

    python benchmarks/plan_real_configs.py [--hardware rtx3090-pcie4] [--device-memory 24GB]
                                           [--host-memory 256GB] [--prompt-len 512] [--gen-len 32]

Prints a Markdown table: parameters, the plan (bs x n, precision, host attention/experts) and
its predicted tokens/s, prefill and decode tokens/s. Predicted, never measured: the planner's
cost model on a built-in profile. Results: benchmarks/results/plan_real_configs.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

MODELS = ("mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3", "glm-4.5-air", "glm-4.5", "minimax-m2",
          "ernie-4.5-21b-a3b", "llama-4-scout", "qwen3.6-35b-a3b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="rtx3090-pcie4")
    ap.add_argument("--device-memory", default="24GB")
    ap.add_argument("--host-memory", default="256GB")
    ap.add_argument("--prompt-len", default="512")
    ap.add_argument("--gen-len", default="32")
    a = ap.parse_args()
    from planner.shapes import KNOWN_MODELS, total_params

    rows = []
    print("| model | params | plan | predicted tok/s | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        cmd = [sys.executable, "-m", "klotski.cli", "plan", "--model", model, "--hardware", a.hardware,
               "--device-memory", a.device_memory, "--host-memory", a.host_memory, "--prompt-len", a.prompt_len,
               "--gen-len", a.gen_len, "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        params = total_params(KNOWN_MODELS[model]) / 1e9
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {model} | {params:.0f}B | refused: {why} | | | |")
            rows.append({"model": model, "refused": why})
            continue
        p = json.loads(done.stdout)
        precision = (p.get("precision") or {}).get("quantize") or ("4-bit" if p.get("quant_bits") else "bf16")
        plan = (f"{p['batch_size']} x {p['num_batches']}, {precision}, host attention {p['host_attention']}, "
                f"host experts {p['host_experts']}")
        print(f"| {model} | {params:.0f}B | {plan} | {p['predicted_tokens_per_s']:.1f} | "
              f"{p['prefill_tokens_per_s']:.0f} | {p['decode_tokens_per_s']:.1f} |", flush=True)
        rows.append({"model": model, "params_b": round(params, 1), "batch_size": p["batch_size"],
                     "num_batches": p["num_batches"], "precision": precision,
                     "predicted_tokens_per_s": p["predicted_tokens_per_s"],
                     "prefill_tokens_per_s": p["prefill_tokens_per_s"], "decode_tokens_per_s": p["decode_tokens_per_s"]})
    out = ROOT / "benchmarks" / "results" / "plan_real_configs.json"
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
