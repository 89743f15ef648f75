"""How many ATen ops the compute thread issues per layer of a decode step, for n batches of bs
rows with A experts active: the host's share of a GPU step (each op not a view is a launch).
Used by `benchmarks/op_count.py` (the table and its fit) and by the gate test that keeps the
expert phase's launches independent of the number of batches; and the counts of a real run a
plan's predicted kernels and submissions per decode layer are checked against
(`tests/test_plan_ops.py`, `benchmarks/plan_ops.py`). Engines are opened with the composition
root's `open_engine` (klotski.assemble), handed in: this room sits below it."""
from __future__ import annotations

import statistics
import types
from pathlib import Path

import numpy as np
import torch

from klotski.measure.opcounter import OpCounter


def forced_routing(family, active: int):
    """The family's hooks, with a router that picks exactly `active` experts for any tokens:
    token t's k slots go to experts (t·k + j) mod active, so A is set by the caller, not by
    random weights. The router's own weights are kept (the math is unchanged, only the choice)."""
    hooks = types.SimpleNamespace(**{n: getattr(family, n) for n in dir(family) if not n.startswith("__")})

    def route(x, gate, spec):
        weights, experts = family.route(x, gate, spec)
        picks = torch.arange(experts.numel(), device=experts.device) % active
        return weights, picks.view_as(experts)
    hooks.route = route
    return hooks


def build_model(root: Path, experts: int = 32, top_k: int = 8, layers: int = 3) -> Path:
    """A tiny Mixtral with `experts` experts, `top_k` per token (launch-bound: small widths)."""
    from klotski.builtin import tiny
    return tiny.build_checkpoint(root, "tiny", num_local_experts=experts, num_experts_per_tok=top_k,
                                 num_hidden_layers=layers)


def layer_ops(open_engine, model_dir, n: int, bs: int, active: int | None = None, schedule: str = "klotski",
              kernels: bool = True, dtype: str = "float32", **config) -> float:
    """Median ops per decode layer step (layers after the first, so embedding is not counted),
    for a group of n batches of bs rows; `active` forces A (forced_routing)."""
    from klotski.config import RunConfig
    from klotski.io.requests import Request

    cfg = RunConfig(model=str(model_dir), progress=False, dtype=dtype, batch_size=bs, num_batches=n,
                    batching="static", schedule=schedule, **config)
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list", messages=None, max_new_tokens=3)
            for i in range(n * bs)]
    engine, seqs, errors = open_engine(cfg, reqs)
    assert not errors, errors
    hooks = None if active is None else forced_routing(engine.spec.family, active)
    counts, seen = [], {"last": 0}
    counter = OpCounter()

    def on_layer(layer, hs):
        now = counter.kernels if kernels else counter.total
        if layer > 0 and hs[0].shape[1] == 1:  # a decode step's layer, embedding excluded
            counts.append(now - seen["last"])
        seen["last"] = now

    try:
        with engine.pipeline.instrumented(hooks=hooks, on_layer=on_layer), counter:
            list(engine.run(seqs))
    finally:
        engine.close()
    return statistics.median(counts)


