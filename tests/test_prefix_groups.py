"""Prompt segments groups of lines share (klotski/schedule/prefix.py): a job interleaving
several instructions prefills each once, nested prefixes share at each level, a prefix held
from an earlier window never stands in for a longer one. Greedy fp32 tokens equal
transformers' generate and a run with --no-prefix-cache; sampled tokens equal the run
without the cache under the same seeds."""
import pytest

from conftest import reference_tokens
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from klotski.execute import kvcache, segments
from klotski.execute.staging import StagedCopies
from klotski.execute.kvcache import BatchKV
from klotski.schedule import prefix as X
from placement.placement import Placement

RUBRICS = ["You are a careful labeller. Read the review below and answer with one word: positive, negative or "
           "neutral. Review: ",
           "Translate the following sentence into French, keeping its meaning and its tone exactly as they are. "
           "Sentence: ",
           "Classify the topic of the following news headline as sport, politics, science or business, one word "
           "only. Headline: "]
ITEMS = ["the film was great", "awful service and cold food", "it rained on tuesday", "Bees",
         "a long and winding road through the hills of the north", "the committee met to discuss the budget"]
INTERLEAVED = [RUBRICS[i % 3] + ITEMS[i // 3 % len(ITEMS)] for i in range(12)]  # rubric 0, 1, 2, 0, 1, 2, ...
MAX_NEW = [5, 2, 3, 4, 2, 6, 3, 2, 4, 5, 2, 3]
SHOTS = ["Example: 'I loved it' -> positive. Example: 'it broke after a day' -> negative. Now: ",
         "Example: 'the parcel came on monday' -> neutral. Example: 'best meal of my life' -> positive. Now: "]
NESTED = [RUBRICS[0] + SHOTS[i % 2] + ITEMS[i // 2] for i in range(8)]  # the rubric, then one of two blocks


def _requests(prompts, max_new, **sampling):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=m, **sampling)
            for i, (p, m) in enumerate(zip(prompts, max_new))]


def _run(model_dir, prompts, max_new, placement=None, windows=None, sampling=None, **config):
    config = {"batch_size": 2, "num_batches": 2, **config}
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", **config)
    engine, seqs, errors = open_engine(cfg, _requests(prompts, max_new, **(sampling or {})), placement=placement)
    assert not errors
    done = {}
    for a, b in windows or [(0, len(seqs))]:
        done.update({s.request.id: list(s.out) for s in engine.run(seqs[a:b])})
    engine.close()
    return [done[f"r{i}"] for i in range(len(prompts))], engine, seqs


def _tokens(model_dir, prompts):
    ckpt = Checkpoint.open(str(model_dir))
    ids = [ckpt.tokenizer(p)["input_ids"] for p in prompts]
    ckpt.close()
    return ids


def _shared_length(ids) -> int:
    """Tokens all of `ids` start with (each keeping one of its own): the reference, by hand."""
    n = 0
    while n < min(map(len, ids)) - 1 and len({tuple(x[:n + 1]) for x in ids}) == 1:
        n += 1
    return n


def test_segments_of_interleaved_and_nested_token_lists():
    a, b, c = list(range(100, 130)), list(range(200, 220)), list(range(300, 340))
    prompts = [a + [1], b + [2], a + [3], c + [4], b + [5], c + a + [6], a + b + [7], a + b + [8]]
    found = {(start, end): sorted(members) for start, end, members in X.find_segments(prompts)}
    # a (lines 0, 2, 6, 7), then a + b nested under it (6, 7); b (1, 4); c (3, 5)
    assert found == {(0, 30): [0, 2, 6, 7], (30, 50): [6, 7], (0, 20): [1, 4], (0, 40): [3, 5]}
    assert X.find_segments([a + [1]]) == [] and X.find_segments([a[:10] + [1], a[:10] + [2]]) == []
    # identical prompts: each keeps its last token to prefill itself
    assert X.find_segments([a, a, a]) == [(0, 29, [0, 1, 2])]


@pytest.fixture(scope="module")
def interleaved_reference(checkpoints):
    full = reference_tokens(checkpoints["gqa"], INTERLEAVED, max_new_tokens=max(MAX_NEW))
    return [t[:m] for t, m in zip(full, MAX_NEW)]


@pytest.mark.parametrize("batching, kv", [("continuous", "device"), ("static", "device"), ("continuous", "host")])
def test_interleaved_instructions_prefill_each_once_and_equal_transformers(checkpoints, interleaved_reference,
                                                                           batching, kv):
    placement = None
    if kv == "host":
        ckpt = Checkpoint.open(str(checkpoints["gqa"]))
        placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="host", expert="host")
        ckpt.close()
    on, engine, seqs = _run(checkpoints["gqa"], INTERLEAVED, MAX_NEW, placement, batching=batching)
    off, _, _ = _run(checkpoints["gqa"], INTERLEAVED, MAX_NEW, placement, batching=batching, prefix_cache=False)
    assert on == off == interleaved_reference
    ids = _tokens(checkpoints["gqa"], INTERLEAVED)
    lengths = [_shared_length(ids[r::3]) for r in range(3)]
    assert min(lengths) >= X.MIN_TOKENS
    assert [s.shared for s in seqs] == [lengths[i % 3] for i in range(12)]  # each line its own instruction's
    report = X.report(engine)
    assert report["prefix_prefills"] == 3 and report["lines"] == 12
    assert sorted((p["tokens"], p["lines"]) for p in report["prefixes"]) == sorted((n, 4) for n in lengths)
    assert report["prefill_tokens_saved"] == sum(n * 3 for n in lengths)


def test_segments_sharing_a_cache_go_up_from_contiguous_locked_memory(checkpoints, interleaved_reference,
                                                                       monkeypatch):
    """The CUDA path's segment loads on a CPU: the three instructions are prefilled together, a
    row each of one cache on the host, so each segment's slots are strided; they are gathered
    through the staging ring (small: several chunks a load) and every copy up reads contiguous
    memory (before, a strided one made a pageable copy on the way, synchronous on CUDA)."""
    init, copies, gathered = BatchKV.__init__, [], []

    def staged(self, *a, **kw):
        init(self, *a, **kw)
        self.staging = StagedCopies.on_host(1024)
    gather = StagedCopies.gather

    def counted(self, dst, src, index=None, send=None):
        gathered.append(src.is_contiguous())
        return gather(self, dst, src, index, send)

    def upload(dst, src):
        copies.append(src.is_contiguous())
        dst.copy_(src)
    monkeypatch.setattr(BatchKV, "__init__", staged)
    monkeypatch.setattr(StagedCopies, "gather", counted)
    monkeypatch.setattr(kvcache, "upload", upload)
    monkeypatch.setattr(segments, "upload", upload)  # (a segment's load: execute/segments.py)
    ckpt = Checkpoint.open(str(checkpoints["gqa"]))
    placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host")
    ckpt.close()
    out, engine, _ = _run(checkpoints["gqa"], INTERLEAVED, MAX_NEW, placement, batching="static")
    assert out == interleaved_reference and engine.stats.prefix_prefills == 3
    assert False in gathered and copies and all(copies)


def test_nested_prefixes_share_at_each_level(checkpoints):
    max_new = [3, 2, 4, 2, 3, 2, 2, 3]
    on, engine, seqs = _run(checkpoints["gqa"], NESTED, max_new)
    reference = reference_tokens(checkpoints["gqa"], NESTED, max_new_tokens=4)
    assert on == [t[:m] for t, m in zip(reference, max_new)]
    ids = _tokens(checkpoints["gqa"], NESTED)
    outer = _shared_length(ids)
    inner = [_shared_length(ids[r::2]) for r in range(2)]
    assert engine.stats.prefix_prefills == 3  # the rubric once, each few-shot block once after it
    assert all(len(s.chain) == 2 and s.chain[0].end == outer for s in seqs)
    assert [s.shared for s in seqs] == [inner[i % 2] for i in range(8)]
    parts = sorted((p["start"], p["tokens"], p["lines"]) for p in X.report(engine)["prefixes"])
    assert parts == sorted([(0, outer, 8)] + [(outer, n - outer, 4) for n in inner])


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_sampled_output_equals_the_run_without_the_cache(checkpoints, batching):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    on, engine, _ = _run(checkpoints["gqa"], INTERLEAVED, MAX_NEW, sampling=sampling, batching=batching)
    off, _, _ = _run(checkpoints["gqa"], INTERLEAVED, MAX_NEW, sampling=sampling, batching=batching,
                     prefix_cache=False)
    assert engine.stats.prefix_prefills == 3 and on == off


def test_a_prefix_held_from_an_earlier_window_never_prevents_a_longer_one(checkpoints):
    header = "System: you answer briefly and exactly, in plain words, with no preamble at all. "
    first = [header + "Say hello to " + name for name in ("Ann", "Bob", "Cy", "Dee")]  # share the header only
    second = [header + RUBRICS[0] + item for item in ITEMS[:4]]  # the header and a long rubric
    prompts, max_new = first + second, [3, 2, 2, 3, 4, 2, 3, 2]
    out, engine, seqs = _run(checkpoints["gqa"], prompts, max_new, windows=[(0, 4), (4, 8)])
    ids = _tokens(checkpoints["gqa"], prompts)
    short, long = _shared_length(ids[:4]), _shared_length(ids[4:])
    assert X.MIN_TOKENS <= short < long
    assert [s.shared for s in seqs] == [short] * 4 + [long] * 4  # the second window's own, longer prefix
    reference = reference_tokens(checkpoints["gqa"], prompts, max_new_tokens=4)
    assert out == [t[:m] for t, m in zip(reference, max_new)]
    assert not engine.prefixes.segments  # every segment given back at close


def test_a_window_keeps_the_segments_saving_most(monkeypatch):
    monkeypatch.setattr(X, "MAX_SEGMENTS", 2)
    a, b, c = list(range(100, 160)), list(range(200, 220)), list(range(300, 340))
    prompts = [a + [1], a + [2], a + [3], b + [4], b + [5], c + [6], c + [7]]  # savings 120, 20, 40
    assert sorted((s, e) for s, e, _ in X.find_segments(prompts)) == [(0, 40), (0, 60)]
    nested = [a + b + [1], a + b + [2], a + [3], c + [4], c + [5], c + [6]]  # a: 120, a + b after it: 20, c: 80
    assert sorted((s, e) for s, e, _ in X.find_segments(nested)) == [(0, 40), (0, 60)]
    monkeypatch.setattr(X, "MAX_SEGMENTS", 3)
    assert sorted((s, e) for s, e, _ in X.find_segments(nested)) == [(0, 40), (0, 60), (60, 80)]
