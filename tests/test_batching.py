"""Continuous batching (klotski/schedule/batching.py): rows change hands, tokens do not change.

A job whose max_new_tokens are heavy-tailed, more prompts than rows: every sequence's greedy
tokens equal transformers' (which generates each prompt to the longest limit; a shorter
limit is a prefix of that), whatever the schedule, with the KV cache on the host, a sliding
window, chunked newcomer prefill and slots realigned both ways."""
import pytest
import torch

from conftest import reference_tokens
from klotski.assemble import open_engine
from klotski.io.checkpoint import Checkpoint
from klotski.config import RunConfig
from klotski.io.requests import Request
from klotski.execute.kvcache import BatchKV
from placement.placement import Placement
from placement.store import TensorStore

PROMPTS = [
    "Paris",
    "The history of the city begins",
    "A river is a natural flowing watercourse",
    "Mount Everest",
    "Quantum mechanics is a fundamental theory in physics that describes the behaviour of nature at small scales",
    "The album was recorded in London during the winter of 1971 and released the following spring",
    "Bees",
    "In the beginning",
    "The committee met on Tuesday to discuss the budget for the coming year and its many",
    "Rain",
]
# heavy-tailed: the long ones start first and the short ones pass through their rows behind them
MAX_NEW = [12, 2, 3, 2, 3, 9, 2, 4, 2, 3]


def _requests(max_new=MAX_NEW):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=m)
            for i, (p, m) in enumerate(zip(PROMPTS, max_new))]


def _run(model_dir, placement=None, requests=None, **config):
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", batch_size=2, num_batches=2, **config)
    engine, seqs, errors = open_engine(cfg, requests or _requests(), placement=placement)
    assert not errors
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' greedy tokens for each prompt, cut to its own limit."""
    out = {}
    for name in ("gqa", "window"):
        full = reference_tokens(checkpoints[name], PROMPTS, max_new_tokens=max(MAX_NEW))
        out[name] = [t[:m] for t, m in zip(full, MAX_NEW)]
    return out


@pytest.mark.parametrize("schedule", ["klotski", "multibatch", "hot-prefetch", "simple"])
def test_continuous_equals_transformers_every_schedule(checkpoints, reference, schedule):
    tokens, engine = _run(checkpoints["gqa"], schedule=schedule, prefill_chunk=4)
    assert tokens == reference["gqa"]
    assert engine.stats.refills >= len(PROMPTS) - 2 * engine.num_batches  # rows did change hands


def _held_objects(root, depth=3):
    """Everything reachable from `root` through attributes, lists, tuples and dicts (a few levels)."""
    seen, todo = [], [(root, 0)]
    while todo:
        obj, d = todo.pop()
        seen.append(obj)
        if d == depth:
            continue
        if isinstance(obj, (list, tuple)):
            todo += [(x, d + 1) for x in obj]
        elif isinstance(obj, dict):
            todo += [(x, d + 1) for x in obj.values()]
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            todo += [(x, d + 1) for x in vars(obj).values()]
    return seen


def test_the_scheduler_holds_handles_and_the_views_it_reads_are_the_caches(checkpoints, reference, monkeypatch):
    """Through a run with refills, moves and realigns: after every step the scheduler's batches,
    newcomers and spares hold no cache object, only handles the executor's manager knows, and
    each live row reaches back as far as its cache's valid slots say (what the next decision
    reads is what the tensors hold)."""
    from klotski.schedule.batching import Scheduler
    step, checked = Scheduler.step, []

    def watched(self):
        out = step(self)
        state = [self.decode, self.newcomers, self.spare]
        held = [o for o in _held_objects(state) if isinstance(o, BatchKV)]
        assert held == [], "the scheduler holds a cache object"
        for d in self.decode:
            kv = self.caches.caches[d.cache][1]  # the executor's own, by the handle
            view = self.caches.view(d.cache)
            assert view.filled == kv.filled and view.capacity == kv.capacity
            for i in d.occupied():
                row = kv.valid[i, :kv.filled]
                assert view.lengths[i] == (kv.filled - int(row.nonzero()[0]) if row.any() else 0)
        checked.append(len(self.decode))
        return out
    monkeypatch.setattr(Scheduler, "step", watched)
    tokens, engine = _run(checkpoints["gqa"], prefill_chunk=4)
    assert tokens == reference["gqa"]
    assert len(checked) > 10 and engine.stats.refills > 0 and engine.stats.rows_moved > 0


def test_three_row_batches_compute_their_live_rows_only(checkpoints, reference):
    """Batches of 3: a step computes 1, 2 or 3 rows as sequences finish and newcomers arrive."""
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=3, num_batches=1)
    engine, seqs, _ = open_engine(cfg, _requests())
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference["gqa"]
    assert engine.stats.rows_moved > 0 and engine.stats.slot_utilisation == 1.0


