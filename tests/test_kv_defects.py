"""KV cache and continuous batching defects that only CUDA shows, caught on a CPU (issue 37):

- a load of fewer rows than the batch (every refill) copied from a strided view of the host
  cache, which torch stages through a fresh pageable copy: every host->device copy must read
  a contiguous view of the pinned pool (the host cache, or the staging ring reused by every
  load), checked here by storage, since nothing is pinned on a CPU;
- budget accounts were given back before the caches were dropped, and a realign's clone was
  not accounted: live KV bytes must never exceed what the budget holds for them;
- retiring a newcomer's cache synchronised the device and every newcomer batch page-locked
  (cudaHostRegister) a cache of its own; adoption zeroed the whole row in every layer.
The same, on a GPU: tests/gpu/test_gpu_kv.py.
"""
import shutil
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hostile
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.execute import kvcache
from klotski.schedule import batching
from klotski.execute.caches import CacheManager, KVSpace
from klotski.execute.channels import Ticket
from klotski.execute.staging import StagedCopies
from klotski.execute.kvcache import BatchKV
from placement.placement import Placement
from test_batching import PROMPTS as BATCHING_PROMPTS

PROMPTS = BATCHING_PROMPTS[:6]


def _many(count=24):
    """More prompts than rows, short and long limits: newcomers, refills and realigns."""
    return [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None,
                    max_new_tokens=[6, 2, 3][i % 3]) for i in range(count)]


def _open(model, requests, placement=None, **config):
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=2, num_batches=1, **config)
    engine, seqs, errors = open_engine(cfg, requests, placement=placement)
    assert not errors
    return engine, seqs


def _host_kv(model):
    ckpt = Checkpoint.open(str(model))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host")
    ckpt.close()
    return placement


# ---- (2) a load's copies read the pinned pool, contiguous ---------------------------------------
def _filled_cache(rows):
    """A 4-row host cache, 2 layers, keys and values of different widths, slots 5..29 valid."""
    kv = BatchKV(2, 4, 2, 3, 40, torch.float32, on_host=True, value_dim=5)
    for layer in range(2):
        for t in (kv.keys[layer], kv.values[layer]):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * layer)
    kv.valid[:, 5:30] = True
    kv.filled = 30
    kv.use_rows(rows)
    # half of it holds a keys slot of 4 rows (96 bytes): chunks of one slot; the values' wider
    # slots (160 bytes) go up in pieces of their bytes: the ring never grows past its charge
    kv.staging = StagedCopies.on_host(200)
    return kv


