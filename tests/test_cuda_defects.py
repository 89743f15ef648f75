"""Defects of the CUDA path that a CPU can catch (issue 37): the padded prefill's token index
sent up without blocking, host compute's results on their own channel and outside compute
spans, and the expert order asking each transfer once. (tests/gpu/test_gpu_defects.py checks
what only CUDA shows.)"""
from contextlib import contextmanager

import pytest
import torch

from conftest import PROMPTS, engine_tokens
from klotski.measure.op_count import build_model
from klotski.execute import pipeline as P
from klotski.execute.trace import Trace
from placement.placement import Placement


@pytest.fixture(scope="module")
def host_placement(checkpoints):
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    return Placement.by_kind(probe.spec.group_keys(), kv="host", expert="host")


def test_padded_prefill_index_goes_up_through_the_pinned_upload(checkpoints, monkeypatch):
    """The real-token index of a padded prefill is built on the host and sent by the
    pipeline's upload (the pinned ring, non-blocking), not copied pageable and blocking."""
    from klotski.execute.staging import SmallUploads
    made, uploaded = [], []
    real_tokens, upload = P.real_tokens, SmallUploads.__call__

    def made_here(valid):
        keep = real_tokens(valid)
        if keep is not None:
            assert keep.device.type == "cpu"
            made.append(keep)
        return keep

    def recording(self, t):
        uploaded.append(t)
        return upload(self, t)

    monkeypatch.setattr(P, "real_tokens", made_here)
    monkeypatch.setattr(SmallUploads, "__call__", recording)
    out, _ = engine_tokens(checkpoints["gqa"], batch_size=6, num_batches=1, max_new_tokens=2)
    assert made and all(any(k is u for u in uploaded) for k in made)


def test_host_results_travel_apart_from_kv_loads_and_outside_compute_spans(checkpoints, host_placement, monkeypatch):
    """Host compute's outputs come up on the `activations` channel (behind KV loads they would
    queue for nothing), and, where the device is not the host (CUDA), no compute span is open
    while the host computes: that time is bubble."""
    from klotski.execute.channels import Channel
    lanes, open_spans, overlaps = [], [0], []
    submit = Channel.submit

    def recording_submit(self, fn, *, name, **kw):
        if name.startswith(("attn_out.", "y.")):
            lanes.append(self.name)
        return submit(self, fn, name=name, **kw)

    @contextmanager
    def span(self, lane, name, nbytes=0, link=None):
        open_spans[0] += lane == "compute"
        try:
            yield
        finally:
            open_spans[0] -= lane == "compute"

    add = Trace.add

    def checked_add(self, lane, *args, **kw):
        if lane == "host" and open_spans[0]:
            overlaps.append(args[0])
        return add(self, lane, *args, **kw)

    monkeypatch.setattr(Channel, "submit", recording_submit)
    monkeypatch.setattr(Trace, "span", span)
    monkeypatch.setattr(Trace, "add", checked_add)
    init = Trace.__init__

    def as_on_a_gpu(self, *a, **kw):  # spans read as the GPU's trace reads them
        init(self, *a, **kw)
        self.cuda = True

    monkeypatch.setattr(Trace, "__init__", as_on_a_gpu)
    monkeypatch.setattr(Trace, "resolve", lambda self, everything=False: None)
    out, _ = engine_tokens(checkpoints["gqa"], placement=host_placement, batch_size=3, num_batches=2,
                                max_new_tokens=3, host_attention="on", host_experts="on")
    assert lanes and set(lanes) == {"activations"}
    assert overlaps == []


def test_expert_order_asks_each_transfer_once(tmp_path):
    """Ordering A experts queries each one's transfer once (not O(A²) event queries: ~8k per
    layer on a Qwen3-shaped model) and reads the submission order once."""
    model = build_model(tmp_path / "m32", experts=32, top_k=8, layers=2)
    calls, sizes = [], []
    order = P.Pipeline._order

    def counted(self, layer, chosen, hot):
        ready = self.cache.ready
        n = [0]

        def counting(key):
            n[0] += 1
            return ready(key)
        self.cache.ready = counting
        try:
            return list(order(self, layer, chosen, hot))
        finally:
            self.cache.ready = ready
            calls.append(n[0])
            sizes.append(len(chosen))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P.Pipeline, "_order", counted)
        engine_tokens(model, prompts=PROMPTS * 2, batch_size=4, num_batches=3, max_new_tokens=3,
                      device_memory=12 << 20)
    assert sizes and max(sizes) >= 16
    assert all(c <= a for c, a in zip(calls, sizes)), list(zip(calls, sizes))


def test_a_thread_that_runs_an_engine_it_did_not_build_counts_its_cublas_workspace(monkeypatch):
    """`klotski serve` builds its engine on the server's thread and runs it on the worker's; cuBLAS
    makes a workspace per thread (32 MiB on an H200), so the worker's landed after the allocator
    baseline and counted as the engine's bytes in the report's allocator peak (found by reading).
    The worker makes it first and counts it with the runtime."""
    import types

    from klotski import assemble
    made = []
    monkeypatch.setattr(assemble, "_cublas_workspace", lambda device, dtype: made.append(device) or 1234)
    memory = types.SimpleNamespace(runtime_bytes=100, allocator_baseline=5000)
    engine = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, memory=memory)
    assemble.adopt_on_this_thread(engine)
    assert made and memory.runtime_bytes == 1334 and memory.allocator_baseline == 6234
    cpu = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, memory=memory)
    assemble.adopt_on_this_thread(cpu)  # no cuBLAS on a CPU
    assert len(made) == 1


def test_closing_host_kv_caches_waits_for_loads_still_reading_them():
    """A step that fails mid-layer can leave KV loads issued ahead (for the next layer) still
    reading a host cache's locked blocks; closing the caches unregistered them at once (after
    waiting for stores only: found by reading). Now the load channel is drained first."""
    import threading
    import time
    import types

    from klotski.execute.channels import Channel
    from klotski.execute.caches import KVSpace

    channel = Channel("kv_load", torch.device("cpu"), Trace(), link=None)
    channel.inline = False  # on its worker thread, as on CUDA
    release, order = threading.Event(), []
    channel.submit(lambda: (release.wait(5), order.append("load done")), name="a load issued ahead")

    class Blocks:
        def close(self):
            order.append("blocks closed")

    host = types.SimpleNamespace(free=lambda n: None)
    space = KVSpace(None, torch.float32, torch.device("cpu"), on_host=True, account=host, make_room=None,
                    drain=channel.drain)
    space.held = {1: (64, Blocks(), types.SimpleNamespace(settle=lambda: None, state=None))}
    threading.Thread(target=lambda: (time.sleep(0.2), release.set())).start()
    space.close()
    assert order == ["load done", "blocks closed"]
    channel.close()
