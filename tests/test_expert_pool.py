"""The expert pool (issue 45 item 1): one set of device slots per run, sized from the planner's
working set, that every transferred expert lands in (packed ones decoded into it); its bytes reserved once; its
addresses fixed; waves computed over it; slots reused behind fences on CUDA."""
import pytest
import torch

from placement.pool import ExpertPool

SCHEDULES = ["klotski", "hot-prefetch", "simple", "multibatch"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from klotski.builtin.families import build_family
    return build_family(tmp_path_factory.mktemp("pool") / "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def ref(model):
    from tests.conftest import reference_tokens
    return reference_tokens(model)


def _streamed(model):
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    return Placement.by_kind(Checkpoint.open(str(model)).spec.group_keys(), expert="host")


def _minimum(model, schedule):
    from klotski.bench.pool_budget import pool_minimum_budget
    from klotski.config import RunConfig
    from tests.conftest import PROMPTS, requests
    n = 1 if schedule == "simple" else 2
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=n, schedule=schedule)
    return pool_minimum_budget(cfg, requests(PROMPTS, 10), _streamed(model))


def _run_watching_the_pool(model, budget, schedule):
    """Tokens and engine of a run with every expert on the host tier, recording the pool's
    tensors' addresses at every layer of every step and the weights each wave computed over."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.execute.experts import LayerExperts
    from tests.conftest import PROMPTS, requests
    n = 1 if schedule == "simple" else 2
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=n,
                    device_memory=budget, schedule=schedule)
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 10), placement=_streamed(model))
    pool = engine.cache.pool
    addresses, waves = set(), []
    engine.pipeline.on_layer = lambda layer, hs: addresses.add(tuple(t.data_ptr() for t in pool.tensors.values()))
    real = LayerExperts.run_wave

    def run_wave(self, ffn, w, experts, upload):
        waves.append((tuple(t.data_ptr() for t in w.values()), len(experts)))
        return real(self, ffn, w, experts, upload)
    LayerExperts.run_wave = run_wave
    try:
        done = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        LayerExperts.run_wave = real
        engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine, addresses, waves


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("where", ["minimum", "roomy"])
def test_streamed_experts_compute_over_the_pool_token_for_token(model, ref, schedule, where):
    """Every expert streamed from host memory, at the least budget whose planned working set
    holds one pool slot and at a roomy one: transformers' tokens; the pool made once (its
    addresses the same at every layer of every step) and every pooled wave computed over it;
    the peak within the budget."""
    budget = _minimum(model, schedule) if where == "minimum" else 64 << 20
    ours, engine, addresses, waves = _run_watching_the_pool(model, budget, schedule)
    assert ours == ref
    pool = engine.cache.pool
    assert pool is not None and pool.slots >= 1
    if where == "minimum":
        assert pool.slots == 1
    assert len(addresses) == 1
    ptrs = tuple(t.data_ptr() for t in pool.tensors.values())
    assert addresses == {ptrs}
    over_pool = [n for p, n in waves if p == ptrs]
    assert over_pool and all(n == pool.slots for n in over_pool)  # rows in slot order, one per slot
    assert engine.memory.peak <= budget


def test_the_pool_is_the_plans_expert_buffers_and_is_charged_once(model):
    """With a plan in its overlapping mode the pool holds the working set's expert buffers, and
    its bytes are in the device account from the engine's start beside the resident groups'.
    Every expected size is worked by hand here from the checkpoint's config.json, not by the
    functions the engine sizes them with: an expert is its gate, up and down projections,
    3 x hidden x moe_intermediate fp32 values (3 x 64 x 128 x 4 = 98,304 bytes); klotski's
    working set holds its K hot experts, one computing and one arriving (K + 2 slots, at most
    every expert); what is resident is every weight but the experts (embedding, untied head,
    final norm; per layer two norms, q/k/v/o, Qwen3's q and k norms and the router: 584,192
    bytes), and the account holds exactly that plus the pool's slots."""
    import json
    from klotski.assemble import build_engine, setup_run
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from klotski.schedule.sequences import prepare
    from tests.conftest import PROMPTS, requests
    c = json.loads((model / "config.json").read_text())
    hidden, inter, experts = c["hidden_size"], c["moe_intermediate_size"], c["num_local_experts"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    vocab, layers, fp32 = c["vocab_size"], c["num_hidden_layers"], 4
    assert not c["tie_word_embeddings"]
    expert_bytes = 3 * hidden * inter * fp32
    per_layer = (2 * hidden  # input and post-attention norms
                 + heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden + hidden * heads * head_dim  # q k v o
                 + 2 * head_dim  # q_norm, k_norm
                 + experts * hidden)  # the router
    resident = (layers * per_layer + 2 * vocab * hidden + hidden) * fp32
    assert (expert_bytes, resident) == (98_304, 584_192)  # the family's shapes, as worked out above
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, device_memory=64 << 20)
    ckpt = Checkpoint.open(str(model))
    seqs, _ = prepare(requests(PROMPTS, 10), ckpt.tokenizer, ckpt.spec, cfg)
    setup = setup_run(cfg, ckpt, seqs, placement=_streamed(model))
    plan = setup.plan
    assert plan.buffers == "overlap" and plan.schedule == "klotski" and 0 < plan.hot_experts
    slots = min(experts, plan.hot_experts + 2)  # (64 MiB holds them all: no slot is cut for room)
    engine = build_engine(cfg, ckpt, setup)
    try:
        pool = engine.cache.pool
        assert pool.slots == setup.expert_slots == slots
        assert {n: tuple(t.shape) for n, t in pool.tensors.items()} == {
            "w1": (slots, inter, hidden), "w3": (slots, inter, hidden), "w2": (slots, hidden, inter)}
        made = sum(t.numel() * t.element_size() for t in pool.tensors.values())  # the bytes really allocated
        assert pool.nbytes == made == slots * expert_bytes
        assert engine.memory.used == resident + slots * expert_bytes
    finally:
        engine.close()


