"""What only CUDA shows of issue 37's defects (the CPU side is tests/test_cuda_defects.py):
uploads inside a step never synchronise the device, host compute's time is bubble on the
device's timeline, and the expert phase's launches stay flat in the number of batches."""
import pytest
import torch

from conftest import engine_tokens, reference_tokens
from klotski.assemble import open_engine
from klotski.measure.op_count import build_model, layer_ops
from placement.placement import Placement

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: run tests/gpu on a GPU machine (../shared/gpu/README.md)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("gpu-defects") / "m32", experts=32, top_k=8, layers=3)


def test_padded_prefill_index_upload_does_not_synchronise(model, monkeypatch):
    """The real-token index of a padded prefill goes up pinned (the ring) and non-blocking:
    under `set_sync_debug_mode("error")` a blocking pageable copy would raise."""
    from klotski.execute.staging import SmallUploads
    upload, seen = SmallUploads.__call__, []

    def strict(self, t):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = upload(self, t)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        seen.append(t.shape)
        return out

    monkeypatch.setattr(SmallUploads, "__call__", strict)
    out, _ = engine_tokens(model, batch_size=6, num_batches=1, max_new_tokens=3, device="cuda")
    assert out == reference_tokens(model, max_new_tokens=3) and seen


def test_host_compute_is_bubble_not_compute(model, tmp_path):
    """With host attention and host experts, no compute span on the device's timeline overlaps
    host work: the device idles while the host computes."""
    _, probe = engine_tokens(model, prompts=["x"], max_new_tokens=1, device="cpu")
    placement = Placement.by_kind(probe.spec.group_keys(), kv="host", expert="host")
    out, engine = engine_tokens(model, placement=placement, batch_size=3, num_batches=2, max_new_tokens=4,
                                device="cuda", host_attention="on", host_experts="on",
                                trace=str(tmp_path / "trace.json"))
    assert out == reference_tokens(model, max_new_tokens=4)
    events = engine.trace.events
    host = [(e.start, e.end) for e in events if e.lane == "host"]
    compute = sorted((e.start, e.end) for e in events if e.lane == "compute")
    assert host and compute
    slack = 50e-6  # event timestamps of two clocks
    for a, b in host:
        assert not any(s < b - slack and e > a + slack for s, e in compute), (a, b)
    assert any(e.lane == "activations" for e in events)


def test_launches_do_not_grow_with_batches_times_experts(model):
    """On the GPU as on the CPU: ops(n, A) − ops(1, A) does not depend on A."""
    ops = {(n, a): layer_ops(open_engine, model, n, 4, active=a, device="cuda") for n in (1, 4) for a in (8, 32)}
    assert abs((ops[4, 32] - ops[1, 32]) - (ops[4, 8] - ops[1, 8])) <= 4