def test_host_kv_sliding_window_and_realigned_slots_stay_exact(checkpoints, reference):
    """KV on the host (newcomers adopted into host rows), a window of 6 slots, and a long
    newcomer prompt that does not fit in front of the slots so far (realigned forwards)."""
    ckpt = Checkpoint.open(str(checkpoints["window"]))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="host", expert="host")
    ckpt.close()
    tokens, engine = _run(checkpoints["window"], placement=placement)
    assert tokens == reference["window"]
    assert engine.stats.refills > 0 and engine.stats.kv_realigns > 0 and engine.stats.rows_moved > 0


def test_slots_run_out_and_are_realigned_backwards(checkpoints):
    """A long run through few rows: the caches fill up and shift back; static gives the same tokens."""
    many = [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None,
                    max_new_tokens=[6, 2, 3][i % 3]) for i in range(24)]

    def run(batching):
        cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2,
                        num_batches=1, batching=batching)
        engine, seqs, _ = open_engine(cfg, many)
        done = {s.request.id: list(s.out) for s in engine.run(seqs)}
        engine.close()
        return done, engine

    (static, _), (continuous, engine) = run("static"), run("continuous")
    assert continuous == static
    assert engine.stats.kv_realigns > 0


def test_sampled_tokens_do_not_depend_on_batching(checkpoints):
    """Each request samples from its own stream, wherever and whenever its row runs."""
    static, _ = _run(checkpoints["gqa"], batching="static", temperature=0.9, seed=3)
    continuous, _ = _run(checkpoints["gqa"], temperature=0.9, seed=3)
    assert continuous == static


def test_continuous_serves_more_of_the_decode_slots(checkpoints):
    _, static = _run(checkpoints["gqa"], batching="static")
    _, continuous = _run(checkpoints["gqa"])
    assert continuous.stats.generated_tokens == static.stats.generated_tokens
    assert continuous.stats.slot_utilisation > static.stats.slot_utilisation
    assert continuous.stats.decode_rows < static.stats.decode_rows  # fewer row-steps for the same tokens
    # no finished row is computed: live rows close ranks in front and steps take only those
    assert continuous.stats.slot_utilisation == 1.0 and continuous.stats.rows_moved > 0


def test_newcomers_prompts_are_counted_once_inside_decode_steps(checkpoints):
    """Whole prompts in one pass: the first fill prefills on its own step; every later
    prompt's real tokens (no padding) ride inside decode steps, once each."""
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2, num_batches=2)
    engine, seqs, errors = open_engine(cfg, _requests())
    queue = sorted(seqs, key=lambda s: (-s.max_new_tokens, -len(s.prompt_ids)))  # the engine's order
    list(engine.run(seqs))
    engine.close()
    newcomers = queue[cfg.batch_size * cfg.num_batches:]
    assert engine.stats.decode_prompt_tokens == sum(len(s.prompt_ids) for s in newcomers) > 0


def test_newcomers_take_the_widest_chunk_their_own_keys_allow(checkpoints, reference):
    """A newcomer's chunk is bounded by the first prefill step's activations with each batch's
    attention over its own keys: early in its prompt it takes more columns than the first
    fill's chunk, no step's reserve exceeds that limit, and tokens stay exact."""
    from planner.workingset import Step, activation_bytes, continuous_step_limit
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2, num_batches=2,
                    prefill_chunk=2)
    engine, seqs, _ = open_engine(cfg, _requests())
    charged, widths = [], []
    reserve = engine.pipeline._activation_bytes

    def spy(kvs, inputs):
        charged.append(reserve(kvs, inputs))
        widths.extend(i.ids.shape[1] for i in inputs)
        return charged[-1]
    engine.pipeline._activation_bytes = spy
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference["gqa"]
    capacity = max(len(s.prompt_ids) + s.max_new_tokens for s in seqs)
    limit = continuous_step_limit(engine.spec, 4, 2, 2, 2, capacity)
    assert max(charged) <= limit
    # sized over the window's whole context, alone in its step, a newcomer could take no more
    over_context = max(c for c in range(1, capacity) if activation_bytes(
        engine.spec, 4, Step(tokens=2 * c, sequences=2, batch=2, queries=c, keys=capacity)) <= limit)
    assert max(widths) > over_context


