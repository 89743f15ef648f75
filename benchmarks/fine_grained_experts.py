"""The CPU expert phase without a cost per expert (issue 60, item 2): two Qwen3-shaped twins
with equal FLOPs per token, 128 experts top-8 and 8 experts top-8 (each expert 128 wide, hidden
64, 3 layers, fp32: klotski.measure.op_count.build_fine_and_coarse), one batch of 32 lines, one
thread, every expert resident. Per model: decode seconds of the engine's run (its own clock),
the compute thread's CPU seconds in the decode steps (steadier than the wall clock on a busy
machine), the part of the decode steps spent in the expert phase (router, sort, counts, waves,
combine: `Pipeline._gates` + `Pipeline._experts`, timed around them), and one layer's expert
phase alone (route, sort, count, the resident stack's wave and the combine for 32 routed
tokens, outside the engine). Each run is a process of its own; runs of the two models (and of
the trees, with --before) alternate so all see the same machine; medians of --repeats; the
128/8 ratios side by side, with `uptime`'s load average before and after.

    python benchmarks/fine_grained_experts.py [--repeats 5] [--tokens 32] [--threads 1]
        [--before DIR] [--width 128] [--out FILE]

`--before DIR`: also run the same measurements with DIR's klotski (a copy of another tree,
e.g. `git archive HEAD | tar -x -C DIR`), interleaved with this tree's runs."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINE, COARSE = 128, 8
KEYS = ("decode_s", "decode_cpu_s", "experts_s", "layer_expert_phase_s")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def decode_run(model: Path, tokens: int, lines: int, threads: int) -> dict:
    """One run of the job: decode seconds, the compute thread's CPU seconds in decode steps, and
    the expert phase's share of the decode steps."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.execute.pipeline import Pipeline
    from klotski.io.requests import Request

    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=lines, num_batches=1,
                    threads=threads)
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list, a passage about things", messages=None,
                    max_new_tokens=tokens) for i in range(lines)]
    engine, seqs, errors = open_engine(cfg, reqs)
    assert not errors, errors
    spent = {"experts_s": 0.0, "cpu_s": 0.0}
    gates, experts, forward = Pipeline._gates, Pipeline._experts, Pipeline.forward

    def cpu_timed(self, kvs, inputs):
        if not all(i.ids.shape[1] == 1 for i in inputs):  # prefill: not counted
            return forward(self, kvs, inputs)
        start = time.thread_time()
        try:
            return forward(self, kvs, inputs)
        finally:
            spent["cpu_s"] += time.thread_time() - start

    def timed(method):
        def run(self, layer, hs, *args):
            if hs[0].shape[1] != 1:
                return method(self, layer, hs, *args)
            start = time.perf_counter()
            try:
                return method(self, layer, hs, *args)
            finally:
                spent["experts_s"] += time.perf_counter() - start
        return run

    Pipeline._gates, Pipeline._experts, Pipeline.forward = timed(gates), timed(experts), cpu_timed
    try:
        outputs = {s.request.id: list(s.out) for s in engine.run(seqs)}
    finally:
        Pipeline._gates, Pipeline._experts, Pipeline.forward = gates, experts, forward
        engine.close()
    return {"decode_s": engine.stats.decode_s, "decode_cpu_s": spent["cpu_s"], "experts_s": spent["experts_s"],
            "outputs": outputs}


def expert_phase_alone(model: Path, tokens: int, repeats: int = 200) -> float:
    """Median seconds of one layer's expert phase over its resident stack for `tokens` routed
    tokens, outside the engine: the router, the sort, the host counts, the resident wave (the
    engine's LayerExperts and the family's grouped FFN, as the pipeline runs them on a CPU) and
    the combine."""
    import torch

    from klotski.execute.experts import LayerExperts, SortKeys, route_group
    from klotski.io.checkpoint import Checkpoint

    ckpt = Checkpoint.open(str(model))
    spec = ckpt.spec
    family, shape, layer = spec.family, spec.shape, 1

    def load(key):
        return {n: ckpt.store.read_ref(ref).float() for n, ref in spec.group_refs(key).items()}
    experts = [load(("expert", layer, e)) for e in range(shape.num_experts)]
    stack = {n: torch.stack([w[n] for w in experts]) for n in experts[0]}
    gate = load(("gate", layer))
    h = torch.randn(tokens, 1, shape.hidden_size, generator=torch.Generator().manual_seed(0))
    ffn = family.bind_grouped_expert_ffn(spec)
    keys = SortKeys.of(list(range(shape.num_experts)), shape.num_experts, lambda t: t)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        routed = route_group(family, spec, [h], gate, [None])
        moe = LayerExperts(routed, shape.top_k, keys)
        moe.resident_wave(ffn, type("Stack", (), {"tensors": stack, "experts": list(range(shape.num_experts))}),
                          lambda t: t)
        moe.count(routed.experts, shape.num_experts)
        moe.hidden_states([h])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one(args) -> None:
    """The measurements of one model in this process (what the parent runs per repeat)."""
    import torch
    torch.set_num_threads(args.threads)
    model = Path(args.one)
    from klotski.models import grouped
    out = decode_run(model, args.tokens, args.lines, args.threads)
    out["layer_expert_phase_s"] = expert_phase_alone(model, args.lines)
    # what a CPU wave of fp32 SwiGLU experts ran (a tree from before BatchedGemm: the grouped kernel)
    out["kernel"] = grouped.cpu_kernel() if hasattr(grouped, "cpu_kernel") else "grouped"
    print(json.dumps(out))


