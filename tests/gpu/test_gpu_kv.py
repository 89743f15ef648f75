"""Continuous batching's KV cache on a GPU (issue 37; the CPU's structural checks are
tests/test_kv_defects.py). More prompts than rows, heavy-tailed limits: newcomers are
prefilled, adopted and their caches retired, and steps compute fewer rows than their batch.

- every KV load's host->device copy reads pinned memory, contiguous (the host cache, or the
  staging ring the fewer rows are gathered into), so the profiler sees no pageable copy;
- the gather reads host slots only once the last store into them has landed (stores slowed);
- retiring a newcomer's cache never synchronises the device, and host caches are
  page-locked once each, not per newcomer batch;
- every run is bit-identical, hidden states and tokens, to the same job with the KV cache
  and every weight on the device and a synchronisation after every layer.
"""
import pytest
import torch

from conftest import PROMPTS, run_keeping_states
from klotski.assemble import open_engine
from klotski.builtin import tiny
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.execute import kvcache
from klotski.execute.staging import StagedCopies
from klotski.execute.kvcache import BatchKV
from placement.placement import Placement

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: run tests/gpu on a GPU machine (../shared/gpu/README.md)")

# heavy-tailed: rows free at different steps, and the longest ends alone in its batch (a
# step over fewer rows than the batch: on the CPU, 8 of 50 steps)
LIMITS = [24, 9, 2, 5, 2, 7, 3, 2, 8, 3, 2, 4] + [2, 3, 2, 4, 2, 3] * 4
SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU time: long enough to expose a missing wait
HOST = dict(kv="host", attn="host", gate="host", expert="host", head="host", embed="host")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("gpu-kv") / "small", "small", dtype="float32")


def _requests():
    return [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None, max_new_tokens=m)
            for i, m in enumerate(LIMITS)]


def _open(model_dir, host: bool, **config):
    """A continuous-batching engine on the GPU: every group and the KV cache on the host, or
    all on the device."""
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", device="cuda", batch_size=3,
                    num_batches=2, **config)
    ckpt = Checkpoint.open(str(model_dir))
    tiers = dict(HOST) if host else dict(kv="device")
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv=tiers.pop("kv"), **tiers)
    ckpt.close()
    engine, seqs, errors = open_engine(cfg, _requests(), placement=placement)
    assert not errors
    return engine, seqs


def run(model_dir, host: bool, *, sync=False, **config):
    """Tokens, per-layer hidden states (device copies) and the engine of one continuous run."""
    engine, seqs = _open(model_dir, host, **config)
    done, states = run_keeping_states(engine, seqs, sync)
    assert engine.stats.refills > 0  # newcomers did take rows
    return [done[f"r{i}"] for i in range(len(LIMITS))], states, engine


def assert_same(got, ref, what):
    assert got[0] == ref[0], what
    assert len(got[1]) == len(ref[1]), what
    for step, (a, b) in enumerate(zip(got[1], ref[1])):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{what}: hidden states differ at layer-step {step}"


@pytest.fixture(scope="module")
def resident(model):
    return {knobs: run(model, False, sync=True, **dict(knobs)) for knobs in ((), (("attention", "sink:2,window:6"),))}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sink-window"])
def test_refills_load_only_pinned_contiguous_memory_and_stay_exact(model, resident, monkeypatch, sparse):
    from torch.profiler import ProfilerActivity, profile
    sources, staged = [], [0]
    upload, gather = kvcache.upload, StagedCopies.gather

    def spy(dst, src):  # on the kv_load channel's thread
        sources.append((src.is_pinned(), src.is_contiguous()))
        upload(dst, src)

    def counted(self, *a, **kw):
        staged[0] += 1
        gather(self, *a, **kw)
    monkeypatch.setattr(kvcache, "upload", spy)
    monkeypatch.setattr(StagedCopies, "gather", counted)
    knobs = (("attention", "sink:2,window:6"),) if sparse else ()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        got = run(model, True, **dict(knobs))
    assert_same(got, resident[knobs], f"host KV, continuous, {'sparse' if sparse else 'dense'}")
    assert sources and all(pinned and contiguous for pinned, contiguous in sources), sources
    assert staged[0] > 0  # steps over fewer rows than their batch (or kept slots) were gathered
    memcpy = sorted({e.name for e in prof.events() if "Memcpy" in e.name})
    assert any("HtoD" in n for n in memcpy), memcpy
    assert not [n for n in memcpy if "HtoD" in n and "Pageable" in n], memcpy


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sink-window"])
def test_gathered_loads_wait_for_slow_stores(model, resident, monkeypatch, sparse):
    """Stores land late (the store stream sleeps before each copy): a load that gathers host
    slots on the host must wait for the last store into them, or it reads stale slots."""
    store = BatchKV.store

    def slow(self, *a):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the kv_store stream: the copy lands late
        return store(self, *a)
    monkeypatch.setattr(BatchKV, "store", slow)
    knobs = (("attention", "sink:2,window:6"),) if sparse else ()
    assert_same(run(model, True, **dict(knobs)), resident[knobs], "host KV with slow stores")


def test_retiring_newcomers_never_synchronises_and_pins_each_cache_once(model, resident, monkeypatch):
    """A retired host newcomer cache is kept for the next newcomers: no device-wide
    synchronise while the run goes (closing the window's caches at its end may), and
    page-locked blocks only for the caches made, far fewer than the newcomer batches."""
    import sys

    from klotski.schedule import batching
    from placement.pinned import PinnedBlocks
    syncs, registered, newcomers = [], [0], [0]
    synchronize, block, init = torch.cuda.synchronize, PinnedBlocks._block, batching._Newcomers.__init__

    def watched_sync(*a, **kw):
        syncs.append(sys._getframe(1).f_code.co_name)
        return synchronize(*a, **kw)

    def watched_block(self, nbytes):
        registered[0] += self.pinned  # one cudaHostRegister each
        return block(self, nbytes)

    def watched_init(self, *a, **kw):
        newcomers[0] += 1
        init(self, *a, **kw)
    monkeypatch.setattr(PinnedBlocks, "_block", watched_block)
    monkeypatch.setattr(batching._Newcomers, "__init__", watched_init)
    engine, seqs = _open(model, True)
    weights = registered[0]  # the host tier's groups, page-locked once at open
    monkeypatch.setattr(torch.cuda, "synchronize", watched_sync)
    tokens = {s.request.id: s.out for s in engine.run(seqs)}
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    engine.close()
    assert [tokens[f"r{i}"] for i in range(len(LIMITS))] == resident[()][0]
    layers, n = engine.spec.shape.num_layers, engine.num_batches
    made = (registered[0] - weights) // (2 * layers)  # a cache is one block per layer's keys and values
    assert newcomers[0] > 2 * n and made <= n + 2 * n + 1 < n + newcomers[0], (made, newcomers[0])
    assert set(syncs) <= {"close"}, syncs  # KVSpace.close, once the window is done; never KVSpace.free