def test_widest_chunk_is_the_longest_that_fits():
    """Attention is one batch's at a time: a step's reserve counts its largest batch's, not
    the largest rows times the largest keys; the chunk rule takes the longest that fits."""
    from planner.shapes import ModelShape
    from planner.workingset import Step, activation_bytes, widest_chunk
    shape = ModelShape.from_config({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                                    "vocab_size": 512})
    mixed = Step.of_batches([(8, 1, 600), (8, 16, 40)])
    assert activation_bytes(shape, 4, mixed) < activation_bytes(shape, 4, Step(tokens=136, sequences=16, batch=8,
                                                                                queries=16, keys=600))
    limit = activation_bytes(shape, 4, Step.prefill(8, 2, 8, 600))
    for done in (0, 100, 400):
        c = widest_chunk(shape, 4, limit, 12, 8, 600, (8, done, 500), [(4, 1, 30)])

        def fits(chunk):
            return activation_bytes(shape, 4, Step.of_batches([(8, 1, 600), (4, 1, 600), (4, 1, 31),
                                                               (8, chunk, done + chunk)])) <= limit
        assert fits(c) and not fits(c + 1)
    assert widest_chunk(shape, 4, limit, 12, 8, 600, (8, 0, 500), []) > 8  # wider than the first fill's


def test_quarter_budget_stays_exact_and_within_budget(checkpoints, reference):
    store = TensorStore(checkpoints["gqa"])
    budget = sum(e.nbytes for e in store.entries.values()) // 4  # a quarter of the model
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", device_memory=budget,
                    batch_size=2, num_batches=2)  # the planner places the model; 4 rows for 10 prompts
    engine, seqs, _ = open_engine(cfg, _requests())
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference["gqa"]
    assert engine.memory.peak <= budget
    assert engine.stats.refills > 0


def test_adopt_and_realign_move_exactly_the_rows_slots():
    kv = BatchKV(2, 3, 1, 2, 8, torch.float32)
    for layer in range(2):
        kv.keys[layer][:5] = torch.arange(5 * 3 * 2, dtype=torch.float32).view(5, 3, 1, 2) + 100 * layer
    kv.valid[:, 1:5] = True
    kv.filled = 5
    src = BatchKV(2, 2, 1, 2, 4, torch.float32)
    for layer in range(2):
        src.keys[layer][:4] = -torch.arange(4 * 2 * 2, dtype=torch.float32).view(4, 2, 1, 2) - 1
    src.valid[1, 1:4] = True
    src.filled = 4
    before = [k.clone() for k in kv.keys]
    kv.adopt(2, src, 1, 3)  # row 2 takes src row 1's last 3 slots, ending at slot 5
    for layer in range(2):
        assert torch.equal(kv.keys[layer][2:5, 2], src.keys[layer][1:4, 1])
        assert torch.equal(kv.keys[layer][:, :2], before[layer][:, :2])  # other rows untouched
    assert kv.valid[2].tolist() == [False, False, True, True, True, False, False, False]
    assert kv.row_lengths() == [4, 4, 3]  # rows 0 and 1 hold slots 1..4, row 2 the newest 3
    kept = [k[1:5].clone() for k in kv.keys]
    kv.realign(4, 6)  # the newest 4 slots now end at slot 6
    assert kv.filled == 6
    for layer in range(2):
        assert torch.equal(kv.keys[layer][2:6], kept[layer])
    assert kv.valid[2].tolist() == [False, False, False, True, True, True, False, False]
    assert not kv.valid[:, :2].any()


def test_a_step_over_fewer_rows_touches_only_those_rows():
    """`use_rows(2)` of a 3-row host cache: the step sees 2 rows, loads and stores (and
    charges the link for) only theirs, and row 2's slots are left as they were."""
    kv = BatchKV(1, 3, 1, 2, 6, torch.float32, on_host=True)
    kv.keys[0][:3] = torch.arange(3 * 3 * 2, dtype=torch.float32).view(3, 3, 1, 2)
    kv.valid[:, :3] = True
    kv.filled = 3
    full = kv.prefix_nbytes()
    row2 = kv.keys[0][:, 2].clone()
    kv.use_rows(2)
    assert kv.prefix_nbytes() * 3 == full * 2
    valid = kv.begin_step(torch.ones(2, 1, dtype=torch.bool))
    assert valid.shape == (2, 4)
    buf = kv.load(0, "cpu")
    assert torch.equal(buf[0][:3], kv.keys[0][:3, :2])
    new = torch.full((2, 1, 1, 2), -7.0)
    keys, _ = kv.write(0, new, new, buf)
    assert keys.shape == (2, 1, 4, 2) and torch.equal(keys[:, :, :3], kv.keys[0][:3, :2].permute(1, 2, 0, 3))
    kv.store(0, buf)
    kv.end_step()
    assert torch.equal(kv.keys[0][3, :2], new[:, :, 0]) and torch.equal(kv.keys[0][:, 2], row2)
    with pytest.raises(RuntimeError, match="1 rows of input for a cache computing 2"):
        kv.begin_step(torch.ones(1, 1, dtype=torch.bool))