def test_packed_experts_land_in_the_pool_decoded(tmp_path):
    """HQQ-quantized experts streamed: the pool's slots hold them decoded (the compute dtype's
    shapes), beside a packed row each that their copy lands in (tests/test_packed_pool.py)."""
    from klotski.assemble import open_engine
    from klotski.builtin import tiny
    from klotski.config import RunConfig
    from tests.conftest import PROMPTS, requests
    model = tiny.build_checkpoint(tmp_path / "m", "tiny")
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=1, quantize="hqq4",
                    offload_dir=str(tmp_path / "off"))
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS[:3], 2), placement=_streamed(model))
    try:
        list(engine.run(seqs))
        pool = engine.cache.pool
        assert pool is not None and engine.cache.pooled(("expert", 0, 0))
        assert {n: t.shape[1:] for n, t in pool.tensors.items()} == {
            n: t.shape for n, t in engine.cache.codec.decode(engine.cache.host[("expert", 0, 0)]).items()}
        assert pool.flat.shape == (pool.slots, engine.cache.moved[("expert", 0, 0)])
    finally:
        engine.close()


class FakeEvent:
    """A CUDA event's bookkeeping: recorded, queried, waited for."""
    made: list = []

    def __init__(self):
        self.recorded = False
        FakeEvent.made.append(self)

    def record(self):
        self.recorded = True

    def query(self):
        return False

    def synchronize(self):
        pass


def test_a_reused_slot_waits_for_its_last_reader_and_a_dropped_copy():
    """The CUDA discipline, checked with stub events: a slot given back after compute carries an
    event recorded on the compute stream; one whose copy was dropped unused carries that copy's
    ticket; the next copy into the slot is ordered after them (once), other slots after nothing;
    slots are taken lowest first."""
    like = {"w1": torch.zeros(4, 3), "w2": torch.zeros(3, 4)}
    pool = ExpertPool(3, like, 96, torch.device("cpu"), event=FakeEvent)
    assert pool.nbytes == 288 and pool.tensors["w1"].shape == (3, 4, 3)
    a, b, c = ("expert", 0, 5), ("expert", 0, 2), ("expert", 0, 9)
    assert [pool.take(k) for k in (a, b, c)] == [0, 1, 2] and pool.free() == 0
    assert pool.rows({c: 9, a: 5}) == [5, -1, 9]
    pool.tensors["w1"].zero_()
    pool.view(b)["w1"].fill_(1.0)
    assert pool.tensors["w1"][1].eq(1.0).all() and pool.tensors["w1"][0].eq(0.0).all()
    FakeEvent.made.clear()
    pool.give(b)  # computed with: a fence on the compute stream
    dropped = object()
    pool.give(a, dropped)  # its copy dropped unused: the copy itself is the fence
    assert len(FakeEvent.made) == 1 and FakeEvent.made[0].recorded
    assert pool.free() == 2
    s = [pool.take(("expert", 1, 0)), pool.take(("expert", 1, 1))]
    assert s == [0, 1]
    fences = pool.after(s)
    assert dropped in fences and any(getattr(f, "event", None) is FakeEvent.made[0] for f in fences)
    assert len(fences) == 2 and pool.after(s) == [] and pool.after([2]) == []
    shared = pool.fence()  # one event for a wave's experts, handed over once per copy
    pool.give(("expert", 1, 0), shared)
    pool.give(("expert", 1, 1), shared)
    assert pool.after([0, 1]) == [shared] and len(FakeEvent.made) == 2