def build(root: Path, width: int) -> dict[int, Path]:
    """The twins (op_count.build_fine_and_coarse's, at another expert width if asked)."""
    from klotski.builtin.families import build_family
    return {e: build_family(root / f"qwen3-{e}-w{width}", "qwen3_moe", num_experts=e, num_experts_per_tok=8,
                            moe_intermediate_size=width, num_hidden_layers=3) for e in (FINE, COARSE)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="new tokens a line")
    p.add_argument("--lines", type=int, default=32, help="lines, in one batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--width", type=int, default=128, help="each expert's intermediate width (both models)")
    p.add_argument("--before", type=Path, help="another tree's klotski, run interleaved with this one")
    p.add_argument("--models", type=Path, help="a folder to build the twins in (kept); a temporary one if not given")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fine_grained_experts.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    trees = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.models or Path(tmp)
        models = build(root, args.width)
        runs = {(t, e): [] for t in trees for e in models}

        def run(tree: Path, model: Path, tokens: int) -> dict:
            env = dict(os.environ, PYTHONPATH=str(tree))
            cmd = [sys.executable, __file__, "--one", str(model), "--tokens", str(tokens), "--lines", str(args.lines),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{tree} {model.name}: {done.stderr[-2000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        for tree in trees.values():  # warm-up: the machine profile and pipeline cost, cached once
            for model in models.values():
                run(tree, model, 2)
        for _ in range(args.repeats):
            for name, tree in trees.items():
                for e, model in models.items():
                    runs[(name, e)].append(run(tree, model, args.tokens))
    load_after = _load()
    rows = {f"{t}, {e} experts": {**{k: statistics.median(r[k] for r in runs[(t, e)]) for k in KEYS},
                                  "decode_s_all": [r["decode_s"] for r in runs[(t, e)]]}
            for t, e in runs}
    ratios = {t: {k: rows[f"{t}, {FINE} experts"][k] / rows[f"{t}, {COARSE} experts"][k] for k in KEYS}
              for t in trees}
    same = {t: runs[(t, FINE)][0]["outputs"] == runs[("after", FINE)][0]["outputs"] for t in trees}
    kernels = {t: runs[(t, FINE)][0]["kernel"] for t in trees}
    print(f"nproc {os.cpu_count()}, threads {args.threads}, expert width {args.width}; "
          f"load average before {load_before}, after {load_after}")
    print(f"{args.lines} lines in one batch, {args.tokens} new tokens each; medians of {args.repeats}; "
          f"CPU wave kernel: " + ", ".join(f"{t} {k}" for t, k in kernels.items()))
    print("| tree, model | decode s | decode CPU s | expert phase in decode, s | one layer's expert phase alone, ms |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['decode_s']:.3f} | {r['decode_cpu_s']:.3f} | {r['experts_s']:.3f} | "
              f"{r['layer_expert_phase_s'] * 1e3:.3f} |")
    for t, q in ratios.items():
        print(f"| {t}, {FINE}/{COARSE} | {q['decode_s']:.2f}x | {q['decode_cpu_s']:.2f}x | {q['experts_s']:.2f}x | "
              f"{q['layer_expert_phase_s']:.2f}x |")
    if len(trees) > 1:
        print(f"128-expert tokens equal across trees: {same['before']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "threads": args.threads,
                                    "width": args.width, "lines": args.lines, "tokens": args.tokens, "kernels": kernels,
                                    "repeats": args.repeats, "rows": rows, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
