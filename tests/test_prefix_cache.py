"""A prompt prefix a window's lines share (klotski/schedule/prefix.py): prefilled once, every
line starts from it and prefills only its own tokens, attention reads it once per layer for
every row. Greedy fp32 tokens equal transformers' and a run without it (--no-prefix-cache),
whatever the schedule, batching, KV tier or attention site; prefill work and the KV bytes a
decode step loads fall with it."""
import pytest
import torch

from conftest import reference_tokens
from klotski.assemble import open_engine
from klotski.cli.parser import build_parser, config_from_args
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.models import layers as L
from klotski.schedule import prefix as X
from placement.placement import Placement

INSTRUCTION = ("You are a careful labeller. Read the item below and answer with one word: positive, negative or "
               "neutral. Think about the tone of the whole item before you answer. Item: ")
ITEMS = ["the film was great", "awful service and cold food", "it rained on tuesday", "Paris",
         "a long and winding road through the hills of the north", "Bees", "I would not go back there again",
         "the committee met to discuss the budget for the coming year"]
SHARED = [INSTRUCTION + item for item in ITEMS]
MAX_NEW = [6, 2, 3, 2, 5, 2, 4, 3]  # mixed: rows free up and newcomers take them


def _requests(prompts, max_new=MAX_NEW):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=m)
            for i, (p, m) in enumerate(zip(prompts, max_new))]


def _run(model_dir, prompts=SHARED, placement=None, max_new=MAX_NEW, **config):
    config = {"batch_size": 2, "num_batches": 2, **config}
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", **config)
    engine, seqs, errors = open_engine(cfg, _requests(prompts, max_new), placement=placement)
    assert not errors
    done = {s.request.id: list(s.out) for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def reference(checkpoints):
    full = reference_tokens(checkpoints["gqa"], SHARED, max_new_tokens=max(MAX_NEW))
    return [t[:m] for t, m in zip(full, MAX_NEW)]


def _host_kv(model_dir):
    ckpt = Checkpoint.open(str(model_dir))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="host", expert="host")
    ckpt.close()
    return placement


@pytest.mark.parametrize("schedule", ["klotski", "multibatch", "hot-prefetch", "simple"])
def test_shared_prefix_equals_transformers_every_schedule(checkpoints, reference, schedule):
    tokens, engine = _run(checkpoints["gqa"], schedule=schedule, prefill_chunk=16)
    assert tokens == reference
    s = engine.stats
    assert s.prefix_prefills == 1 and s.prefix_lines == len(SHARED) and s.prefix_tokens >= X.MIN_TOKENS
    assert s.refills > 0  # refilled rows started from the prefix too


def test_static_groups_prefill_the_prefix_once_and_each_line_its_own_tokens(checkpoints, reference):
    (tokens, on), (off_tokens, off) = (_run(checkpoints["gqa"], batching="static", num_batches=1, prefix_cache=c)
                                       for c in (True, False))
    assert tokens == off_tokens == reference
    P = on.stats.prefix_tokens
    assert P >= X.MIN_TOKENS and on.stats.prefix_prefills == 1
    lengths = [len(on.tokenizer(p)["input_ids"]) for p in SHARED]
    assert off.stats.prefill_tokens == sum(lengths)  # every prompt token, in 4 groups of 2
    assert on.stats.prefill_tokens == P + sum(n - P for n in lengths)
    assert on.stats.prefix_tokens_saved == P * (len(SHARED) - 1)
    assert off.stats.prefix_tokens == 0 and off.stats.prefix_prefills == 0


def test_host_kv_loads_the_prefix_once_per_layer_not_per_row(checkpoints, reference):
    placement = _host_kv(checkpoints["gqa"])
    (tokens, on), (off_tokens, off) = (_run(checkpoints["gqa"], placement=placement, batching="static",
                                            prefix_cache=c, batch_size=4, num_batches=2) for c in (True, False))
    assert tokens == off_tokens == reference
    per_step = [e.stats.decode_kv_bytes / e.stats.decode_steps for e in (on, off)]
    # 8 rows: one prefix copy instead of eight (plus each row's own ~10 slots either way)
    assert per_step[0] < per_step[1] / 3
    # the exact count of one decode step: one prefix load per layer and each batch's own slots
    spec = on.spec
    slot = spec.shape.num_kv_heads * spec.shape.head_dim * 2 * 4  # keys and values, fp32
    assert on.pipeline.kv_bytes_loaded > 0 and on.stats.prefix_tokens * slot * spec.shape.num_layers < per_step[1]


def test_host_kv_under_a_tight_budget_and_host_attention_stay_exact(checkpoints, reference):
    from placement.store import TensorStore
    store = TensorStore(checkpoints["gqa"])
    budget = sum(e.nbytes for e in store.entries.values()) // 4  # the planner offloads
    tokens, engine = _run(checkpoints["gqa"], device_memory=budget)
    assert tokens == reference and engine.memory.peak <= budget and engine.stats.prefix_prefills == 1
    tokens, engine = _run(checkpoints["gqa"], placement=_host_kv(checkpoints["gqa"]), host_attention="on")
    assert tokens == reference and engine.pipeline.host.attention.on_host > 0


def test_prefix_kv_is_charged_to_the_kv_tier_and_given_back(checkpoints):
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2, num_batches=2)
    engine, seqs, _ = open_engine(cfg, _requests(SHARED))
    before = engine.memory.used
    engine.prefixes.share(seqs)
    kv = engine.caches.segments[engine.prefixes.longest.cache].kv  # the executor's, by its handle
    charged = engine.memory.used - before
    assert charged == kv.nbytes_for(engine.spec.shape.num_layers, 1, engine.spec.shape.num_kv_heads, engine.spec.shape.head_dim,
                                    engine.prefixes.longest.length, torch.float32) > 0
    done = list(engine.run(seqs))  # the window is served by the held prefix: no second prefill
    assert len(done) == len(SHARED) and engine.stats.prefix_prefills == 1
    engine.close()
    assert engine.prefixes.longest is None and engine.memory.used == before