def test_a_cpu_pool_keeps_no_fences():
    pool = ExpertPool(2, {"w": torch.zeros(2)}, 8, torch.device("cpu"))
    pool.take(("expert", 0, 0))
    pool.give(("expert", 0, 0))
    assert pool.after([0]) == []


def test_every_copy_into_a_reused_slot_is_submitted_after_its_fences(model, ref):
    """The cache's side of the CUDA discipline, run on a CPU with stub events: once a slot has
    been used, each copy into it is submitted `after` the fences its last users left (an event
    recorded when a wave's experts are released, or the copy dropped unused); the tokens
    unchanged (on a CPU channel a fence not yet done sends the copy to its worker)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from tests.conftest import PROMPTS, requests
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=3, num_batches=2,
                    device_memory=_minimum(model, "klotski"))
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 10), placement=_streamed(model))
    pool = engine.cache.pool
    used, unfenced, submitted = watch_slots(engine)
    given, real_after = [], pool.after

    def after(slots):
        fences = real_after(slots)
        given.extend(fences)
        return fences
    pool.after = after
    try:
        done = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == ref
    assert len(used) == pool.slots == 1 and not unfenced  # the one slot, reused behind its fences every time
    assert given and all(any(f is g for g in submitted) for f in given)  # handed to the copy's submission


def watch_slots(engine) -> tuple[set, list, list]:
    """Stub fences on the engine's pool, and what its run does with them: the slots taken, a
    slot taken again with no fence to follow (key, slot), the tickets handed to submissions."""
    pool = engine.cache.pool
    pool.event = FakeEvent
    used, unfenced, submitted = set(), [], []
    for channel in engine.channels.values():
        def submit(fn, *, real=channel.submit, after=(), **kw):
            submitted.extend(after)
            return real(fn, after=after, **kw)
        channel.submit = submit
    real_take = pool.take

    def take(key):
        s = real_take(key)
        if s in used and not pool.fences.get(s):
            unfenced.append((key, s))
        used.add(s)
        return s
    pool.take = take
    return used, unfenced, submitted


def test_the_pools_size_is_the_working_sets_expert_buffers_as_far_as_they_fit():
    """Hand-worked: activations 10 bytes, experts of 4; overlapping buffers beside an attention
    double buffer of 6 leave 30 - 16 = 14 bytes: 3 of klotski's K + 2 = 4 slots; the minimum
    working set (the largest other buffer, 6, counted) holds its one; no room, no slot."""
    from planner.workingset import expert_pool_slots
    ws = {"activations": 10, "decoded": 0, "attention_buffers": 6, "gate_buffers": 0, "expert_buffers": 16,
          "head_buffer": 0, "kv_buffers": 0}
    assert expert_pool_slots(ws, "overlap", {}, 30, 4, "klotski", 8, 2) == 3
    assert expert_pool_slots(ws, "overlap", {}, float("inf"), 4, "klotski", 8, 2) == 4
    assert expert_pool_slots(ws, "overlap", {}, float("inf"), 4, "multibatch", 8, 2) == 16
    assert expert_pool_slots(ws, "overlap", {"attention": True}, 30, 4, "klotski", 8, 2) == 4
    assert expert_pool_slots(ws, "minimum", {}, 30, 4, "klotski", 8, 2) == 1
    assert expert_pool_slots(ws, "minimum", {}, 19, 4, "klotski", 8, 2) == 0
