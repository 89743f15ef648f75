"""Budgets are promises: from an eighth of the model to all of it, every device budget either
runs to the end token-identical to transformers with peak device (and host) bytes within the
budgets, or is refused before a weight is read, naming a minimum with which the job then
runs. Long prompts are prefilled in chunks rather than refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import reference_tokens
from klotski.builtin import tiny
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.requests import Request
from klotski.planning import BudgetRefused
from placement.store import TensorStore
from planner.units import format_size_flag, parse_size

# The configuration of the budgets issue: hidden 96, 5 layers, 6 experts top-2, 6 query heads
# on 2 KV heads (~6.4 MB in fp32), 24 prompts of 10-60 tokens, batch size 4.
SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=5, num_local_experts=6,
             num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
NEW = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("budget") / "m", "tiny", **SHAPE)


@pytest.fixture(scope="module")
def prompts(model):
    return budget_prompts(model)


def budget_prompts(model, count=24) -> list[str]:
    """Encyclopedic prompts of 10, 12, ... 56 tokens (under the model's tokenizer)."""
    from transformers import AutoTokenizer

    from klotski.prefetch.correlate import warmup_prompts
    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for text in warmup_prompts(64, 48):
        words = text.split()
        for n in range(len(words), 0, -1):  # the longest prefix within the length wanted next
            cut = " ".join(words[:n])
            if len(tok(cut)["input_ids"]) <= 10 + 2 * len(out):
                out.append(cut)
                break
        if len(out) == count:
            return out
    raise AssertionError("corpus too short")


@pytest.fixture(scope="module")
def ref(model, prompts):
    return reference_tokens(model, prompts, NEW)


def _requests(prompts):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None) for i, p in enumerate(prompts)]


def _run(model, prompts, budget, **config):
    cfg = RunConfig(model=str(model), dtype="float32", batch_size=4, max_new_tokens=NEW, device_memory=budget,
                    progress=False, **config)
    engine, seqs, _ = open_engine(cfg, _requests(prompts))
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(prompts))], engine


def _model_bytes(model) -> int:
    store = TensorStore(model)
    return sum(e.nbytes for e in store.entries.values())


def test_prompts_span_the_lengths_wanted(model, prompts):
    from transformers import AutoTokenizer
    lengths = [len(AutoTokenizer.from_pretrained(model)(p)["input_ids"]) for p in prompts]
    assert min(lengths) <= 12 and 50 <= max(lengths) <= 60


# with attention beside a host KV cache the plan reserves no keys or scores on the device,
# and the run must charge what the plan reserved
@pytest.mark.parametrize("schedule, host_attention", [("klotski", "off"), ("multibatch", "off"), ("klotski", "on")])
def test_every_budget_runs_exactly_within_it_or_names_a_minimum_that_does(model, prompts, ref, schedule,
                                                                          host_attention, monkeypatch):
    total = _model_bytes(model)
    reads = []
    real_read = TensorStore.read
    monkeypatch.setattr(TensorStore, "read", lambda self, *a, **k: reads.append(a) or real_read(self, *a, **k))
    outcomes = []
    for eighths in (1, 2, 3, 4, 6, 8):
        budget = total * eighths // 8
        reads.clear()
        try:
            ours, engine = _run(model, prompts, budget, schedule=schedule, host_attention=host_attention)
        except BudgetRefused as e:
            assert not reads, "refused after reading weights"
            assert e.budget == "device" and budget < e.needed
            budget = parse_size(format_size_flag(e.needed))  # what the user types, from the message
            assert f"--device-memory {format_size_flag(e.needed)}" in str(e)
            ours, engine = _run(model, prompts, budget, schedule=schedule, host_attention=host_attention)
            outcomes.append(("refused", eighths))
        else:
            outcomes.append(("ran", eighths))
        assert ours == ref, (eighths, budget)
        assert engine.memory.peak <= budget
        assert engine.host_memory.peak <= engine.host_memory.budget
    assert ("ran", 1) in outcomes or ("refused", 1) in outcomes
    assert sum(kind == "ran" for kind, _ in outcomes) >= 4


