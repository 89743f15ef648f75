"""ATen ops the compute thread issues per decode layer step (each not a view is a kernel
launch on a GPU), over n batches and A active experts, with the fit a + b·n + c·A + d·A·n,
and one group of 32 sequences as 1 batch of 32 against 8 batches of 4 (issue 37).

    python benchmarks/op_count.py [--out benchmarks/results/op_count.json]

Counts, not seconds: the same on any machine. Model: a tiny Mixtral with 32 experts, top-8,
3 layers, fp32; A forced by a router that picks (t·k + j) mod A (klotski/measure/op_count.py).
"""
import argparse
import json
import tempfile
from pathlib import Path

from klotski.assemble import open_engine
from klotski.measure.op_count import build_model, fit, layer_ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "op_count.json")
    p.add_argument("--bs", type=int, default=4, help="rows per batch in the grid (default 4)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "m32", experts=32, top_k=8, layers=3)
        rows = [(n, a, layer_ops(open_engine, model, n, args.bs, active=a)) for n in (1, 2, 4, 8) for a in (8, 16, 24, 32)]
        one, split = layer_ops(open_engine, model, 1, 32), layer_ops(open_engine, model, 8, 4)
        total_one, total_split = layer_ops(open_engine, model, 1, 32, kernels=False), layer_ops(open_engine, model, 8, 4, kernels=False)
    f = fit(rows)
    print(f"ops per decode layer step (kernels: ATen ops that are not views), bs={args.bs}")
    print("| n \\ A | " + " | ".join(str(a) for a in (8, 16, 24, 32)) + " |")
    print("|---|" + "---|" * 4)
    for n in (1, 2, 4, 8):
        print(f"| {n} | " + " | ".join(f"{o:g}" for m, a, o in rows if m == n) + " |")
    print(f"fit: {f['a']:.1f} + {f['b']:.1f}·n + {f['c']:.2f}·A + {f['d']:.2f}·A·n  (max residual {f['max_residual']:.2f})")
    print(f"32 sequences, random routing: 1x32 {one:g} kernels ({total_one:g} ops), "
          f"8x4 {split:g} ({total_split:g}): {split / one:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bs": args.bs, "grid": rows, "fit": f, "one_by_32": one, "eight_by_4": split,
                                    "ratio": split / one}, indent=1) + "\n")


if __name__ == "__main__":
    main()
