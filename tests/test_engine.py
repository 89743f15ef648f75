"""Sampling, stop conditions and chat rendering of the engine."""
from conftest import PROMPTS, requests
from klotski.config import RunConfig
from klotski.assemble import open_engine
from klotski.io.requests import Request


def _run(path, reqs, **config):
    engine, seqs, errors = open_engine(RunConfig(model=str(path), progress=False, **config), reqs)
    done = {s.request.id: s for s in engine.run(seqs)}
    engine.close()
    return done, errors, engine


def test_sampling_is_deterministic_per_seed_and_independent_of_batching(checkpoints):
    reqs = requests(max_new_tokens=12)
    a, _, _ = _run(checkpoints["gqa"], reqs, temperature=1.0, top_p=0.9, seed=7, batch_size=6)
    b, _, _ = _run(checkpoints["gqa"], reqs, temperature=1.0, top_p=0.9, seed=7, batch_size=2, num_batches=3)
    c, _, _ = _run(checkpoints["gqa"], reqs, temperature=1.0, top_p=0.9, seed=8, batch_size=6)
    greedy, _, _ = _run(checkpoints["gqa"], reqs, batch_size=6)
    assert {k: s.out for k, s in a.items()} == {k: s.out for k, s in b.items()}
    assert {k: s.out for k, s in a.items()} != {k: s.out for k, s in c.items()}
    assert {k: s.out for k, s in a.items()} != {k: s.out for k, s in greedy.items()}


def test_max_new_tokens_and_stop_strings(checkpoints):
    base, _, engine = _run(checkpoints["gqa"], requests(max_new_tokens=12))
    long = next(s for s in base.values() if s.finish_reason == "length" and len(s.text) > 4)
    assert len(long.out) == 12
    stop = long.text[2:4]
    req = Request(id="s", line=1, prompt=long.request.prompt, messages=None, max_new_tokens=12, stop=(stop,))
    got, _, _ = _run(checkpoints["gqa"], [req])
    s = got["s"]
    assert s.finish_reason == "stop" and stop not in s.text and long.text.startswith(s.text)
    assert s.text == long.text[: long.text.find(stop)]


def test_chat_messages_use_the_tokenizer_template(checkpoints):
    messages = (("user", "Tell me about Paris"),)
    req = Request(id="c", line=1, prompt=None, messages=messages, max_new_tokens=4)
    got, errors, engine = _run(checkpoints["gqa"], [req])
    assert not errors
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about Paris"}],
                                                    add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert got["c"].prompt_ids == list(rendered)
    assert len(got["c"].prompt_ids) > len(engine.tokenizer("Tell me about Paris")["input_ids"])


def test_prompt_longer_than_context_is_a_line_error(checkpoints):
    req = Request(id="big", line=3, prompt="word " * 5000, messages=None)
    got, errors, _ = _run(checkpoints["gqa"], [req] + requests(PROMPTS[:1]))
    assert [e.id for e in errors] == ["big"] and "context" in errors[0].message
    assert list(got) == ["r0"]


def test_batches_with_different_lengths_in_one_group(checkpoints):
    """A batch that finishes early leaves the group; the others go on (no cache overflow)."""
    from conftest import reference_tokens
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=3 if i % 2 else 12)
            for i, p in enumerate(PROMPTS)]
    got, _, _ = _run(checkpoints["gqa"], reqs, batch_size=1, num_batches=6, dtype="float32")
    ref = reference_tokens(checkpoints["gqa"], max_new_tokens=12)
    for i, r in enumerate(reqs):
        assert got[r.id].out == ref[i][: r.max_new_tokens]


def test_decode_slot_utilisation_counts_slots_of_finished_sequences_as_waste(checkpoints):
    """Two sequences in one static batch, limits 1 and 8: after the prefill gives each its first
    token, seven decode steps compute both slots for the one sequence still generating."""
    reqs = [Request(id="short", line=1, prompt=PROMPTS[0], messages=None, max_new_tokens=1),
            Request(id="long", line=2, prompt=PROMPTS[1], messages=None, max_new_tokens=8)]
    engine, seqs, _ = open_engine(RunConfig(model=str(checkpoints["gqa"]), batch_size=2, num_batches=1, batching="static",
                                            progress=False), reqs)
    done = {s.request.id: s for s in engine.run(seqs)}
    engine.close()
    long = done["long"]
    steps = len(long.out) - 1 + (long.finish_reason == "stop")  # decode steps the long one needed
    assert steps >= 1
    assert (engine.stats.decode_rows, engine.stats.decode_useful_rows) == (2 * steps, steps)
    assert engine.stats.slot_utilisation == 0.5


def test_continuous_batching_computes_live_rows_and_reports_idle_ones_as_occupancy(checkpoints):
    """The same two sequences under continuous batching: the short one's row is not computed
    once it is done (utilisation 1), and the group's idle row shows as occupancy 1/2."""
    reqs = [Request(id="short", line=1, prompt=PROMPTS[0], messages=None, max_new_tokens=1),
            Request(id="long", line=2, prompt=PROMPTS[1], messages=None, max_new_tokens=8)]
    engine, seqs, _ = open_engine(RunConfig(model=str(checkpoints["gqa"]), batch_size=2, num_batches=1,
                                            progress=False), reqs)
    done = {s.request.id: s for s in engine.run(seqs)}
    engine.close()
    long = done["long"]
    steps = len(long.out) - 1 + (long.finish_reason == "stop")
    assert (engine.stats.decode_rows, engine.stats.decode_useful_rows, engine.stats.decode_slots) == \
        (steps, steps, 2 * steps)
    assert engine.stats.slot_utilisation == 1.0 and engine.stats.occupancy == 0.5
