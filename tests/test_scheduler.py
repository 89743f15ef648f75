"""The engine's one waiting queue (klotski/schedule/scheduler.py): sequences from another source
(online requests) join the rows a job's window is running, first, and keep the window's shared
prefix on; a source that leaves frees its rows; a request longer than the rows waits for
them to drain; a stopped source's lines go while the others carry on. Greedy fp32 tokens
equal transformers' in every case."""
import pytest

from conftest import reference_tokens
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.requests import Request
from klotski.execute import kvcache
from klotski.schedule.scheduler import ONLINE
from klotski.schedule.sequences import prepare
from placement.placement import Placement
from test_prefix_cache import MAX_NEW, SHARED

OTHERS = ["The capital of France is", "Once upon a time there", "Numbers: one two three"]
OTHER_NEW = [5, 7, 4]


def _requests(prompts, max_new, tag):
    return [Request(id=f"{tag}{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=m)
            for i, (p, m) in enumerate(zip(prompts, max_new))]


@pytest.fixture(scope="module")
def references(checkpoints):
    model = checkpoints["gqa"]
    window = reference_tokens(model, SHARED, max_new_tokens=max(MAX_NEW))
    others = reference_tokens(model, OTHERS, max_new_tokens=max(OTHER_NEW))
    return [t[:m] for t, m in zip(window, MAX_NEW)], [t[:m] for t, m in zip(others, OTHER_NEW)]


def _engine(model_dir, placement=None, **config):
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32",
                    **{"batch_size": 2, "num_batches": 2, **config})
    engine, seqs, errors = open_engine(cfg, _requests(SHARED, MAX_NEW, "w"), placement=placement)
    assert not errors
    return engine, seqs


def _online(engine, prompts=OTHERS, max_new=OTHER_NEW):
    seqs, errors = prepare(_requests(prompts, max_new, "o"), engine.tokenizer, engine.spec, engine.config)
    assert not errors
    heard = []
    for s in seqs:
        s.listener = lambda s: heard.append((s, len(s.out), s.done))
    return seqs, heard


@pytest.fixture
def mixed_rows(monkeypatch):
    """Counts the steps whose batch mixed rows that read the shared prefix with rows that do not."""
    seen = []
    original = kvcache.BatchKV.prefix_mask

    def spy(self):
        mask = original(self)
        seen.append(mask is not None and bool(mask.any()))  # some rows read it, some do not
        return mask
    monkeypatch.setattr(kvcache.BatchKV, "prefix_mask", spy)
    return seen


