"""KV bytes per token of MLA's latent cache against the full keys and values it stands for.

Measured: a small DeepSeek-V2-shaped test model (transformers' own classes, fp32) generates
through the engine; every BatchKV it allocates is recorded and its bytes (keys + values
tensors, every layer) divided by its slots gives bytes per token. Computed: the same ratio
for the real DeepSeek-V2-Lite and V3 shapes (planner/shapes.py KNOWN_MODELS), in bf16.

    python benchmarks/mla_kv.py [--out benchmarks/results/mla-kv.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def full_kv_bytes_per_token(shape, dtype_bytes: int) -> int:
    """Keys (nope + rope) and values of every head, as a cache of full K/V would store them."""
    per_layer = shape.num_heads * (shape.qk_nope_head_dim + shape.head_dim + shape.v_head_dim)
    return shape.num_layers * per_layer * dtype_bytes


def measured(tmp: Path) -> dict:
    from conftest import engine_tokens

    from klotski.execute import kvcache
    from klotski.builtin.families import build_family
    path = build_family(tmp / "v2", "deepseek_v2", hidden_size=128, num_attention_heads=8, kv_lora_rank=64,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    seen = []
    original = kvcache.BatchKV.__init__

    def spy(self, *a, **kw):
        original(self, *a, **kw)
        seen.append(self)
    kvcache.BatchKV.__init__ = spy
    try:
        _, engine = engine_tokens(path, batch_size=3, num_batches=2, max_new_tokens=8)
    finally:
        kvcache.BatchKV.__init__ = original
    shape = engine.spec.shape
    seen = [kv for kv in seen if len(kv.keys) == shape.num_layers]  # the run's, not the profile's one-layer ones
    nbytes = sum(t.numel() * t.element_size() for kv in seen for t in kv.keys + kv.values)
    tokens = sum(kv.capacity * kv.valid.shape[0] for kv in seen)  # slots x sequences
    return {"model": "tiny deepseek_v2 (hidden 128, 8 heads, kv_lora_rank 64, rope 16, nope 32, v 32, 3 layers)",
            "dtype": "float32", "kv_bytes_allocated": nbytes, "token_slots": tokens,
            "bytes_per_token": nbytes / tokens, "planner_bytes_per_token": shape.kv_bytes_per_token(4),
            "full_kv_bytes_per_token": full_kv_bytes_per_token(shape, 4)}


def computed() -> dict:
    from planner.shapes import KNOWN_MODELS
    out = {}
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        s = KNOWN_MODELS[name]
        latent, full = s.kv_bytes_per_token(2), full_kv_bytes_per_token(s, 2)
        out[name] = {"values_per_token_layer": s.kv_width, "bytes_per_token": latent,
                     "full_kv_values_per_token_layer": full // (2 * s.num_layers), "full_kv_bytes_per_token": full,
                     "ratio": round(full / latent, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/mla-kv.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"measured": measured(Path(tmp)), "computed_bf16": computed()}
    m = result["measured"]
    m["ratio"] = round(m["full_kv_bytes_per_token"] / m["bytes_per_token"], 2)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
