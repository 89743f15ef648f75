"""Expert waves (issue 45): many experts in one grouped call over stacked weights, the same
numbers as one call per expert; transferred experts landing stacked; every family through it."""
import pytest
import torch

from klotski.models import grouped as G
from klotski.models import gpt_oss
from klotski.models import layers as L


def _case(dtype, experts=6, hidden=64, inter=96, counts=(5, 0, 9, 1, 0, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    w = {"w1": torch.randn(experts, inter, hidden, generator=g).to(dtype) * 0.2,
         "w3": torch.randn(experts, inter, hidden, generator=g).to(dtype) * 0.2,
         "w2": torch.randn(experts, hidden, inter, generator=g).to(dtype) * 0.2}
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, G.Groups(list(counts), offsets)


def _per_expert(ffn, x, w, groups):
    parts = [ffn(p, {n: t[g] for n, t in w.items()}) for g, p in enumerate(x.split(groups.counts)) if len(p)]
    return torch.cat(parts)


@pytest.fixture(params=["kernel", "fallback"])
def path(request):
    """The grouped kernel where torch has it, and the per-group fallback, forced."""
    if request.param == "kernel" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    for dtype in (torch.float32, torch.bfloat16):
        G.force_fallback("cpu", dtype, request.param == "fallback")
    yield request.param
    for dtype in (torch.float32, torch.bfloat16):
        G.force_fallback("cpu", dtype, False)


def _same(ours, ref, exact: bool):
    """`exact`: the same ops as the reference, bit for bit. Otherwise another kernel (the grouped
    one; gpt-oss's biases added apart from the matmul): on this CPU bit for bit at two threads
    but not always at one (sums ordered otherwise), so within fp32 rounding (the engine's tokens
    are held to transformers')."""
    if exact:
        assert torch.equal(ours, ref)
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_grouped_swiglu_is_each_experts_swiglu(path):
    x, w, groups = _case(torch.float32)
    _same(G.grouped_swiglu(x, w, groups), _per_expert(L.swiglu, x, w, groups), exact=path == "fallback")


def test_grouped_gpt_oss_experts_are_each_experts(path):
    """The clamped activation and per-expert biases (gathered per row), gpt-oss's [in, out] layout."""
    g = torch.Generator().manual_seed(1)
    counts, E, H, I = [4, 0, 7, 2], 4, 32, 48
    x = torch.randn(sum(counts), H, generator=g)
    w = {"gate_up": torch.randn(E, H, 2 * I, generator=g) * 0.3, "gate_up_bias": torch.randn(E, 2 * I, generator=g),
         "down": torch.randn(E, I, H, generator=g) * 0.3, "down_bias": torch.randn(E, H, generator=g)}
    groups = G.Groups(counts, torch.tensor(counts).cumsum(0).to(torch.int32))
    ours = gpt_oss.grouped_clamped_swiglu(x, w, groups, alpha=1.702, limit=2.0)
    _same(ours, _per_expert(lambda p, e: gpt_oss.clamped_swiglu(p, e, alpha=1.702, limit=2.0), x, w, groups), exact=False)


def test_bf16_grouped_agrees_with_per_expert(path):
    """The 16-bit kernel, which the fp32 identity tests never run: within one bf16 rounding of the
    output's scale (on this CPU it is bit for bit; a GPU's kernel may order the sums otherwise)."""
    x, w, groups = _case(torch.bfloat16)
    ours, ref = G.grouped_swiglu(x, w, groups).float(), _per_expert(L.swiglu, x, w, groups).float()
    assert (ours - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_running_out_of_memory_is_raised_and_a_refusal_falls_back(monkeypatch):
    """A call the grouped kernel refuses sends that device and dtype to the per-group path for
    good; running out of memory is the device's trouble, raised as it is, and the kernel stays
    chosen (found by reading: both were taken as "unsupported", and every later wave ran per
    group, with a sync, where the bench caps the allocator)."""
    x, w, groups = _case(torch.float32)
    G.force_fallback("cpu", torch.float32, False)
    try:
        def oom(*args, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        monkeypatch.setattr(torch, "_grouped_mm", oom, raising=False)
        with pytest.raises(torch.OutOfMemoryError):
            G.grouped_swiglu(x, w, groups)
        assert G.runs_grouped("cpu", torch.float32)

        def refused(*args, **kw):
            raise RuntimeError("grouped gemm is not supported for this input")
        monkeypatch.setattr(torch, "_grouped_mm", refused, raising=False)
        assert torch.equal(G.grouped_swiglu(x, w, groups), _per_expert(L.swiglu, x, w, groups))
        assert not G.runs_grouped("cpu", torch.float32)
    finally:
        G.force_fallback("cpu", torch.float32, False)


@pytest.mark.parametrize("capability, dtype, grouped", [((9, 0), torch.bfloat16, True), ((10, 0), torch.bfloat16, True),
                                                        ((8, 0), torch.bfloat16, False), ((8, 6), torch.bfloat16, False),
                                                        ((9, 0), torch.float16, False), ((9, 0), torch.float32, False)])
def test_cuda_takes_the_grouped_kernel_only_where_torch_runs_it_without_a_sync(monkeypatch, capability, dtype,
                                                                               grouped):
    """torch's grouped kernel on CUDA is bf16 on compute capability 9.x/10.x; elsewhere torch falls
    back to copying the offsets to the host, a sync a call, so the per-group path (with the host's
    counts, and no resident wave launched before the routing read) is taken; fp32 never groups."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    G.force_fallback("cuda", dtype, False)
    try:
        assert G.runs_grouped("cuda", dtype) is (grouped and hasattr(torch, "_grouped_mm"))
    finally:
        G.force_fallback("cuda", dtype, False)


def test_streamed_experts_land_stacked_and_tokens_match_transformers(tmp_path, path):
    """Every expert streamed from host memory through a small device budget: runs of them move in
    one submission each and compute in waves over their stacks, token for token transformers,
    with the grouped kernel and with the per-group fallback (a CUDA device's fp32 path)."""
    from klotski.builtin.families import build_family
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    from tests.conftest import engine_tokens, reference_tokens
    model = build_family(tmp_path / "qwen3", "qwen3_moe")
    keys = Checkpoint.open(str(model)).spec.group_keys()
    placement = Placement.by_kind(keys, expert="host")
    ours, engine = engine_tokens(model, placement=placement, batch_size=3, num_batches=2, device_memory=6 << 20)
    assert ours == reference_tokens(model)
    assert engine.cache.experts_landed_stacked > 0
    assert engine.memory.peak <= 6 << 20


def test_a_decode_layer_step_issues_no_host_sync_but_the_routing_reads(tmp_path):
    """The step's device-side code (pipeline, residency, experts, KV cache, channels, the family
    math) calls nothing that waits for the device (.cpu, .item, .tolist, .numpy, bool/int of a
    tensor, pin_memory, synchronize) inside a decode layer step. The routing ids (and, with
    --prefetch next-gate, the next gate's picks) come down through the CUDA path's pinned ring,
    here with a plain buffer and events that log their waits: one wait per layer for the ids
    (two with next-gate, but on the last layer), as many as the plan predicts, and the resident
    experts' wave is queued before that wait. Counted on the CPU path, experts resident and
    streamed."""
    import collections
    import traceback

    from klotski.measure.op_count import build_model
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.requests import Request
    from klotski.execute.staging import HostReads
    from klotski.execute.experts import LayerExperts
    from placement.placement import Placement

    from klotski.planning import make_plan
    from planner.profile import load_profile
    from planner.shapes import as_shape

    from klotski.builtin.families import build_family

    mixtral = build_model(tmp_path / "m", experts=16, top_k=4, layers=3)
    hybrid = build_family(tmp_path / "h", "qwen3_next")  # Gated DeltaNet layers, their state on the host tier
    device_side = ("/execute/pipeline.py", "/execute/residency.py", "/execute/experts.py", "/execute/kvcache.py",
                   "/execute/recurrent.py", "/execute/channels.py", "/placement/cache.py", "/klotski/models/")
    names = ["cpu", "item", "tolist", "numpy", "pin_memory", "__bool__", "__int__", "__float__", "__index__"]
    for model, kind, budget, prefetch, kv in (
            (mixtral, "device", None, "correlation", "device"), (mixtral, "host", 2 << 20, "correlation", "device"),
            (mixtral, "device", None, "next-gate", "device"), (hybrid, "device", None, "correlation", "host")):
        spec = Checkpoint.open(str(model)).spec
        keys = spec.group_keys()
        cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=4, num_batches=2,
                        device_memory=budget, prefetch=prefetch)
        plan = make_plan(as_shape(spec), load_profile("rtx3090-pcie4"), device_memory=1 << 30, host_memory=1 << 32,
                         prompt_len=8, gen_len=4, config=cfg)
        reqs = [Request(id=f"r{i}", line=i + 1, prompt=f"item {i} of the list", messages=None, max_new_tokens=4)
                for i in range(8)]
        engine, seqs, _ = open_engine(cfg, reqs, placement=Placement.by_kind(keys, expert=kind, kv=kv))
        seen, on, layer_now, log = collections.Counter(), [False], [0], []
        original = {n: getattr(torch.Tensor, n) for n in names}

        class Event:  # the CUDA path's event, logging when the host waits on it
            def __init__(self):
                self.done = False

            def record(self):
                pass

            def query(self):
                return self.done

            def synchronize(self):
                if on[0] and not self.done:
                    log.append(("wait", layer_now[0]))
                self.done = True

        engine.pipeline.reads = HostReads(torch.device("cpu"), buffer=torch.zeros(1 << 16, dtype=torch.uint8),
                                          event=Event)

        def counting(name):
            def call(self, *args, **kwargs):
                if on[0]:
                    frame = traceback.extract_stack(limit=2)[0]
                    # the counts made from the host copy of the ids (numpy of a host tensor)
                    if not (name == "numpy" and frame.name == "pairs_per_expert") and any(
                            part in frame.filename for part in device_side):
                        seen[f"{name} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"] += 1
                return original[name](self, *args, **kwargs)
            return call

        def on_layer(layer, hs):  # from the end of a decode step's layer to the end of the next
            on[0] = hs[0].shape[1] == 1 and layer + 1 < engine.spec.shape.num_layers
            layer_now[0] = layer + 1
            if on[0]:
                log.append(("layer", layer + 1))

        resident = LayerExperts.run_resident

        def run_resident(self, *args):
            if on[0]:
                log.append(("resident", layer_now[0]))
            return resident(self, *args)

        engine.pipeline.on_layer = on_layer
        sync = torch.cuda.synchronize
        try:
            LayerExperts.run_resident = run_resident
            for n in names:
                setattr(torch.Tensor, n, counting(n))
            torch.cuda.synchronize = lambda *a: seen.update(["torch.cuda.synchronize"]) if on[0] else None
            list(engine.run(seqs))
        finally:
            LayerExperts.run_resident = resident
            for n in names:
                setattr(torch.Tensor, n, original[n])
            torch.cuda.synchronize = sync
            engine.close()
        assert not seen, (kind, prefetch, dict(seen))
        layers = collections.Counter(at for what, at in log if what == "layer")  # decode steps through each
        waits = collections.Counter(at for what, at in log if what == "wait")
        assert layers
        # the plan's figure (klotski plan prints it) against the waits counted, layer by layer:
        # the last layer has no next gate to speculate on (and with every expert resident, as the
        # plan places them here and the next-gate run has them, none is: nothing would be moved)
        syncs = plan.per_layer["host_syncs"]["decode"]
        assert syncs == 1
        for at, steps in layers.items():
            predicted = syncs - (syncs == 2 and at + 1 == spec.shape.num_layers)
            assert waits[at] == predicted * steps, (kind, prefetch, at, waits[at], predicted, steps)
        if kind == "device":  # in every layer step the resident wave is queued before the host waits for the ids
            runs, current = [], []
            for what, _ in log:
                if what == "layer" and current:
                    runs.append(current)
                    current = []
                current.append(what)
            runs.append(current)
            assert all(r.index("resident") < r.index("wait") for r in runs), runs[:4]


def _fake_events():
    """A stand-in for torch.cuda.Event that says whether it was waited for (`Event.made`: every
    one made, in order; `done` set by the test when the copy it marks has completed)."""
    class Event:
        made = []

        def __init__(self):
            self.done, self.waited = False, False
            Event.made.append(self)

        def record(self):
            pass

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True
    return Event


def test_small_uploads_reuse_ring_bytes_only_once_the_device_has_read_them():
    """The pinned ring of a step's small uploads (CUDA-only in use; its bookkeeping checked here
    with a plain buffer, a meta device and events that say when they are waited for)."""
    from klotski.execute.staging import SmallUploads

    Event = _fake_events()

    ring = torch.zeros(4096, dtype=torch.uint8)
    up = SmallUploads(torch.device("meta"), buffer=ring, event=Event)
    seen = []
    for i in range(6):  # 6 uploads of 1 KiB into a 4 KiB ring: the fifth comes round to the first's bytes
        t = torch.full((256,), i, dtype=torch.int32)
        out = up(t)
        assert out.device.type == "meta" and out.shape == t.shape
        seen.append(ring.view(torch.int32)[:256].clone())
    assert [e.waited for e in Event.made] == [True, True, False, False, False, False]
    assert torch.equal(seen[4], torch.full((256,), 4, dtype=torch.int32))  # staged where the first was
    Event.made[2].done = True  # read already: freed without a wait
    up(torch.zeros(256, dtype=torch.int32))
    assert not Event.made[2].waited and up(torch.ones(3)).device.type == "meta"
    assert up(torch.ones(3, device="meta")).device.type == "meta"  # already there: no copy


def test_a_ring_never_hands_out_bytes_a_newer_copy_still_reads():
    """After a wrap the ring's oldest pending copy can be a straggler at its end while a newer one
    holds its start: bytes are handed out only once every copy in them is done (found by reading:
    the ring waited for the oldest copy only, and gave out bytes a copy was still reading)."""
    from klotski.execute.staging import PinnedRing

    Event = _fake_events()
    ring = PinnedRing(1024, buffer=torch.zeros(1024, dtype=torch.uint8), event=Event)

    def use(nbytes):
        start = ring.take(nbytes)
        ring.busy(start, nbytes)
        return start

    assert [use(700), use(232)] == [0, 768]     # A [0, 700), T [768, 1000)
    assert use(400) == 0                        # wraps: waits for A, D [0, 400)
    a, t, d = Event.made
    assert a.waited and not t.waited and not d.waited
    assert use(600) == 0                        # wraps again: [0, 600) holds D
    assert d.waited, "bytes handed out while a copy still reads them"


def test_pageable_sources_cross_the_link_through_a_reused_pinned_ring():
    """A disk-tier group as read from the file (pageable) goes up through the channel's locked
    ring piece by piece (StagedCopies; CUDA-only in use, its bookkeeping checked here with a plain
    buffer and events that say when they are waited for): bytes land whole, and a piece reuses
    ring bytes only once the copy out of them has completed."""
    from klotski.execute.staging import StagedCopies

    Event = _fake_events()

    staged = StagedCopies(buffer=torch.zeros(1024, dtype=torch.uint8), event=Event)
    t = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: 8 pieces of half the ring
    assert torch.equal(staged.copy(t, torch.empty_like(t)), t)
    assert [e.waited for e in Event.made] == [True] * 6 + [False] * 2  # the ring came round 6 times
    Event.made.clear()
    odd = torch.randn(333).to(torch.bfloat16)  # 666 bytes: a piece and a rest
    assert torch.equal(staged.copy(odd, torch.empty_like(odd)), odd) and len(Event.made) == 2


def test_the_host_is_charged_the_staging_rings_the_engine_reserves():
    """On CUDA, disk-tier groups cross the link through a page-locked ring per channel that
    carries them up (StagedCopies): the planner's host need for a disk window counts those
    rings (none on a CPU, where no ring is made), and as many as the engine reserves."""
    import dataclasses

    from klotski.execute.channels import DISK_CARRIERS
    from klotski.execute.staging import StagedCopies
    from planner.costmodel import CostModel
    from planner.profile import load_profile
    from planner.workingset import staging_bytes

    gpu = load_profile("rtx3090-pcie4")
    cpu = dataclasses.replace(gpu, device="cpu")
    assert gpu.device == "cuda"
    extra = staging_bytes(CostModel(gpu, "mixtral-8x7b")) - staging_bytes(CostModel(cpu, "mixtral-8x7b"))
    assert extra == len(DISK_CARRIERS) * StagedCopies().nbytes > 0


def test_host_computes_results_go_up_through_a_small_ring_the_host_account_holds():
    """On CUDA a pageable tensor crosses the link through a channel's page-locked ring; host
    compute's results did through a 32 MiB one made on first use, outside the host account (found
    by reading). The activations channel's ring is small, and charged where host compute may run;
    the disk carriers' rings where a disk tier is."""
    import types

    from klotski.assemble import reserve_staging_rings
    from klotski.execute.channels import make_channels
    from klotski.execute.trace import Trace
    from placement.tiers import Memory
    from planner.workingset import ACTIVATION_RING_BYTES, STAGED_RING_BYTES

    channels = make_channels(torch.device("cpu"), Trace(), None)
    assert channels["activations"].staged.nbytes == ACTIVATION_RING_BYTES < STAGED_RING_BYTES
    assert channels["experts"].staged.nbytes == STAGED_RING_BYTES

    def charged(device, tiers, modes):
        memory = Memory(1 << 30, "host")
        placement = types.SimpleNamespace(tiers=tiers, kv="device")
        setup = types.SimpleNamespace(device=torch.device(device), placement=placement, host_modes=modes)
        reserve_staging_rings(memory, channels, setup)
        return memory.used
    disk, host = {("expert", 0, 0): "disk"}, {("expert", 0, 0): "host"}
    assert charged("cuda", host, ("off", "off")) == 0
    assert charged("cuda", host, ("off", "auto")) == ACTIVATION_RING_BYTES
    assert charged("cuda", disk, ("on", "off")) == 2 * STAGED_RING_BYTES + ACTIVATION_RING_BYTES
    assert charged("cpu", disk, ("on", "on")) == 0


def test_the_steps_own_rings_are_charged_and_never_grow():
    """A step's small uploads and routing reads cross a CUDA link through two page-locked rings
    held for the run: the composition root charges them to the host budget, the plan counts the
    same bytes, and a read too large for its ring is a plain copy rather than a ring grown past
    its charge."""
    import types

    from klotski.assemble import reserve_staging_rings
    from klotski.execute.channels import make_channels
    from klotski.execute.staging import HostReads, SmallUploads
    from klotski.execute.trace import Trace
    from placement.tiers import Memory
    from planner.costmodel import CostModel
    from planner.layer import Host
    from planner.profile import load_profile
    from planner.shapes import as_shape
    from planner.workingset import STEP_RING_BYTES, host_ring_bytes

    half = STEP_RING_BYTES // 2
    cuda = torch.device("cuda")
    step = (SmallUploads(cuda, buffer=torch.zeros(half, dtype=torch.uint8)),
            HostReads(cuda, buffer=torch.zeros(half, dtype=torch.uint8)))
    memory = Memory(1 << 30, "host")
    setup = types.SimpleNamespace(device=cuda, placement=types.SimpleNamespace(tiers={}, kv="device"),
                                  host_modes=("off", "off"))
    reserve_staging_rings(memory, make_channels(torch.device("cpu"), Trace(), None), setup, step)
    cost = CostModel(load_profile("rtx3090-pcie4"), as_shape("mixtral-8x7b"))
    assert memory.used == STEP_RING_BYTES == host_ring_bytes(cost, Host())
    assert SmallUploads(torch.device("cpu")).pinned_bytes == HostReads(torch.device("cpu")).pinned_bytes == 0

    class Event:
        def record(self):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass
    reads = HostReads(torch.device("cpu"), buffer=torch.zeros(1 << 10, dtype=torch.uint8), event=Event)
    small, large = torch.arange(16), torch.arange(1 << 10)
    assert torch.equal(reads(small).wait(), small) and torch.equal(reads(large).wait(), large)
    assert len(reads.ring) == 1 << 10  # the large one did not grow it


def test_an_expert_computes_in_the_same_pieces_whatever_its_wave():
    """On an H200 the host placement's hidden states differed in their last bits from the resident
    run's (tests/gpu/test_gpu.py): waves cut their calls at every `step` rows of the wave, so an
    expert straddling a cut was computed as two products in one wave and one in another, and a
    GPU picks its kernel (its summation) by a product's rows. Here a product whose bits depend on
    its rows, as a GPU's can, on the per-group products (what fp32 on a GPU runs): the slots must
    be the same whatever the waves hold."""
    import numpy as np
    from klotski.execute.experts import LayerExperts, Routed

    g = torch.Generator().manual_seed(3)
    tokens, k, hidden, experts = 6, 2, 8, 6
    ids = torch.tensor([[0, 2], [0, 2], [0, 2], [0, 3], [0, 5], [2, 5]])  # pairs: 5, 0, 4, 1, 0, 2
    routed = Routed(torch.randn(tokens, hidden, generator=g), torch.rand(tokens, k, generator=g), ids,
                    None, [tokens], [None])
    w = {"w": torch.randn(experts, hidden, hidden, generator=g)}

    def rows_dependent_ffn(x, ws, groups):  # each group's product, shifted by its own row count
        parts = x[:sum(groups.counts)].split(groups.counts)
        return torch.cat([p @ ws["w"][i] + len(p) for i, p in enumerate(parts) if len(p)])

    def slots(waves):
        moe = LayerExperts(routed, k)
        moe.count(ids, experts)
        for wave in waves:
            moe.run_wave(rows_dependent_ffn, {"w": w["w"][wave]}, wave, torch.as_tensor)
        return moe.slots

    G.force_fallback("cpu", torch.float32)
    try:
        one = slots([list(range(experts))])
        assert torch.equal(one, slots([[2, 3], [0, 1, 4, 5]]))
        assert torch.equal(one, slots([[5], [3, 4], [0], [1, 2]]))
    finally:
        G.force_fallback("cpu", torch.float32, False)
    # every call within `step` (the group's tokens): the activation reserve still bounds a wave
    from klotski.execute.experts import call_rows
    for whole in (True, False):
        cuts = call_rows(np.array([5, 0, 4, 1, 0, 2]), tokens, whole)
        assert all(b - a <= tokens for a, b in cuts) and cuts[0][0] == 0 and cuts[-1][1] == 12
