"""One staging ring (issue 59): the page-locked ring host data crosses a CUDA link through is a
channel's `StagedCopies`, the run's own. A host KV cache's strided slots go up through the
kv_load channel's (BatchKV.load, prefix.Segment.load), disk reads through the carriers', host
compute's results through the activations channel's: made by the run's channels, charged to
the run's host account by the composition root, given back when the channels close. Before,
KV loads went through a ring per CUDA device kept for the process (kvcache.staging_for),
outside every budget.

The CUDA path's bookkeeping runs here on a CPU: a ring in plain memory whose copies are
complete when they return (`StagedCopies.on_host`); the CUDA path itself is checked on a GPU
(tests/gpu/test_gpu_kv.py)."""
import dataclasses
import types

import pytest
import torch

from klotski import assemble
from klotski.assemble import open_engine, reserve_staging_rings
from klotski.builtin import tiny
from klotski.config import RunConfig
from klotski.execute import kvcache
from klotski.execute.channels import make_channels
from planner.workingset import KV_STAGING_BYTES
from klotski.execute.staging import StagedCopies
from klotski.execute.caches import CacheManager
from klotski.execute.trace import Trace
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from placement import pinned
from placement.placement import Placement
from placement.tiers import Memory, OverBudget

PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello", "a b c d e f g h i j k l m n o p",
           "numbers 1 2 3", "once upon a time in a land far away there lived", "yes"]
LIMITS = [12, 2, 3, 2, 3, 2, 2]  # the long one ends alone in its batch: steps over fewer rows than it has


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("ring") / "tiny", "tiny")


def _setup(device, kv="host", tiers=None, modes=("off", "off")):
    placement = types.SimpleNamespace(tiers=tiers or {("expert", 0, 0): "host"}, kv=kv)
    return types.SimpleNamespace(device=torch.device(device), placement=placement, host_modes=modes)


def test_the_kv_ring_is_charged_to_the_host_budget_and_given_back_when_the_channels_close():
    ring = pinned.charge(KV_STAGING_BYTES)
    channels = make_channels(torch.device("cpu"), Trace(), None)
    assert channels["kv_load"].staged.nbytes == KV_STAGING_BYTES
    memory = Memory(ring + 4096, "host")
    reserve_staging_rings(memory, channels, _setup("cuda"))  # KV on the host of a CUDA device
    assert memory.used == ring and memory.peak <= memory.budget
    for channel in channels.values():
        channel.close()
    assert memory.used == 0 and memory.peak == ring
    # the KV cache on the device, or a CPU "device": no ring, nothing charged
    for setup in (_setup("cuda", kv="device"), _setup("cpu")):
        memory = Memory(ring, "host")
        reserve_staging_rings(memory, make_channels(torch.device("cpu"), Trace(), None), setup)
        assert memory.used == 0


def test_a_host_budget_with_no_room_for_the_ring_is_refused():
    memory = Memory(pinned.charge(KV_STAGING_BYTES) - 1, "host")
    with pytest.raises(OverBudget, match="kv_load channel's page-locked staging ring"):
        reserve_staging_rings(memory, make_channels(torch.device("cpu"), Trace(), None), _setup("cuda"))
    assert memory.used == 0 and memory.peak == 0


def test_the_ring_never_grows_past_its_charge_and_release_gives_everything_back():
    """A slot wider than half the ring goes up in pieces of its bytes (before, the ring grew to
    one slot, outside any account); the bytes are exact, whatever the piece."""
    memory = Memory(1 << 20, "host")
    staged = StagedCopies.on_host(256)
    assert staged.charge(memory, "a ring") == pinned.charge(256) == memory.used
    src = torch.randn(7, 3, 20)  # 240-byte slots, strided: every other one
    host = torch.zeros(14, 3, 20)
    host[::2] = src
    dst = torch.empty(7, 3, 20)
    staged.gather(dst, host[::2])
    assert torch.equal(dst, src) and len(staged.ring) == 256
    index = torch.tensor([6, 0, 4])
    narrow = torch.randn(9, 2, 4)  # 32-byte slots: four a piece
    out = torch.empty(3, 2, 4)
    staged.gather(out, narrow, index)
    assert torch.equal(out, narrow[index]) and len(staged.ring) == 256
    staged.release()
    assert staged.ring is None and memory.used == 0


