"""Output invariance of the offloading pipeline: every schedule, every n, tight budgets."""
import pytest

from conftest import PROMPTS, engine_tokens, reference_tokens, requests
from klotski.assemble import open_engine
from klotski.config import RunConfig
from planner.workingset import KV_BUFFERS, Step, activation_bytes
from placement.placement import Placement


@pytest.fixture(scope="module")
def ref(checkpoints):
    return reference_tokens(checkpoints["gqa"])


@pytest.mark.parametrize("schedule", ["klotski", "hot-prefetch", "multibatch", "simple"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_every_schedule_and_n_gives_identical_tokens(checkpoints, ref, schedule, n):
    if schedule == "simple" and n > 1:
        pytest.skip("simple runs one batch")
    ours, engine = engine_tokens(checkpoints["gqa"], batch_size=max(1, 6 // n), num_batches=n, schedule=schedule)
    assert ours == ref
    assert engine.memory.peak <= engine.memory.budget


def _tight(engine):
    """Device room for the LM head, one layer's attention and gate, a few experts, the KV
    buffers and the activation reserve of the largest possible prefill step."""
    size = engine.cache.full.__getitem__
    longest = max(len(engine.tokenizer(p)["input_ids"]) for p in PROMPTS)
    spec, n = engine.spec, len(PROMPTS)
    act = activation_bytes(spec, 4, Step(tokens=n * longest, sequences=n, batch=n, queries=longest,
                                         keys=longest + 10))
    kv = KV_BUFFERS * n * (longest + 10) * 2 * spec.shape.num_kv_heads * spec.shape.head_dim * 4
    return size(("head",)) + size(("attn", 0)) + size(("gate", 0)) + 4 * size(("expert", 0, 0)) + act + kv


@pytest.mark.parametrize("schedule", ["klotski", "hot-prefetch", "multibatch", "simple"])
@pytest.mark.parametrize("n", [1, 2, 4])
# a fast emulated link keeps every channel on its worker thread (without one a CPU copy runs
# on the scheduling thread): the threaded state machine must stay exact too
@pytest.mark.parametrize("link", [None, 1000.0], ids=["inline", "threads"])
def test_tight_budget_kv_on_host_experts_on_disk(checkpoints, ref, schedule, n, link):
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    keys = probe.spec.group_keys()
    placement = Placement.by_kind(keys, kv="host", embed="host", head="device", attn="host", gate="host",
                                  expert="disk")
    budget = _tight(probe)
    ours, engine = engine_tokens(checkpoints["gqa"], placement=placement, device_memory=budget,
                                 batch_size=max(1, 6 // n), num_batches=n, schedule=schedule,
                                 emulate_link_gbps=link)
    assert ours == ref
    assert engine.memory.peak <= budget
    assert engine.pipeline.experts_loaded > 0                  # experts really moved
    assert engine.trace.bytes["device_to_host"] > 0            # KV really went back to the host


def test_planned_placement_spreads_over_tiers(checkpoints, ref):
    """A budget below the model size makes the planner's placement use host and disk."""
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    total = sum(probe.cache.full.values())
    ours, engine = engine_tokens(checkpoints["gqa"], device_memory=total * 6 // 10, host_memory=total * 6 // 10)
    tiers = set(engine.placement.tiers.values())
    assert {"host", "disk"} <= tiers
    assert ours == ref
    assert engine.memory.peak <= total * 6 // 10
    assert engine.plan is not None and engine.plan.placement


def test_misplaced_kv_block_is_caught(checkpoints, ref, monkeypatch):
    """Storing a batch's new KV one slot off changes the output: the invariance tests would see it."""
    from klotski.execute.kvcache import BatchKV
    original = BatchKV.store

    def off_by_one(self, layer, buf):
        shift = 1 if self.filled else 0  # decode steps store their KV one slot early
        self.filled -= shift
        try:
            original(self, layer, buf)
        finally:
            self.filled += shift

    monkeypatch.setattr(BatchKV, "store", off_by_one)
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    placement = Placement.by_kind(probe.spec.group_keys(), kv="host")
    ours, _ = engine_tokens(checkpoints["gqa"], placement=placement, batch_size=3, num_batches=2)
    assert ours != ref


def test_first_batchs_kv_comes_up_during_the_layer_before(checkpoints, ref, monkeypatch):
    """With the KV cache on the host, batch 0's KV for layer l+1 is loaded while layer l's
    experts run (inequality (7)), not after them; tokens stay exact."""
    from klotski.execute.pipeline import Pipeline
    issued = []
    load = Pipeline._kv_load

    def spy(self, kv, layer):
        issued.append((layer, self.res.layer))  # the layer the step is in
        return load(self, kv, layer)
    monkeypatch.setattr(Pipeline, "_kv_load", spy)
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    placement = Placement.by_kind(probe.spec.group_keys(), kv="host")
    issued.clear()
    ours, engine = engine_tokens(checkpoints["gqa"], placement=placement, batch_size=3, num_batches=2)
    assert ours == ref
    ahead = [layer for layer, now in issued if layer == now + 1]
    assert ahead and set(ahead) == set(range(1, engine.spec.shape.num_layers))


@pytest.mark.parametrize("schedule", ["klotski", "multibatch"])
def test_quantized_weights_move_packed_and_give_identical_tokens_on_any_placement(checkpoints, tmp_path, schedule):
    """HQQ output differs from bf16/fp32 by design, but must not depend on where bytes live."""
    resident, _ = engine_tokens(checkpoints["gqa"], quantize="hqq4", offload_dir=str(tmp_path / "q"),
                                batch_size=6, num_batches=1)
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    placement = Placement.by_kind(probe.spec.group_keys(), kv="host", attn="host", expert="disk")
    moved, engine = engine_tokens(checkpoints["gqa"], quantize="hqq4", offload_dir=str(tmp_path / "q"),
                                  placement=placement, batch_size=2, num_batches=3, schedule=schedule)
    assert moved == resident
    expert = ("expert", 0, 0)
    assert engine.cache.moved[expert] * 3 < engine.cache.full[expert]  # packed bytes cross the link
    assert engine.memory.peak <= engine.memory.budget


def test_disk_reads_ride_the_disk_lane_and_are_handed_over_without_a_copy(checkpoints, ref):
    """Every disk byte is read on the disk channel (counted, and during decode too); a staged
    buffer becomes the device copy itself on CPU, while a host-tier group is copied."""
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    placement = Placement.by_kind(probe.spec.group_keys(), kv="host", attn="host", expert="disk")
    ours, engine = engine_tokens(checkpoints["gqa"], placement=placement, batch_size=3, num_batches=2, close=False)
    assert ours == ref
    cache, disk_keys = engine.cache, [k for k, t in placement.tiers.items() if t == "disk"]
    assert engine.trace.bytes["disk_to_host"] >= sum(cache.moved[k] for k in disk_keys)
    assert engine.trace.busy["disk"] > 0 and engine.stats.decode_disk_bytes > 0
    channel, expert, attn = engine.channels["experts"], ("expert", 0, 0), ("attn", 0)
    cache.stage([expert])
    staged = cache.staging[expert].wait()
    assert cache.start(expert, channel)
    assert expert not in cache.staging  # the window lets go once the copy owns the buffer
    on_device = cache.get(expert)
    assert all(on_device[n].data_ptr() == staged[n].data_ptr() for n in staged)
    cache.release(expert)
    engine.channels["disk"].submit(lambda: None, name="drain", link=None).wait()  # FIFO: reads in flight land
    unstaged, before = ("expert", 1, 1), engine.trace.bytes["disk_to_host"]
    cache.unstage([unstaged])
    assert cache.start(unstaged, channel)
    cache.get(unstaged)  # read on demand: still on the disk lane, still counted
    assert engine.trace.bytes["disk_to_host"] - before == cache.moved[unstaged]
    cache.release(unstaged)
    assert cache.start(attn, channel)
    copied = cache.get(attn)
    assert all(copied[n].data_ptr() != cache.host[attn][n].data_ptr() for n in copied)
    cache.release(attn)
    engine.close()


def test_quantized_copy_is_made_per_compute_dtype(checkpoints):
    """Unquantized parts (norms) are stored in the compute dtype, which the planner sized:
    a copy made for one dtype is never reused for another."""
    from klotski.util import cachedir
    for dtype in ("float32", "bfloat16"):
        cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype=dtype, quantize="hqq4",
                        batch_size=6, num_batches=1)
        engine, seqs, _ = open_engine(cfg, requests(PROMPTS[:2], 2))
        assert len(list(engine.run(seqs))) == 2
        engine.close()
    names = sorted(p.name.split("-", 1)[1] for p in (cachedir.root() / "quantized").iterdir()
                   if p.name.startswith(engine.ckpt.key))
    assert names == ["hqq4-g64-m128-bfloat16", "hqq4-g64-m128-float32"]


def test_decode_steps_are_timed_apart(checkpoints):
    """The report's decode-only bubble reads lanes timed during decode steps alone."""
    _, engine = engine_tokens(checkpoints["gqa"], max_new_tokens=4, batch_size=3, num_batches=2,
                              emulate_link_gbps=2.0)
    busy, decode = engine.trace.busy, engine.trace.decode_busy
    assert 0 < decode["compute"] < busy["compute"]  # prefill steps are left out
    assert 0 <= engine.trace.bubble_share(decode_only=True) < 1


def test_left_padding_is_not_routed(checkpoints, ref, monkeypatch):
    """A padded prefill routes (and computes experts for) its real tokens only: the router of
    the first step sees exactly the prompts' tokens, not batch x longest; tokens unchanged."""
    from transformers import AutoTokenizer

    from klotski.execute import pipeline
    seen = []
    original = pipeline.route_group

    def counting(family, spec, hs, gate, keeps, shared=True):
        r = original(family, spec, hs, gate, keeps, shared)
        if shared and [h.shape[0] for h in hs] == [len(PROMPTS)] and hs[0].shape[1] > 1:  # the job's prefill
            seen.append(r.x.shape[0])
        return r

    monkeypatch.setattr(pipeline, "route_group", counting)
    ours, _ = engine_tokens(checkpoints["gqa"], batch_size=6, num_batches=1, prefill_chunk=1024)
    lengths = [len(AutoTokenizer.from_pretrained(checkpoints["gqa"])(p)["input_ids"]) for p in PROMPTS]
    assert ours == ref
    assert seen and set(seen) == {sum(lengths)}  # every layer of the prefill
    assert sum(lengths) < len(PROMPTS) * max(lengths)


def test_the_replay_takes_the_routing_the_job_had(checkpoints):
    """The engine counts each MoE layer's picks (every real token's top-k: prompt tokens once,
    then one token a step); the replay prices the job with those marginals (in expert order).
    Routing skewed onto a few experts means fewer distinct experts a pass, so fewer moved:
    less prefill time than the uniform routing the plan assumed (on the realdims Qwen3 shape
    on CPU, skewed routing: replayed prefill 9.77 -> 4.80 s against 4.58 measured)."""
    from transformers import AutoTokenizer

    from klotski.assemble import pipeline_cost
    from klotski.planning import replayed_plan
    from planner.routing import marginals_from_counts
    model = checkpoints["gqa"]
    out, engine = engine_tokens(model, max_new_tokens=6, batch_size=3, num_batches=2, batching="static",
                                device_memory=400_000)
    tok = AutoTokenizer.from_pretrained(model)
    tokens = sum(len(tok(p)["input_ids"]) for p in PROMPTS) + sum(len(o) - 1 for o in out)
    spec = engine.spec
    assert engine.pipeline.routed.sum(axis=1).tolist() == [spec.shape.top_k * tokens] * engine.pipeline.routed.shape[0]
    measured = marginals_from_counts(engine.pipeline.routed, spec.shape.top_k)
    assert sum(measured) == pytest.approx(spec.shape.top_k) and max(measured) <= 1.0
    prompts, lens = [len(tok(p)["input_ids"]) for p in PROMPTS], [len(o) for o in out]

    def replay(popularity):
        return replayed_plan(engine.config, engine.ckpt, engine.setup, prompts, lens, pipeline_cost, popularity)
    few = [1.0] * spec.shape.top_k + [0.0] * (spec.shape.num_experts - spec.shape.top_k)  # every token picks the same experts
    assert replay(few).job_prefill_s < replay(None).job_prefill_s
    assert replay(measured).job_prefill_s > 0


def test_marginals_from_counts_keep_expert_order_and_skip_silent_layers():
    from planner.routing import marginals_from_counts
    counts = [[4, 2, 1, 1], [0, 0, 0, 0], [2, 2, 2, 2]]  # top-2: 4 tokens in the first layer, 4 in the last
    assert marginals_from_counts(counts, 2) == pytest.approx([(1.0 + 0.5) / 2, 0.5, (0.25 + 0.5) / 2, 0.375])
    assert marginals_from_counts([[0, 0]], 1) is None


def test_replayed_rate_is_the_plan_over_the_lengths_generated(checkpoints):
    """The report's replay: the run's plan over the job's own lengths gives the plan's own
    prediction back; over shorter answers (EOS early) a lower rate (the prefill is paid for
    fewer tokens), and a job that stops at once a lower one still; its job's prefill and
    decode seconds are the time that rate is over."""
    from klotski.assemble import pipeline_cost
    from klotski.planning import replayed_plan
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", max_new_tokens=16)
    engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 16))
    engine.close()
    prompts = [len(s.prompt_ids) for s in seqs]
    def plan(lens):
        return replayed_plan(engine.config, engine.ckpt, engine.setup, prompts, lens, pipeline_cost)
    rate = lambda lens: plan(lens).predicted_tokens_per_s  # noqa: E731
    assert rate([16] * len(seqs)) == pytest.approx(engine.plan.predicted_tokens_per_s, rel=1e-6)
    assert rate([1] * len(seqs)) < rate([4, 16, 2, 16, 8, 3]) < rate([16] * len(seqs))
    lens = [4, 16, 2, 16, 8, 3]
    short = plan(lens)
    assert short.job_prefill_s > 0 and short.job_decode_s > 0
    assert sum(lens) / (short.job_prefill_s + short.job_decode_s) == pytest.approx(short.predicted_tokens_per_s,
                                                                                  rel=1e-6)


def test_the_expert_phase_is_bit_identical_in_any_order():
    """The expert phase's tensor work (klotski/execute/experts.py), for a group of batches
    routed together: each expert's picks are what `torch.where(experts == e)` gives over the
    group's tokens, and whatever order the experts compute in, the layer's output is the same
    bit for bit (outputs wait in their top-k slots)."""
    import torch

    from klotski.models import layers as L
    from klotski.execute.experts import LayerExperts, Routed, run_expert

    torch.manual_seed(0)
    E, k, H = 8, 2, 16
    hs = [torch.randn(2, 3, H), torch.randn(1, 5, H)]
    w = {e: {"w1": torch.randn(32, H), "w3": torch.randn(32, H), "w2": torch.randn(H, 32)} for e in range(E)}
    x = torch.cat([h.reshape(-1, H) for h in hs])
    weights, experts = L.route(x, torch.randn(E, H), k, renormalise=True, cast=False)
    routed = Routed(x, weights, experts, None, [6, 5], [None, None])

    def layer(order):
        moe = LayerExperts(routed, k)
        moe.count(experts, E)
        for e in order(moe.chosen):
            picks = moe.picks(e)
            tok = moe.tokens(picks)
            assert tok.tolist() == torch.where(experts == e)[0].tolist()
            moe.put(picks, run_expert(L.swiglu, moe.inputs(picks), w[e]))
        return moe.hidden_states(hs)

    first = layer(lambda chosen: chosen)
    # what transformers computes: each token's k expert outputs times their weights, summed in slot order
    want = torch.stack([sum((L.swiglu(x[t:t + 1], w[int(experts[t, j])]) * weights[t, j]).squeeze(0)
                            for j in range(k)) for t in range(len(x))])
    assert torch.allclose(torch.cat([(a - h).reshape(-1, H) for a, h in zip(first, hs)]), want, rtol=1e-4, atol=1e-4)
    for again in (layer(lambda chosen: chosen[::-1]), layer(lambda chosen: chosen[1::2] + chosen[::2])):
        assert all(torch.equal(a, b) for a, b in zip(first, again))
