"""The expert phase's host work does not grow with batches × experts (issue 37): counted in
ATen ops per decode layer step on the compute thread (klotski/bench/op_count.py), which on a
GPU are kernel launches. Counting, not timing: the same on any CPU."""
import pytest

from klotski.bench.op_count import build_model, fit, layer_ops


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("ops") / "m32", experts=32, top_k=8, layers=3)


def test_more_batches_add_no_work_per_expert(model):
    """ops(n, A) − ops(1, A) must not depend on A: an A·n term (a loop over batches × experts)
    is back otherwise. The per-batch loop this replaced gave 6·A·(n − 1) more ops."""
    rows = [(n, a, layer_ops(model, n, 4, active=a)) for n in (1, 2, 4) for a in (8, 16, 32)]
    ops = {(n, a): o for n, a, o in rows}
    for n in (2, 4):
        extra = [ops[n, a] - ops[1, a] for a in (8, 16, 32)]
        assert max(extra) - min(extra) <= 4, (n, extra)
    assert abs(fit(rows)["d"]) < 0.1


def test_a_group_split_into_batches_costs_little_more(model):
    """One group of 32 sequences split into 8 batches of 4 issues at most 2.5× the ops of one
    batch of 32 (the same tokens and experts; only attention is inherently per batch)."""
    assert layer_ops(model, 8, 4) <= 2.5 * layer_ops(model, 1, 32)