@pytest.mark.parametrize("kv,batching", [("device", "continuous"), ("host", "continuous"), ("device", "static")])
def test_online_requests_join_a_windows_rows_beside_its_shared_prefix(checkpoints, references, mixed_rows, kv,
                                                                      batching):
    """Continuous: they decode in a batch of their own beside the window's; static: they join
    the window's groups, in batches that mix rows reading the prefix with rows that do not."""
    placement = None
    if kv == "host":
        from klotski.io.checkpoint import Checkpoint
        ckpt = Checkpoint.open(str(checkpoints["gqa"]))
        placement = Placement.by_kind(ckpt.spec.group_keys(), kv="host", attn="host", expert="host")
        ckpt.close()
    # (static: batches of 3 put an online request beside two of the window's 8 lines)
    engine, seqs = _engine(checkpoints["gqa"], placement, batching=batching, batch_size=3 if batching == "static" else 2)
    online, heard = _online(engine)
    window = {}
    if batching == "static":  # (a static run takes in what waits at its start)
        engine.add_request(online, ONLINE)
    for s in engine.run(seqs):
        window[s.request.id] = list(s.out)
        if len(window) == 1 and batching == "continuous":  # the window is running: they arrive now
            engine.add_request(online[:2], ONLINE)
            engine.add_request(online[2:], ONLINE)
    list(engine.run([]))  # (those still running when the window ended)
    engine.close()
    expected_window, expected_online = references
    assert [window[f"w{i}"] for i in range(len(SHARED))] == expected_window
    assert [s.out for s in online] == expected_online
    assert all(s.finish_reason in ("stop", "length") for s in online)
    # each listener heard every token as it came, and the end once
    for s in online:
        counts = [n for x, n, _ in heard if x is s]
        assert counts[:len(s.out)] == list(range(1, len(s.out) + 1)) and counts[-1] == len(s.out)
        assert sum(1 for x, _, done in heard if x is s and done) == 1
    stats = engine.stats
    assert stats.prefix_prefills == 1 and stats.prefix_lines == len(SHARED)  # the window kept its prefix
    assert all(s.shared == 0 for s in online) and all(s.shared == stats.prefix_tokens for s in seqs)
    if batching == "static":
        assert any(mixed_rows)  # some step ran prefix rows and online rows in one batch
    else:
        assert engine.waiting.online_stats().joined == len(OTHERS)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_source_that_leaves_frees_its_rows(checkpoints, references, batching):
    """Continuous: its row frees at the next step. Static: it ends at the next step (its row
    computes on to the batch's end, unread)."""
    engine, seqs = _engine(checkpoints["gqa"], batching=batching)
    online, _ = _online(engine, ["The capital of France is", "Once upon a time there"], [200, 200])
    online[0].listener = lambda s: setattr(s, "leaving", len(s.out) >= 3)  # hangs up after 3 tokens
    online[1].leaving = True  # hangs up before it is admitted
    engine.add_request(online, ONLINE)
    window = {s.request.id: list(s.out) for s in engine.run(seqs)}
    list(engine.run([]))  # (static: the online requests, shorter, may wait for a group after the window's)
    engine.close()
    assert [window[f"w{i}"] for i in range(len(SHARED))] == references[0]
    assert online[0].finish_reason == "abort" and 3 <= len(online[0].out) <= 4
    assert online[1].finish_reason == "abort" and online[1].out == []
    assert engine.scheduler is None  # nothing left running: every cache went back


def test_a_request_longer_than_the_rows_waits_for_them_and_then_runs(checkpoints, references):
    engine, seqs = _engine(checkpoints["gqa"])
    online, _ = _online(engine, OTHERS[:1], [60])  # longer than any row of the window
    window = {}
    for s in engine.run(seqs):
        window[s.request.id] = list(s.out)
        if len(window) == 1:
            engine.add_request(online, ONLINE)
            assert not engine.scheduler.fits(online[0])
    assert not online[0].done  # the window's rows drained first; it waits for the next run
    list(engine.run([]))
    engine.close()
    assert [window[f"w{i}"] for i in range(len(SHARED))] == references[0]
    assert online[0].out == reference_tokens(checkpoints["gqa"], OTHERS[:1], max_new_tokens=60)[0]


class Stop(KeyboardInterrupt):
    pass


def test_a_stopped_source_withdraws_its_lines_and_the_others_carry_on(checkpoints, references):
    engine, seqs = _engine(checkpoints["gqa"])
    online, _ = _online(engine)
    engine.add_request(online, ONLINE)
    steps = []

    def check():
        steps.append(1)
        if len(steps) > 3:
            raise Stop()
    finished = []
    with pytest.raises(Stop):
        for s in engine.run(seqs, check=check):
            finished.append(s)
    assert len(finished) < len(seqs)
    list(engine.run([]))  # the online requests run on
    engine.close()
    assert [s.out for s in online] == references[1]
    # its lines ended where they were: finished, left their rows, or never admitted
    assert all(s.finish_reason in ("abort", "stop", "length") or (s.finish_reason is None and not s.out)
               for s in seqs)
    assert engine.scheduler is None and not engine.waiting.pending()


def test_online_requests_that_arrive_together_share_their_instruction(checkpoints, references):
    """Online requests form and share segments as a window's lines do: eight requests with one
    long instruction, added together while nothing runs, prefill it once."""
    engine, _ = _engine(checkpoints["gqa"])
    online, heard = _online(engine, SHARED, MAX_NEW)
    for s in online:  # one request each, as the server's threads add them
        engine.add_request([s], ONLINE)
    list(engine.run([]))
    engine.close()
    assert [s.out for s in online] == references[0]
    stats = engine.stats
    assert stats.prefix_prefills == 1 and stats.prefix_lines == len(SHARED)
    assert all(s.shared == stats.prefix_tokens > 0 for s in online)