@pytest.mark.parametrize("rows", [4, 2], ids=["all-rows", "fewer-rows"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sink-window"])
def test_every_load_copies_a_contiguous_view_of_the_pinned_pool(monkeypatch, rows, sparse):
    kv = _filled_cache(rows)
    copies = []

    def spy(dst, src):
        ring = [kv.staging.ring.bytes] if kv.staging.ring is not None else []  # made on first use
        pool = kv.keys + kv.values + ring
        shared = any(src.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in pool)
        copies.append((dst, src.is_contiguous(), shared, src.untyped_storage().data_ptr()))
        dst.copy_(src)
    monkeypatch.setattr(kvcache, "upload", spy)
    staged = set()
    for step in range(2):  # two steps, both layers: the ring is reused, never made anew
        kv.begin_step(torch.ones(rows, 1, dtype=torch.bool), *((2, 6) if sparse else (None, None)))
        cols = kv.step_columns()
        old = torch.arange(kv.first, kv.filled) if cols is None else cols[:-1]
        for layer in range(2):
            copies.clear()
            keys, values, offset = kv.load(layer, "cpu")
            assert offset == len(old)
            assert torch.equal(keys[:offset], kv.keys[layer][old, :rows])
            assert torch.equal(values[:offset], kv.values[layer][old, :rows])
            assert copies and all(contiguous and shared for _, contiguous, shared, _ in copies), \
                [(contiguous, shared) for _, contiguous, shared, _ in copies]
            # every byte of both buffers' old slots arrived through those copies
            assert sum(d.numel() * d.element_size() for d, *_ in copies) == \
                (keys[:offset].numel() + values[:offset].numel()) * keys.element_size()
            ring = {kv.staging.ring.bytes.untyped_storage().data_ptr()} if kv.staging.ring is not None else set()
            staged |= {p for *_, p in copies if p in ring}
            if rows == 4 and not sparse:  # one block of the host cache itself: no staging
                assert len(copies) == 2 and not staged
        kv.end_step()
    if rows < 4 or sparse:
        assert len(staged) == 1  # one ring, across layers and steps: never made anew


def test_a_continuous_run_through_the_staging_ring_is_exact(checkpoints, monkeypatch):
    """The CUDA path's loads on a CPU: host caches gather through a staging ring (small, so
    loads take several chunks), refills leave a batch computing fewer rows than it has, and
    the tokens are static batching's."""
    init, copies, fewer = BatchKV.__init__, [], [0]

    def staged(self, *a, **kw):
        init(self, *a, **kw)
        self.staging = StagedCopies.on_host(8192)
    load = BatchKV.load

    def counted(self, layer, device):
        fewer[0] += self.rows < self.batch
        return load(self, layer, device)
    monkeypatch.setattr(BatchKV, "__init__", staged)
    monkeypatch.setattr(BatchKV, "load", counted)
    monkeypatch.setattr(kvcache, "upload", lambda dst, src: (copies.append(src.is_contiguous()), dst.copy_(src)))
    # the long one ends alone in its batch
    requests = [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None, max_new_tokens=m)
                for i, m in enumerate([12, 2, 3, 2, 3, 2, 2])]
    static, seqs = _open(checkpoints["gqa"], requests, batching="static")
    want = {s.request.id: list(s.out) for s in static.run(seqs)}
    static.close()
    engine, seqs = _open(checkpoints["gqa"], requests, placement=_host_kv(checkpoints["gqa"]))
    assert {s.request.id: list(s.out) for s in engine.run(seqs)} == want
    engine.close()
    assert fewer[0] > 0 and engine.stats.refills > 0 and copies and all(copies)


def test_a_load_waits_for_the_last_store_of_its_layer_before_the_host_gathers(monkeypatch):
    """The gather into the staging ring reads the host slots at once: the store into them
    that the load is ordered behind must have landed (its own event, not the device)."""
    kv = _filled_cache(2)
    order = []

    class Store:  # a store's future whose landing is recorded
        @staticmethod
        def result():
            order.append("store landed")
    kv.stored[0] = Ticket(Store())
    gather = StagedCopies.gather
    monkeypatch.setattr(StagedCopies, "gather", lambda *a, **kw: (order.append("gather"), gather(*a, **kw)))
    kv.begin_step(torch.ones(2, 1, dtype=torch.bool))
    kv.load(0, "cpu")
    assert order[:2] == ["store landed", "gather"]


@pytest.mark.parametrize("keep,filled", [(6, 6), (9, 11), (3, 3), (12, 12)], ids=["back", "forward", "apart", "front"])
def test_realign_moves_overlapping_slots_block_by_block_exactly(monkeypatch, keep, filled):
    """Overlapping moves go through a bounded scratch block (here one slot), in the order that
    reads each source block before it is overwritten; the block's bytes are held meanwhile."""
    monkeypatch.setattr(kvcache, "REALIGN_BLOCK_BYTES", 1)
    kv = BatchKV(2, 3, 1, 2, 12, torch.float32, value_dim=3)
    for t in kv.keys + kv.values:
        t.copy_(torch.randn(t.shape))
    kv.valid[:, 1:9] = True
    kv.filled = 9
    m = min(keep, 9)
    want = [t[9 - m:9].clone() for t in kv.keys + kv.values]
    valid = kv.valid[:, 9 - m:9].clone()
    held = []

    class Room:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def __enter__(self):
            held.append(self.nbytes)

        def __exit__(self, *exc):
            held.append(-self.nbytes)
    kv.realign(keep, filled, room=Room)
    for t, w in zip(kv.keys + kv.values, want):
        assert torch.equal(t[filled - m:filled], w)
    assert kv.filled == filled and torch.equal(kv.valid[:, filled - m:filled], valid)
    assert not kv.valid[:, :filled - m].any() and not kv.valid[:, filled:].any()
    overlapping = abs(filled - 9) < m
    assert held == ([3 * 3 * 4, -3 * 3 * 4] if overlapping else [])  # one slot of the widest tensor


# ---- (6) what lives never exceeds what is accounted ---------------------------------------------
class _Allocations(TorchDispatchMode):
    """Calls `seen(tensor)` for every fresh tensor an op makes (not a view, not an input)."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.seen(t)
        return out


def test_live_kv_bytes_never_exceed_their_accounts_through_refills_and_realigns(checkpoints, monkeypatch):
    """Device-tier caches (the CPU's budgeted working set): every cache tensor and every
    block a realign makes is tracked by weak reference; after every reservation and every
    release of the device account, the live ones fit in what the caches' accounts (and a
    realign's reservation, while it runs) hold, and the account in the budget."""
    live = []  # (weakref, nbytes) of every device-tier KV tensor and realign block
    spaces, realigning = [], []
    kv_init, space, realign = BatchKV.__init__, CacheManager.space, BatchKV.realign

    def track(t):
        live.append((weakref.ref(t), t.nbytes))

    def init(self, *a, **kw):
        kv_init(self, *a, **kw)
        if not self.on_host:
            for t in self.keys + self.values:
                track(t)
    monkeypatch.setattr(BatchKV, "__init__", init)
    monkeypatch.setattr(CacheManager, "space", lambda self: spaces.append(space(self)) or spaces[-1])
    # whole prompts: these repeat, and as shared segments they would leave each row one token
    engine, seqs = _open(checkpoints["gqa"], _many(), prefix_cache=False)
    memory, checks, blocks = engine.memory, [0], [0]

    def check(where):
        alive = sum(n for ref, n in live if ref() is not None)
        held = sum(n for space in spaces for n, *_ in space.held.values())
        extra = memory.used - realigning[-1] if realigning else 0  # what the realign reserved
        assert alive <= held + extra, f"{alive} bytes of KV alive, {held} + {extra} accounted, at {where}"
        assert memory.used <= memory.budget
        checks[0] += 1

    for name in ("reserve", "free"):
        def wrapped(*a, _original=getattr(memory, name), _name=name, **kw):
            _original(*a, **kw)
            check(_name)
        monkeypatch.setattr(memory, name, wrapped)

    def watched_realign(self, *a, **kw):
        realigning.append(memory.used)
        try:
            # a fresh tensor of the cache's dtype holds KV bytes (the slot mask is bool)
            def block(t):
                if t.dtype == engine.dtype:
                    blocks[0] += 1
                    track(t)
                    check("a realign's block")
            with _Allocations(block):
                return realign(self, *a, **kw)
        finally:
            realigning.pop()
    monkeypatch.setattr(BatchKV, "realign", watched_realign)
    assert not engine.caches.on_host  # the caches are charged to the device budget
    list(engine.run(seqs))
    engine.close()
    assert engine.stats.refills > 0 and engine.stats.kv_realigns > 0 and blocks[0] > 0 and checks[0] > 50
    assert engine.memory.peak <= engine.memory.budget


# ---- (7) no device-wide wait, one page-locked cache per pool place, no zero-fills ----------------
def test_newcomer_caches_on_the_host_are_made_once_and_kept(checkpoints, monkeypatch):
    """Host-tier KV: a newcomer cache whose prompts all have rows is used again by the next
    newcomer batch. On CUDA every cache made is a cudaHostRegister per layer's keys and
    values, and every cache freed a device synchronise (caches.KVSpace), so: few made, none
    freed before the run ends, however many newcomer batches pass."""
    calls = {"allocate": 0, "free": 0, "newcomers": 0}
    allocate, free, newcomers = KVSpace.allocate, KVSpace.free, batching._Newcomers.__init__

    def count(name, original):
        def counted(*a, **kw):
            calls[name] += 1
            return original(*a, **kw)
        return counted
    monkeypatch.setattr(KVSpace, "allocate", count("allocate", allocate))
    monkeypatch.setattr(KVSpace, "free", count("free", free))
    monkeypatch.setattr(batching._Newcomers, "__init__", count("newcomers", newcomers))
    static, seqs = _open(checkpoints["gqa"], _many(), batching="static")
    want = {s.request.id: list(s.out) for s in static.run(seqs)}
    static.close()
    calls.update(allocate=0, free=0)
    engine, seqs = _open(checkpoints["gqa"], _many(), placement=_host_kv(checkpoints["gqa"]))
    assert {s.request.id: list(s.out) for s in engine.run(seqs)} == want
    engine.close()
    n = engine.num_batches
    assert calls["newcomers"] >= 8 and engine.stats.refills > 0
    assert calls["free"] == 0
    # the first fill's n caches, at most 2n newcomer caches of bs rows, and a tail batch's
    # (besides one one-row cache per shared prompt segment, made once)
    assert calls["allocate"] - engine.stats.prefix_prefills <= n + 2 * n + 1 < calls["newcomers"]


def test_adoption_writes_the_adopted_slots_and_zeroes_nothing(checkpoints, monkeypatch):
    """An adoption copies the newcomer's slots and fills no slot of the cache (a zero-fill of
    the whole row, every layer, was a kernel per tensor on CUDA and a row-strided memset of
    the host cache): the tokens stay exact, as test_batching shows with every schedule."""
    fills, adopted = [], [0]

    class Fills(TorchDispatchMode):
        def __init__(self, kv):
            super().__init__()
            self.storages = {t.untyped_storage().data_ptr() for t in kv.keys + kv.values}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("fill_", "zero_", "masked_fill_") and \
                    args[0].untyped_storage().data_ptr() in self.storages:
                fills.append(func)
            return func(*args, **(kwargs or {}))

    adopt = BatchKV.adopt

    def watched(self, *a, **kw):
        adopted[0] += 1
        with Fills(self):
            return adopt(self, *a, **kw)
    monkeypatch.setattr(BatchKV, "adopt", watched)
    for placement in (None, _host_kv(checkpoints["gqa"])):
        engine, seqs = _open(checkpoints["gqa"], _many(12), placement=placement)
        list(engine.run(seqs))
        engine.close()
    assert adopted[0] > 10 and fills == []


def test_a_row_whose_sequence_went_non_finite_does_not_poison_the_next(checkpoints, tmp_path):
    """A prompt with NaN in one of its tokens' embedding rows fails; its row's slots hold NaN.
    Adoption no longer zeroes rows, so that row is scrubbed when its sequence leaves: the
    batch's other sequence, moved into it, and the newcomers after it attend over those slots
    masked (0 times NaN is NaN) and must give exactly the tokens of a clean run."""
    victim = "Quantum mechanics is a fundamental theory in physics that describes the behaviour of nature at small scales"
    other, newcomers = "Bees", ["The album was recorded in London during the winter", "A river is a natural flowing"]
    # the victim and a short prompt in the first fill (the longest limits), the victim in row 0
    jobs = [(victim, 8), (other, 8)] + [(p, 3) for p in newcomers] * 2
    requests = [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=m)
                for i, (p, m) in enumerate(jobs)]
    clean, seqs = _open(checkpoints["gqa"], requests)
    ids = {s.request.prompt: s.prompt_ids for s in seqs}
    # its first token no other prompt has: NaN from there on, in every layer
    token = next(t for t in ids[victim] if not any(t in ids[p] for p in ids if p != victim))
    want = {s.request.id: list(s.out) for s in clean.run(seqs)}
    clean.close()
    model = tmp_path / "model"
    shutil.copytree(checkpoints["gqa"], model)
    hostile.poison_row(model, "model.embed_tokens.weight", token)
    engine, seqs = _open(model, requests)
    got = {s.request.id: s for s in engine.run(seqs)}
    engine.close()
    assert got["r0"].error.startswith("non-finite values at layer 0")
    assert engine.stats.refills > 0
    for rid, tokens in want.items():
        if rid != "r0":
            assert got[rid].error is None and list(got[rid].out) == tokens, rid
