"""Streaming's pure part (issue 48 part 2, klotski/serve/stream.py), without a server: the
deltas of a sample join to exactly the engine's text of it; a partial UTF-8 character and text
that could still become a stop string are never sent; chunks have OpenAI's shape and their
logprobs join to the whole answer's. The engine's side is its own code: `sequences.append`
decides where a sample ends and what its text is."""
import random

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from transformers import AutoTokenizer

from klotski.builtin.tokenizer import save_tokenizer
from klotski.io.records import result_record
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL, Request
from klotski.schedule import sequences as S
from klotski.serve.stream import Chunks, TextStream, releasable

TEXT = "Zürich, naïve café: 日本語の川 😀 and the river flows to the sea."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d, 512, 1024)
    return AutoTokenizer.from_pretrained(d)


def _sequence(tok, text_or_ids, stop=(), logprobs=None, n_sample=0, url=CHAT_URL) -> tuple:
    ids = text_or_ids if isinstance(text_or_ids, list) else tok(text_or_ids, add_special_tokens=False)["input_ids"]
    req = Request(id="r", line=1, prompt=None, messages=(("user", "hi"),), stop=tuple(stop), logprobs=logprobs,
                  openai=url)
    seq = S.Sequence(req, [1, 2, 3], max_new_tokens=len(ids) + 1, temperature=0.0, top_p=1.0, stop=tuple(stop),
                     generator=None, top_logprobs=logprobs, sample=n_sample)
    return seq, ids


def _run(tok, seq, ids, on_step) -> None:
    """The engine's side, token by token: each token's logprob entry recorded, then appended
    (`sequences.append` decides the end and the text); `on_step` after each, as a listener."""
    eos = {tok.eos_token_id}
    for t in ids:
        if seq.done:
            break
        if seq.top_logprobs is not None:
            seq.logprobs.append((t, -0.25 - t / 1000, [(t, -0.25 - t / 1000), ((t + 1) % 500, -2.0)]))
        S.append(seq, t, tok, eos)
        on_step(seq)
    if not seq.done:
        seq.finish_reason, seq.text = "length", tok.decode(seq.out, skip_special_tokens=True)
        S._name_tokens(seq, tok)
        on_step(seq)


def _stream(tok, seq, ids) -> list[str]:
    """Every delta a TextStream gives, the last one from the finished sample's text."""
    stream, deltas = TextStream(tok, seq.stop), []

    def heard(s):
        delta, a, b = stream.next(list(s.out), s.text if s.done else None)
        deltas.append(delta)
    _run(tok, seq, ids, heard)
    return deltas


def test_a_character_split_across_tokens_is_never_sent_in_part(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    # the tokenizer splits some characters over several tokens (its vocabulary is small)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    seq, _ = _sequence(tok, ids)
    deltas = _stream(tok, seq, ids)
    assert "".join(deltas) == TEXT == seq.text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(bool(d) for d in deltas) > 10  # token by token, not all at the end


def test_deltas_join_to_the_engines_text_for_any_tokens(tok):
    rng = random.Random(7)
    for _ in range(30):  # any ids at all: special tokens, stray bytes of characters
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids = [t for t in ids if t != tok.eos_token_id]
        seq, _ = _sequence(tok, ids)
        assert "".join(_stream(tok, seq, ids)) == seq.text == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_split_across_tokens_never_reaches_the_client(tok):
    text = "the river flows to the sea and the sea is wide"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stop = "to the sea"
    # the stop string spans several tokens: its first ones come steps before it is whole
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    at = text.index(stop)
    assert sum(at < e < at + len(stop) for e in ends) >= 2
    seq, _ = _sequence(tok, ids, stop=[stop, "zzz"])
    deltas = _stream(tok, seq, ids)
    assert seq.finish_reason == "stop" and seq.text == "the river flows "
    assert "".join(deltas) == seq.text
    assert all(not d.strip() or d.strip() in "the river flows" for d in deltas)
    # held back text that did not become a stop string goes out once it cannot
    seq, _ = _sequence(tok, ids, stop=["to the seaside"])
    deltas = _stream(tok, seq, ids)
    assert "".join(deltas) == text and seq.finish_reason == "length"
    assert "".join(deltas[:ends.index(next(e for e in ends if e > at)) + 1]) == text[:at]


def test_releasable():
    assert releasable("abc", ()) == 3
    assert releasable("the riv", ("river",)) == 4
    assert releasable("the rivet", ("river",)) == 9
    assert releasable("xxa", ("ab", "xab")) == 1  # the earliest start of any stop string


def _chunks(tok, url, n=2, logprobs=2, usage=True):
    samples, ids = [], []
    for i in range(n):
        seq, sample_ids = _sequence(tok, ["Paris is a city of light", "the river flows"][i % 2] + " é日",
                                    logprobs=logprobs, n_sample=i, url=url)
        samples.append(seq)
        ids.append(sample_ids)
    for s in samples:
        s.samples = samples
    chunks = Chunks(samples, tok, url, "tiny", usage=usage)
    sent = list(chunks.opening())
    for seq, sample_ids in zip(samples, ids):
        _run(tok, seq, sample_ids, lambda s: sent.extend(
            chunks.progress(s.sample, len(s.out), s.finish_reason, s.text if s.done else None)))
    sent += chunks.closing()
    whole = result_record(samples, fmt="openai", model="tiny")["response"]["body"]
    return sent, whole


def test_chat_chunks_have_openais_shape_and_join_to_the_answer(tok):
    sent, whole = _chunks(tok, CHAT_URL)
    for chunk in sent:
        ChatCompletionChunk.model_validate(chunk)
    assert len({c["id"] for c in sent}) == 1 and sent[0]["object"] == "chat.completion.chunk"
    *choices, last = sent
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in choices)
    for i, answer in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in choices if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == answer["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == answer["message"]["content"]
        joined = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert joined == answer["logprobs"]["content"] and joined
        assert len([c for c in mine if c["logprobs"]]) > 3  # per chunk, not all at once


def test_text_completion_chunks_join_to_the_answer(tok):
    sent, whole = _chunks(tok, COMPLETIONS_URL, n=1, usage=False)
    assert all("usage" not in c and c["object"] == "text_completion" for c in sent)
    Completion.model_validate({**sent[-1], "choices": [{**sent[-1]["choices"][0]}]})
    answer = whole["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in sent) == answer["text"]
    assert sent[-1]["choices"][0]["finish_reason"] == answer["finish_reason"]
    parts = [c["choices"][0]["logprobs"] for c in sent if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == answer["logprobs"][key], key