def test_slots_no_computed_row_holds_are_neither_loaded_nor_attended():
    """A host cache loads from the computed rows' oldest token on: the slots a finished row
    left behind cost no link bytes, and the keys a step attends are the same slots."""
    kv = BatchKV(1, 3, 1, 2, 8, torch.float32, on_host=True)
    kv.keys[0][:5] = torch.arange(5 * 3 * 2, dtype=torch.float32).view(5, 3, 1, 2)
    kv.valid[2, 0:5] = True  # a long row, finished and about to be dropped
    kv.valid[:2, 3:5] = True
    kv.filled = 5
    kv.use_rows(3)
    assert kv.begin_step(torch.ones(3, 1, dtype=torch.bool)).shape == (3, 6) and kv.prefix_nbytes() == 5 * 3 * 2 * 2 * 4
    kv.end_step()
    kv.use_rows(2)
    valid = kv.begin_step(torch.ones(2, 1, dtype=torch.bool))
    assert valid.shape == (2, 4) and valid.all()  # slots 3..5 and the new one
    assert kv.prefix_nbytes() == 3 * 2 * 2 * 2 * 4
    keys, _, offset = kv.load(0, "cpu")
    assert offset == 3 and torch.equal(keys[:3], kv.keys[0][3:6, :2])


def test_batching_flag_is_echoed_and_checked():
    from klotski.config import ConfigError
    with pytest.raises(ConfigError, match="--batching 'dynamic'"):
        RunConfig(batching="dynamic")
    assert RunConfig().to_json()["batching"] == "continuous"


@pytest.mark.parametrize("chunk,bs,n", [(4, 2, 2), (2, 3, 1), (3, 2, 3)])
def test_planner_replays_the_engines_continuous_steps(checkpoints, chunk, bs, n):
    """The planner prices a continuous job by replaying it step by step, newcomer prefills
    included (planner/occupancy.continuous_steps): over the lengths the run had, the replay
    makes exactly the engine's steps with prompt tokens and computes its decode rows."""
    from planner.occupancy import continuous_steps
    from planner.workingset import newcomer_chunks
    many = [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)], messages=None,
                    max_new_tokens=[12, 2, 3, 1, 5][i % 5]) for i in range(17)]
    # (the replay prefills whole prompts: these repeat, and shared segments would skip some)
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=bs,
                    num_batches=n, prefill_chunk=chunk, prefix_cache=False)
    engine, seqs, _ = open_engine(cfg, many)
    done = list(engine.run(seqs))
    engine.close()
    capacity = max(len(s.prompt_ids) + s.max_new_tokens for s in done)
    widest = newcomer_chunks(engine.spec, 4, bs, n, chunk, capacity)
    fills, steps, _ = continuous_steps([len(s.prompt_ids) for s in done], [len(s.out) for s in done], bs, n, widest)
    assert engine.stats.refills > 0 and len(fills) == 1
    assert engine.stats.prefill_passes == -(-max(fills[0]) // chunk) + sum(c for (_, b, _), c in steps.items() if b)
    assert engine.stats.decode_rows == sum(rows * c for (rows, _, _), c in steps.items())



@pytest.mark.parametrize("chunk,bs,n", [(4, 2, 2), (3, 2, 3)])
def test_planner_counts_the_engines_static_prefill_passes(checkpoints, chunk, bs, n):
    """Under static batching a group runs the prefill passes of its longest prompt, and a
    batch decodes until its own last row is done; the planner counts both as the engine
    runs them."""
    from planner.prediction import JobLengths
    many = [Request(id=f"r{i}", line=i + 1, prompt=PROMPTS[i % len(PROMPTS)] * (1 + i % 3), messages=None,
                    max_new_tokens=[12, 2, 3, 1, 5][i % 5]) for i in range(17)]
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=bs,
                    num_batches=n, prefill_chunk=chunk, batching="static", prefix_cache=False)
    engine, seqs, _ = open_engine(cfg, many)  # (whole prompts, as the planner counts them)
    done = list(engine.run(seqs))
    engine.close()
    out = {s.request.id: len(s.out) for s in done}  # the job's order: groups break length ties by it
    prompts = [len(s.prompt_ids) for s in seqs]
    job = JobLengths([out[s.request.id] for s in seqs], "static", prompts)
    assert engine.stats.prefill_passes == job.static_passes(n * bs, chunk)
    # and its decode steps, each computing the rows of the batches not yet done
    decode = job.static_decode(bs, n, chunk)
    assert engine.stats.decode_rows == sum(rows * steps for (_, rows), steps in decode.items())
    assert sum(decode.values()) < sum(max(len(s.out) for s in done[i:i + n * bs]) - 1 for i in range(0, 17, n * bs))
    assert job.static_passes(n * bs, chunk) > -(-len(prompts) // (n * bs)) * -(-sum(prompts) // len(prompts) // chunk)