def test_two_engines_do_not_share_a_ring(model):
    """Each run's host KV caches gather through its own kv_load channel's ring, handed to them
    when they are made (on CUDA; a CPU "device" copies straight); nothing is kept for the process."""
    assert not hasattr(kvcache, "staging_for") and not hasattr(kvcache, "_STAGING")
    ckpt = Checkpoint.open(str(model))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host")
    ckpt.close()
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=2, num_batches=1)
    engines = [open_engine(cfg, [Request(id="r", line=1, prompt="hi", messages=None, max_new_tokens=1)],
                           placement=placement)[0] for _ in range(2)]
    try:
        assert all(e.caches.staging is None for e in engines)  # a CPU "device" copies straight
        # the ring a CUDA run's caches are handed (nothing allocated: this machine has no GPU)
        rings = [CacheManager.staging_for(e.channels["kv_load"], torch.device("cuda")) for e in engines]
        assert rings[0] is engines[0].channels["kv_load"].staged
        assert rings[1] is engines[1].channels["kv_load"].staged
        assert rings[0] is not rings[1]
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("link", [None, 50.0], ids=["inline", "worker-thread"])
def test_a_host_kv_run_gathers_through_its_kv_load_ring_within_the_host_budget(model, monkeypatch, link):
    """The CUDA path's loads on a CPU, as the composition root sets them up on a GPU: the
    kv_load channel's ring charged at build, every strided load gathered through it (no ring
    of the cache's own), the tokens static batching's; under a host budget of exactly the
    peak the run needed with the ring, the peak stays within it, and the ring's charge is
    given back at close."""
    ckpt = Checkpoint.open(str(model))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host")
    ckpt.close()
    requests = [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None, max_new_tokens=m)
                for i, m in enumerate(LIMITS)]
    base = dict(model=str(model), progress=False, dtype="float32", batch_size=2, num_batches=1,
                emulate_link_gbps=link)
    static, seqs, _ = open_engine(RunConfig(**base, batching="static"), requests)
    want = {s.request.id: list(s.out) for s in static.run(seqs)}
    static.close()

    real = assemble.reserve_staging_rings

    def as_on_cuda(host_memory, channels, setup, step_rings=()):  # the ring in plain memory, charged as on a GPU
        channels["kv_load"].staged = StagedCopies.on_host(4096)
        real(host_memory, channels, dataclasses.replace(setup, device=torch.device("cuda")), step_rings)
    monkeypatch.setattr(assemble, "reserve_staging_rings", as_on_cuda)
    # the kv_load channel's ring handed to each host cache, as on CUDA
    monkeypatch.setattr(CacheManager, "staging_for", staticmethod(lambda kv_load, device: kv_load.staged))
    gathers = []
    gather = StagedCopies.gather
    monkeypatch.setattr(StagedCopies, "gather", lambda self, *a, **kw: (gathers.append(self), gather(self, *a, **kw)))

    def run(host_memory=None):
        engine, seqs, errors = open_engine(RunConfig(**base, host_memory=host_memory), requests, placement=placement)
        assert not errors
        ring = engine.channels["kv_load"].staged
        charged = ring.charged(engine.host_memory)
        assert charged == pinned.charge(4096)
        gathers.clear()
        got = {s.request.id: list(s.out) for s in engine.run(seqs)}
        assert got == want
        assert gathers and all(g is ring for g in gathers)
        assert engine.stats.refills > 0
        used = engine.host_memory.used
        engine.close()
        assert engine.host_memory.used <= used - charged and not ring.charged(engine.host_memory) and ring.ring is None
        return engine.host_memory

    roomy = run()
    tight = run(roomy.peak)
    assert tight.budget == roomy.peak and tight.peak <= tight.budget