def fit(rows: list[tuple[int, int, float]]) -> dict:
    """Least squares ops = a + b·n + c·A + d·A·n over (n, A, ops) rows."""
    X = np.array([[1, n, a, a * n] for n, a, _ in rows], dtype=float)
    y = np.array([o for _, _, o in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    worst = float(np.max(np.abs(X @ coef - y))) if len(rows) else 0.0
    return {"a": coef[0], "b": coef[1], "c": coef[2], "d": coef[3], "max_residual": worst}


# ---- fine-grained against coarse at equal FLOPs per token (issue 45) ------------------------
FINE, COARSE = 128, 8  # experts per layer; both route each token to 8 experts of the same width


def build_fine_and_coarse(root: Path, layers: int = 3) -> dict[int, Path]:
    """Two Qwen3-shaped models that differ only in their number of experts (128 and 8, top-8,
    each 128 wide): the same FLOPs per token, 16x the expert weights."""
    from klotski.builtin.families import build_family
    return {e: build_family(root / f"qwen3-{e}", "qwen3_moe", num_experts=e, num_experts_per_tok=8,
                            moe_intermediate_size=128, num_hidden_layers=layers) for e in (FINE, COARSE)}


def job_ops(open_engine, model_dir, *, experts_on_host: bool, device_memory: int | None = None, lines: int = 32,
            tokens: int = 24, bs: int = 8, n: int = 4, **options) -> dict:
    """ATen ops (all, and kernels: not views) the compute thread issues for a whole job of
    `lines` prompts, `tokens` new tokens each, and its decode seconds (one run): every expert
    resident, or every expert streamed from host memory through `device_memory`. `options`:
    more RunConfig fields (`quantize="hqq4", offload_dir=...`)."""
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.requests import Request
    from placement.placement import Placement

    keys = Checkpoint.open(str(model_dir)).spec.group_keys()
    placement = Placement.by_kind(keys, expert="host" if experts_on_host else "device")
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", batch_size=bs, num_batches=n,
                    device_memory=device_memory, **options)
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list, a passage about things", messages=None,
                    max_new_tokens=tokens) for i in range(lines)]
    engine, seqs, errors = open_engine(cfg, reqs, placement=placement)
    assert not errors, errors
    counter = OpCounter()
    try:
        with counter:
            outputs = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        engine.close()
    return {"ops": counter.total, "kernels": counter.kernels, "decode_s": engine.stats.decode_s,
            "prefill_s": engine.stats.prefill_s, "outputs": outputs}


# ---- a plan's predicted kernels and submissions against a real run (issue 45, item 4) -------
def counted_profile(open_engine, model_dir, hardware: str = "rtx3090-pcie4"):
    """`hardware`'s built-in profile (its times only steer a plan's choices) with the counts a
    profile measured here carries: the model math's ops (EngineOps.kernels) and the pipeline's
    own (overhead.py, one round), both counted by the engine on this CPU in fp32."""
    from klotski.io.checkpoint import Checkpoint
    from klotski.measure.overhead import LAUNCHES, pipeline_overhead
    from klotski.measure.profile_ops import EngineOps
    from planner.profile import load_profile
    from planner.shapes import as_shape
    shape = as_shape(Checkpoint.open(str(model_dir)).spec)
    profile = load_profile(hardware)
    profile.kernels = EngineOps()(shape, torch.float32, torch.device("cpu")).kernels()
    found = pipeline_overhead("cpu", open_engine, steps=2, rounds=1)
    profile.launches = {k[len(LAUNCHES):]: v for k, v in found.items() if k.startswith(LAUNCHES)}
    return profile


def decode_layer_counts(open_engine, config, requests, placement) -> tuple[float, float]:
    """(kernels, channel submissions) per decode layer of a real run of `requests`: every
    decode step's ATen ops that compute or copy on the compute thread (embedding and LM head
    included: a plan spreads them over the layers) and every transfer submitted to a channel
    during those steps, each over the decode steps times the layers."""
    from klotski.execute.channels import Channel
    engine, seqs, errors = open_engine(config, requests, placement=placement)
    assert not errors, errors
    counter, decoding, kernels, submitted = OpCounter(), [False], [], [0]
    submit, forward = Channel.submit, engine.pipeline.forward

    def counting_submit(channel, fn, **kw):
        submitted[0] += decoding[0]
        return submit(channel, fn, **kw)

    def decode_forward(kvs, inputs):
        decoding[0] = all(i.ids.shape[1] == 1 for i in inputs)
        before = counter.kernels
        out = forward(kvs, inputs)
        if decoding[0]:
            kernels.append(counter.kernels - before)
        decoding[0] = False
        return out

    Channel.submit, engine.pipeline.forward = counting_submit, decode_forward
    try:
        with counter:
            list(engine.run(seqs))
    finally:
        Channel.submit = submit
        engine.close()
    layers = max(1, len(kernels)) * engine.spec.shape.num_layers
    return sum(kernels) / layers, submitted[0] / layers