def test_windows_keep_the_prefix_they_share_and_compute_their_own(checkpoints):
    cfg = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2, num_batches=1)
    other = ["Answer in French. Translate the following sentence carefully and keep its meaning exactly: " + i
             for i in ITEMS[:4]]
    engine, seqs, _ = open_engine(cfg, _requests(SHARED + other, MAX_NEW + MAX_NEW[:4]))
    windows = [seqs[:4], seqs[4:8], seqs[8:]]
    out = {s.request.id: list(s.out) for w in windows for s in engine.run(w)}
    assert engine.stats.prefix_prefills == 2  # the second window reused the first's prefix
    engine.close()
    alone, _ = _run(checkpoints["gqa"], prompts=SHARED + other, max_new=MAX_NEW + MAX_NEW[:4], prefix_cache=False)
    assert [out[f"r{i}"] for i in range(12)] == alone


def test_lines_sharing_nothing_run_without_a_prefix(checkpoints):
    prompts = ["Paris", "The history of the city begins", "Quantum mechanics is a fundamental theory",
               "Mount Everest"]
    tokens, engine = _run(checkpoints["gqa"], prompts=prompts, max_new=[3] * 4)
    assert engine.stats.prefix_prefills == 0 and engine.stats.prefix_tokens == 0
    assert X.report(engine)["status"].startswith("on: no window's lines shared")
    assert tokens == [t[:3] for t in reference_tokens(checkpoints["gqa"], prompts, max_new_tokens=3)]


def test_identical_prompts_keep_their_last_token_and_stay_exact(checkpoints):
    prompts = [SHARED[4]] * 5
    tokens, engine = _run(checkpoints["gqa"], prompts=prompts, max_new=[4] * 5)
    lengths = len(engine.tokenizer(prompts[0])["input_ids"])
    assert engine.stats.prefix_tokens == lengths - 1  # each line prefills its last token itself
    assert tokens == [t[:4] for t in reference_tokens(checkpoints["gqa"], prompts, max_new_tokens=4)]


def test_attention_that_cannot_share_says_why_and_runs_whole(checkpoints):
    tokens, engine = _run(checkpoints["gqa"], attention="sink:4,window:1000", max_new=[2] * 8)
    assert engine.stats.prefix_prefills == 0 and "sink/window" in X.report(engine)["status"]
    _, engine = _run(checkpoints["window"], prompts=SHARED[:4], max_new=[2] * 4)
    assert engine.stats.prefix_prefills == 0 and "sliding-window" in X.report(engine)["status"]
    from klotski.models import deepseek_v2, gpt_oss
    assert not gpt_oss.SHARED_PREFIX and not deepseek_v2.SHARED_PREFIX


def test_no_prefix_cache_flag_is_in_the_config_and_the_report(checkpoints):
    a = build_parser().parse_args(["generate", "jobs.jsonl", "--no-prefix-cache"])
    assert config_from_args(a).prefix_cache is False
    assert config_from_args(build_parser().parse_args(["generate", "jobs.jsonl"])).prefix_cache is True
    _, engine = _run(checkpoints["gqa"], prefix_cache=False, max_new=[2] * 8)
    report = X.report(engine)
    assert report["enabled"] is False and report["status"] == "off: --no-prefix-cache"
    assert engine.config.to_json()["prefix_cache"] is False


def test_shared_attention_is_attention_over_the_concatenation():
    torch.manual_seed(0)
    B, h, kvh, T, P, S, D = 3, 4, 2, 5, 7, 6, 8
    q = torch.randn(B, h, T, D)
    pk, pv = torch.randn(kvh, P, D), torch.randn(kvh, P, D)
    k, v = torch.randn(B, kvh, S, D), torch.randn(B, kvh, S, D)
    mask = torch.rand(B, 1, T, S) > 0.3
    mask[0, :, 0] = False  # a query whose own keys are all masked still sees the prefix
    whole = L.attend(q, torch.cat([pk.expand(B, -1, -1, -1), k], 2), torch.cat([pv.expand(B, -1, -1, -1), v], 2),
                     torch.cat([torch.ones(B, 1, T, P, dtype=torch.bool), mask], -1))
    torch.testing.assert_close(L.attend_shared(q, k, v, mask, pk, pv), whole, rtol=1e-6, atol=1e-6)


def test_a_resumed_run_computes_the_prefix_again_for_the_lines_left(checkpoints, tmp_path, reference):
    import json

    from klotski import generate as run
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"

    def job(lines):
        jobs.write_text("".join(json.dumps({"id": f"r{i}", "prompt": SHARED[i], "max_new_tokens": MAX_NEW[i]}) + "\n"
                                for i in lines))

    def generate():
        report = tmp_path / "report.json"
        config = RunConfig(model=str(checkpoints["gqa"]), progress=False, dtype="float32", batch_size=2,
                           num_batches=2, include_token_ids=True, report=str(report))
        run.generate(config, jobs, str(out))
        return json.loads(report.read_text())["prefix_cache"]

    job(range(5))
    assert generate()["lines"] == 5
    job(range(8))  # the first five are done: the rerun prefills the prefix for the three left
    again = generate()
    assert again["prefix_prefills"] == 1 and again["lines"] == 3
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [got[f"r{i}"] for i in range(8)] == reference