@pytest.mark.parametrize("kind", ["expert", "attn"])
def test_a_placement_given_is_refused_before_loading_or_runs_within_the_budget(model, prompts, ref, kind,
                                                                                monkeypatch):
    """A placement handed to open_engine (the Python API, tests, benchmarks) is not the planner's:
    where its resident bytes and a step's least working set cannot fit, it is refused before a
    weight is read (it used to fail mid-run: "nothing left to evict"), naming a budget with
    which the same placement runs exactly, within it."""
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    keys = Checkpoint.open(str(model)).spec.group_keys()
    placement = Placement.by_kind(keys, **{kind: "host"})
    reads = []
    real_read = TensorStore.read
    monkeypatch.setattr(TensorStore, "read", lambda self, *a, **k: reads.append(a) or real_read(self, *a, **k))

    def run(budget):
        cfg = RunConfig(model=str(model), dtype="float32", batch_size=4, num_batches=2, max_new_tokens=NEW,
                        device_memory=budget, progress=False)
        engine, seqs, _ = open_engine(cfg, _requests(prompts), placement=placement)
        done = {s.request.id: s.out for s in engine.run(seqs)}
        engine.close()
        return [done[f"r{i}"] for i in range(len(prompts))], engine

    with pytest.raises(BudgetRefused) as refused:
        run(_model_bytes(model) // 8)
    assert not reads, "refused after reading weights"
    assert f"--device-memory {format_size_flag(refused.value.needed)}" in str(refused.value)
    budget = parse_size(format_size_flag(refused.value.needed))
    ours, engine = run(budget)
    assert ours == ref
    assert engine.memory.peak <= budget


def test_a_budget_that_cannot_work_is_refused_before_any_measurement(model, prompts, monkeypatch):
    """The minimum needs no timings: a refusal comes before this machine is measured (on a
    new machine or model that measure is the first run's wait), and names the same minimum."""
    with pytest.raises(BudgetRefused) as measured:
        _run(model, prompts, 64 << 10)
    monkeypatch.setattr("klotski.planning.profile_for", lambda *a, **k: pytest.fail("measured before refusing"))
    with pytest.raises(BudgetRefused) as early:
        _run(model, prompts, 64 << 10)
    assert str(early.value) == str(measured.value) and early.value.needed == measured.value.needed


def test_the_timeless_precheck_takes_host_compute_on_a_gpu(model):
    """Found on an H200: the memory-only pre-check's profile had no host rates, so on a CUDA
    device `--host-attention on` was refused as 'no host rates' before anything ran."""
    import torch

    from klotski import planning
    from klotski.io.checkpoint import Checkpoint
    from placement.tiers import Budgets

    cfg = RunConfig(model=str(model), dtype="float32", batch_size=4, max_new_tokens=NEW,
                    host_attention="on", host_experts="on")
    ckpt = Checkpoint.open(cfg.model)
    plan = planning._plan_lengths(cfg, ckpt, torch.float32, torch.device("cuda"), Budgets(device=_model_bytes(model) // 4, host=1 << 34),
                                  [20, 30], [NEW, NEW], NEW, None, memory_only=True)
    assert plan.host_attention and plan.host_experts == "on"


def test_a_tight_budget_prefills_long_prompts_in_chunks(model, prompts, ref):
    total = _model_bytes(model)
    ours, engine = _run(model, prompts, total // 4)
    assert ours == ref
    chunk = engine.setup.prefill_chunk
    assert chunk is not None and chunk < max(len(s) for s in engine.tokenizer(prompts)["input_ids"])
    groups = -(-len(prompts) // (engine.batch_size * engine.num_batches))
    assert engine.stats.prefill_passes > groups  # more than one pass per group
    assert engine.memory.peak <= total // 4
    roomy = _run(model, prompts[:4], None)[1]  # the machine's own budget: whole prompts, one pass each
    assert roomy.setup.prefill_chunk is None and roomy.stats.prefill_passes == 1


def test_forced_prefill_chunks_give_identical_tokens(model, prompts, ref):
    for chunk in (1, 7):
        ours, engine = _run(model, prompts[:8], None, prefill_chunk=chunk, num_batches=2)
        assert ours == ref[:8]
        assert engine.setup.prefill_chunk == chunk


def test_refusal_is_one_line_before_the_output_exists_and_its_minimum_runs(model, prompts, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts[:8])))
    out = tmp_path / "out.jsonl"
    base = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "--model", str(model), "-o", str(out),
            "--batch-size", "4", "--dtype", "float32", "--max-new-tokens", str(NEW), "--no-progress"]
    report = tmp_path / "report.json"
    report.write_text('{"tokens_per_s": 99.0}')  # an earlier run's report at the same path
    r = subprocess.run(base + ["--device-memory", "64KiB", "--report", str(report)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "device budget" in lines[0] and not out.exists()
    refused = json.loads(report.read_text())  # says what happened, not the earlier numbers
    assert "tokens_per_s" not in refused and "device budget" in refused["error"]
    minimum = lines[0].split("--device-memory ")[1].split()[0]
    r = subprocess.run(base + ["--device-memory", minimum, "--report", str(report)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 8
    assert "error" not in json.loads(report.read_text())


def test_pinned_blocks_hold_exact_copies_at_their_charge():
    """The host tier's page-locked blocks (placement/pinned.py; plain memory without CUDA): each
    group one page-aligned block, tensors at 64-byte boundaries, charged whole pages."""
    import torch

    from placement import pinned
    blocks = pinned.PinnedBlocks(pinned=False)
    group = {"w1": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int8), "w2": torch.randn(2, 2).bfloat16()}
    copy = blocks.copy(group)
    for name, t in group.items():
        assert copy[name].dtype == t.dtype and torch.equal(copy[name], t), name
    ptrs = [copy[n].data_ptr() for n in group]
    assert ptrs[0] % pinned.PAGE == 0 and all((p - ptrs[0]) % 64 == 0 for p in ptrs)
    assert pinned.group_nbytes(group.values()) == 64 + 64 + 64
    assert pinned.charge(192) == pinned.PAGE and pinned.charge(pinned.PAGE + 1) == 2 * pinned.PAGE
    kv = blocks.zeros((4, 2, 3), torch.float16)
    assert kv.shape == (4, 2, 3) and not kv.any() and kv.data_ptr() % pinned.PAGE == 0
    blocks.close()


@pytest.mark.parametrize("schedule", ["klotski", "multibatch"])
def test_newcomers_caches_leave_the_steps_their_room(model, prompts, ref, schedule):
    """Continuous batching allocates newcomers' KV caches beyond the planned ones: only
    while a step can still run beside them (its activations and the largest group it
    fetches). A quarter of the model, experts and attention on the host, 16-token chunks
    (static batching runs in it; newcomers taking what room there was did not)."""
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    ckpt = Checkpoint.open(str(model))
    placement = Placement.by_kind(ckpt.spec.group_keys(), expert="host", attn="host", embed="host")
    ckpt.close()
    budget = _model_bytes(model) // 4
    cfg = RunConfig(model=str(model), dtype="float32", batch_size=4, num_batches=1, prefill_chunk=16,
                    max_new_tokens=NEW, device_memory=budget, progress=False, schedule=schedule)
    engine, seqs, _ = open_engine(cfg, _requests(prompts), placement=placement)
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(prompts))] == ref
    assert engine.memory.peak <= budget and engine.stats.refills > 0


def test_shared_prefixes_keep_continuous_steps_within_the_budget(model, prompts):
    """Lines that share an instruction start from its segment (schedule/prefix.py): every
    newcomer's chunk also scores the segment's keys, and is sized counting them. (Sized
    without them, a step's activations outgrew the limit the plan reserved and the run
    stopped out of budget at 1/5, 1/4 and 3/8 of this model.)"""
    instruction = ("You are a careful annotator. Read the passage below and label its topic as one of: "
                   "science, history, art, sport, other. Passage: ")
    lines = [instruction + p for p in prompts[:16]]
    ref = reference_tokens(model, lines, NEW)
    total = _model_bytes(model)
    for budget in (total // 5, total // 4, total * 3 // 8):
        ours, engine = _run(model, lines, budget)
        assert engine.stats.prefix_lines == len(lines)
        assert ours == ref, budget
        assert engine.memory.peak <= budget


def test_long_lines_beside_shared_prefixes_stay_within_the_plan(model, prompts):
    """A batch mixing lines that start from a shared instruction with long lines that share
    nothing scores the instruction's keys beside the long lines' own: more keys than any
    whole prompt the plan sized for. Prefill chunks are cut to keep such steps within the
    activations the plan left room for (Engine.chunk_within); before, the run overran budgets
    the plan had accepted (3/10 and 3/4 of this model at n = 2)."""
    instruction = ("You are a careful annotator. Read the passage below and label its topic as one of: science, "
                   "history, art, sport, music, cooking, travel, or other; answer with the label alone. Passage: ")
    lines = [instruction + p for p in prompts[:10]] + prompts[-3:]
    ref = reference_tokens(model, lines, NEW)
    total = _model_bytes(model)
    for budget in (total * 3 // 10, total * 3 // 4):
        ours, engine = _run(model, lines, budget, num_batches=2)
        assert engine.stats.prefix_lines == 10
        assert ours == ref, budget
        assert engine.memory.peak <= budget


@pytest.mark.parametrize("share,refills", [(0.4, False), (1.0, None), (1.5, True)])
def test_the_plan_replays_whether_newcomers_find_room(model, prompts, share, refills):
    """Continuous batching prefills waiting prompts ahead of free rows only where their caches
    fit beside the plan on the device; where none does, the engine runs group after group,
    each prefilled alone. The planner's replay of the job (planner/occupancy.continuous_steps
    within workingset.newcomer_room) makes the engine's prefill passes: 12 prompts of ~108
    tokens, KV on the device, at 0.4 of the model no newcomer fits (the replay assumed every
    one did: 17 passes against the engine's 21), at 1.5 all do; at 1.0 whether one-row newcomers
    fit depends on which weights the measured speed places on the device (None: either)."""
    from klotski import planning
    lines = [f"{i}. " + prompts[-1] + " " + prompts[-2] for i in range(12)]
    cfg = RunConfig(model=str(model), dtype="float32", batch_size=4, num_batches=1, prefill_chunk=16,
                    max_new_tokens=NEW, device_memory=int(_model_bytes(model) * share), progress=False,
                    prefix_cache=False)
    engine, seqs, _ = open_engine(cfg, _requests(lines))
    done = list(engine.run(seqs))
    engine.close()
    assert engine.placement.kv == "device" and refills in (None, engine.stats.refills > 0)
    replay = planning.replayed_plan(cfg, engine.ckpt, engine.setup, [len(s.prompt_ids) for s in done],
                                    [len(s.out) for s in done])
    assert replay.job_prefill_passes == engine.stats.prefill_passes


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    from klotski.builtin.families import build_family
    return str(build_family(tmp_path_factory.mktemp("olmoe"), "olmoe"))


@pytest.mark.parametrize("case", ["338", "591"])
def test_shared_segments_take_only_room_the_plan_leaves(olmoe, case):
    """Two configurations `benchmarks/fuzz_exactness.py` (seed 11) found over budget, both with
    shared instructions and one-column chunks: the segments' cache took room the plan had left
    for a step (static, bs 1), and a batch attending over its rows' segments beside a long line
    of its own passed the activations the plan reserved, which no chunk can cut (continuous,
    2 x 3). Segments are now held only beside the plan's room for the rows and a step, and only
    where a one-column step over them fits the reserve; else those lines prefill whole. (Each
    stopped out of budget before on the machine that found them; placements follow this
    machine's profile, so elsewhere they may pass either way: the budget is what is asserted.)"""
    c = json.loads((Path(__file__).parent / "data" / "fuzz_prefix_budgets.json").read_text())[case]
    ref = reference_tokens(olmoe, c["prompts"], c["max_new_tokens"])
    cfg = RunConfig(model=olmoe, dtype="float32", progress=False, max_new_tokens=c["max_new_tokens"], **c["config"])
    engine, seqs, _ = open_engine(cfg, [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None)
                                         for i, p in enumerate(c["prompts"])])
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(c["prompts"]))] == ref
    assert engine.memory.peak <= c["config"]["device_memory"]
