"""The expert phase's host work does not grow with batches × experts (issue 37): counted in
ATen ops per decode layer step on the compute thread (klotski/measure/op_count.py), which on a
GPU are kernel launches. Counting, not timing: the same on any CPU."""
import pytest

from klotski.assemble import open_engine
from klotski.measure.op_count import build_model, fit, layer_ops


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("ops") / "m32", experts=32, top_k=8, layers=3)


def test_more_batches_add_no_work_per_expert(model):
    """ops(n, A) − ops(1, A) must not depend on A: an A·n term (a loop over batches × experts)
    is back otherwise. The per-batch loop this replaced gave 6·A·(n − 1) more ops."""
    rows = [(n, a, layer_ops(open_engine, model, n, 4, active=a)) for n in (1, 2, 4) for a in (8, 16, 32)]
    ops = {(n, a): o for n, a, o in rows}
    for n in (2, 4):
        extra = [ops[n, a] - ops[1, a] for a in (8, 16, 32)]
        assert max(extra) - min(extra) <= 4, (n, extra)
    assert abs(fit(rows)["d"]) < 0.1


def test_a_group_split_into_batches_costs_only_its_attention(model):
    """One group of 32 sequences split into 8 batches of 4 costs what 7 more batches cost, no
    more: the same tokens and experts, in one expert phase; only attention is per batch. (With
    the experts grouped the phase is a few ops, so the per-batch attention is most of a layer:
    a ratio bound no longer says anything.)"""
    per_batch = layer_ops(open_engine, model, 2, 4) - layer_ops(open_engine, model, 1, 4)
    assert layer_ops(open_engine, model, 8, 4) - layer_ops(open_engine, model, 1, 32) <= 7 * per_batch + 8


def test_fine_grained_experts_cost_what_coarse_ones_do(tmp_path_factory):
    """128 experts top-8 against 8 experts top-8 at equal FLOPs per token, the same job: the
    compute thread's ATen ops at most 1.5x with every expert resident and at most 2.5x with
    every expert streamed from host memory through a tight device budget (issue 45; the
    grouped expert waves and stacked landings; before them 2.28x and 2.52x on a longer job)."""
    from klotski.measure.op_count import FINE, COARSE, build_fine_and_coarse, job_ops
    models = build_fine_and_coarse(tmp_path_factory.mktemp("fine"))
    for host, budget, bound in ((False, None, 1.5), (True, 8 << 20, 2.5)):
        runs = {e: job_ops(open_engine, m, experts_on_host=host, device_memory=budget, lines=16, tokens=8)
                for e, m in models.items()}
        assert runs[FINE]["ops"] <= bound * runs[COARSE]["ops"], (host, runs[FINE]["ops"], runs[COARSE]["ops"])


def test_packed_fine_grained_experts_cost_what_coarse_ones_do(tmp_path_factory):
    """The same for HQQ 4-bit experts streamed from host memory through a tight budget: they
    land packed in the pool (one copy each), are decoded into their slots a run at a time and
    computed in grouped waves, so 128 experts cost at most 2.5x the ops of 8 as 16-bit ones do.
    Each moved into a copy of its own, decoded (24 parts) and computed alone, it was 5.53x
    (197734 against 35737 ops: docs/benchmarks.md)."""
    from klotski.measure.op_count import FINE, COARSE, build_fine_and_coarse, job_ops
    root = tmp_path_factory.mktemp("fine-hqq")
    models = build_fine_and_coarse(root)
    runs = {e: job_ops(open_engine, m, experts_on_host=True, device_memory=8 << 20, lines=16, tokens=8, quantize="hqq4",
                       offload_dir=str(root / f"hqq-{e}")) for e, m in models.items()}
    assert runs[FINE]["ops"] <= 2.5 * runs[COARSE]["ops"], (runs[FINE]["ops"], runs[COARSE]["ops"])
