"""Log-probabilities and n samples per line: the numbers are transformers' fp32 log-softmax,
the samples are reproducible whatever the batching and n, and a line of n samples is written
in one record (OpenAI's choices[i], klotski's choices list, a Parquet column), whole or not at all."""
import json

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from conftest import PROMPTS
from klotski import generate as run
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.output import OutputWriter
from klotski.io.records import record_key
from klotski.io.requests import Request

TOP = 5


def _requests(**fields):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=8, **fields)
            for i, p in enumerate(PROMPTS)]


def _run(model, reqs, **config):
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", **config)
    engine, seqs, errors = open_engine(cfg, reqs)
    assert not errors
    done = list(engine.run(seqs))
    engine.close()
    return done


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' fp32 model, and its log-softmax at every position of prompt + answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gqa"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoints["gqa"])

    def logprobs(prompt: str, out: list[int]) -> torch.Tensor:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + out])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[len(ids) - 1:len(ids) - 1 + len(out)]
    return logprobs


@pytest.mark.parametrize("config", [dict(batch_size=2, num_batches=2),  # continuous: newcomers join rows
                                    dict(batch_size=2, num_batches=2, batching="static"),
                                    dict(batch_size=6)], ids=["continuous", "static", "one-batch"])
def test_logprobs_are_transformers_log_softmax_and_its_top_tokens(checkpoints, reference, config):
    done = _run(checkpoints["gqa"], _requests(logprobs=TOP), **config)
    assert len(done) == len(PROMPTS)
    for s in done:
        assert len(s.logprobs) == len(s.out) > 0
        ref = reference(s.request.prompt, s.out)
        for j, (token, lp, alts) in enumerate(s.logprobs):
            assert token == s.out[j]
            assert lp == pytest.approx(ref[j, token].item(), abs=1e-4)
            values, ids = ref[j].topk(TOP)
            assert [a for a, _ in alts] == ids.tolist()  # the same tokens in the same order
            assert [v for _, v in alts] == pytest.approx(values.tolist(), abs=1e-4)
            assert alts[0][0] == token  # greedy: the pick is the most likely
        assert set(s.pieces) >= {t for t, _, alts in s.logprobs for t in (t, *(a for a, _ in alts))}


SAMPLED = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.6, top_p=1.0), dict(temperature=1.3, top_p=0.5)]


def _reference_masks(tok, model, constraint, out):
    """An llguidance matcher of its own fed the answer token by token: the allowed set at
    each position (None: the line is not constrained), computed without the engine's code."""
    import llguidance
    import llguidance.hf
    import numpy as np
    if constraint is None:
        return [None] * len(out)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size,
                                         eos_token=model.generation_config.eos_token_id)
    kind, text = constraint
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from(kind, text))
    masks = []
    for token in out:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        masks.append(torch.from_numpy(np.unpackbits(bits, bitorder="little")[:model.config.vocab_size].astype(bool)))
        assert matcher.consume_token(token)
    return masks


@pytest.mark.parametrize("sampling", SAMPLED, ids=[f"t{c['temperature']}-p{c['top_p']}" for c in SAMPLED])
def test_sampled_logprobs_are_the_models_distribution_renormalised_under_the_mask(checkpoints, sampling):
    """The contract (jobs/README.md): a token's logprob is the fp32 log-softmax of the model's
    logits, after a grammar mask (renormalised over the tokens it allows), before temperature and
    top_p, whatever the sampling. The reference is transformers' forward over prompt + answer
    with a grammar mask from llguidance's own matcher: a logprob taken after temperature, or not
    renormalised under the mask, fails here (a greedy run cannot tell them apart: its pick is
    the top token either way, and temperature 1 leaves the distribution as it is)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    regex = ("regex", r"[a-z]+( [a-z]+){2,5}")
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=8, logprobs=TOP, seed=5,
                    constraint=("guided_regex", *regex) if i % 2 else None) for i, p in enumerate(PROMPTS)]
    done = _run(checkpoints["gqa"], reqs, batch_size=3, **sampling)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gqa"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoints["gqa"])
    not_top = 0
    for s in done:
        assert len(s.logprobs) == len(s.out) > 0 and s.error is None
        ids = tok(s.request.prompt)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + s.out])).logits[0, len(ids) - 1:len(ids) - 1 + len(s.out)]
        masks = _reference_masks(tok, model, regex if s.request.constraint else None, s.out)
        for j, ((token, lp, alts), allowed) in enumerate(zip(s.logprobs, masks)):
            row = logits[j].float() if allowed is None else logits[j].float().masked_fill(~allowed, float("-inf"))
            ref = torch.log_softmax(row, dim=-1)
            assert token == s.out[j] and lp == pytest.approx(ref[token].item(), abs=1e-4), (s.request.id, j)
            values, top = ref.topk(TOP)
            keep = [k for k, v in enumerate(values.tolist()) if v > float("-inf")]
            assert [a for a, _ in alts] == [top[k].item() for k in keep]
            assert [v for _, v in alts] == pytest.approx([values[k].item() for k in keep], abs=1e-4)
            not_top += token != top[0].item()
    assert not_top >= 3  # sampling really picked tokens other than the top one
    assert sum(s.request.constraint is not None for s in done) >= 2


def test_only_the_rows_that_ask_get_logprobs_and_a_run_without_does_no_work(checkpoints, monkeypatch):
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=6,
                    logprobs=(2 if i % 2 else None)) for i, p in enumerate(PROMPTS)]
    done = {s.request.id: s for s in _run(checkpoints["gqa"], reqs, batch_size=3)}
    for i in range(len(PROMPTS)):
        s = done[f"r{i}"]
        assert (len(s.logprobs), s.top_logprobs) == ((len(s.out), 2) if i % 2 else (0, None))
        assert all(len(alts) == 2 for _, _, alts in s.logprobs)
    calls = []
    real = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run(checkpoints["gqa"], _requests(), batch_size=3)
    assert calls == []


def test_sample_i_is_the_same_whatever_n_and_the_batching(checkpoints):
    sampled = dict(temperature=1.0, top_p=0.95)
    one = {s.request.id: s.out for s in _run(checkpoints["gqa"], _requests(seed=11), batch_size=6, **sampled)}
    three = _run(checkpoints["gqa"], _requests(seed=11, n=3), batch_size=6, **sampled)
    again = _run(checkpoints["gqa"], _requests(seed=11, n=3), batch_size=2, num_batches=2, **sampled)
    two = _run(checkpoints["gqa"], _requests(seed=11, n=2), batch_size=4, **sampled)
    by = lambda done: {(s.request.id, s.sample): s.out for s in done}  # noqa: E731
    assert len(three) == 3 * len(PROMPTS)
    assert by(three) == by(again)                                     # independent of the batching
    assert {k: v for k, v in by(three).items() if k[1] < 2} == by(two)  # ... and of n
    assert {rid: out for (rid, i), out in by(three).items() if i == 0} == one  # sample 0 is the n=1 answer
    assert sum(by(three)[(f"r{i}", 1)] != by(three)[(f"r{i}", 2)] for i in range(len(PROMPTS))) >= 4
    other = _run(checkpoints["gqa"], _requests(seed=12, n=3), batch_size=6, **sampled)
    assert by(other) != by(three)
    greedy = _run(checkpoints["gqa"], _requests(n=2), batch_size=6)  # temperature 0: n copies, as OpenAI's
    assert all(by(greedy)[(f"r{i}", 0)] == by(greedy)[(f"r{i}", 1)] for i in range(len(PROMPTS)))


# ---------------------------------------------------------------- the records


def _job(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def _batch_line(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_shapes_the_openai_types_accept(checkpoints, tmp_path):
    chat = [{"role": "user", "content": "Tell me about Paris"}]
    job = _job(tmp_path / "j.jsonl", [
        _batch_line("chat", "/v1/chat/completions", messages=chat, max_tokens=5, logprobs=True, top_logprobs=3,
                    n=2, temperature=1.0, seed=3),
        _batch_line("chat0", "/v1/chat/completions", messages=chat, max_tokens=5, logprobs=True),
        _batch_line("text", "/v1/completions", prompt="The river", max_tokens=5, logprobs=2, n=3, temperature=1.0),
        _batch_line("plain", "/v1/completions", prompt="The river", max_tokens=5)])
    out = tmp_path / "out.jsonl"
    run.generate(RunConfig(model=str(checkpoints["gqa"]), progress=False), job, str(out))
    records = {record_key(r): r for r in _records(out)}
    assert set(records) == {"chat", "chat0", "text", "plain"}
    body = ChatCompletion.model_validate(records["chat"]["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1]
    assert body.usage.completion_tokens == sum(len(c.logprobs.content) for c in body.choices)
    for c in body.choices:
        assert len(c.logprobs.content) >= 1
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes
            assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert "".join(t.token for t in c.logprobs.content).startswith(c.message.content)
        # a token's bytes are its own (byte-level BPE's pieces mapped back), and add up to the answer
        data = bytes(b for t in c.logprobs.content for b in t.bytes).decode("utf-8", "replace")
        assert data.startswith(c.message.content)
    body = ChatCompletion.model_validate(records["chat0"]["response"]["body"])
    assert all(t.top_logprobs == [] for t in body.choices[0].logprobs.content)
    body = Completion.model_validate(records["text"]["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1, 2]
    for c in body.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
        assert all(len(alts) <= 2 for alts in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(c.text)
    body = Completion.model_validate(records["plain"]["response"]["body"])
    assert body.choices[0].logprobs is None and len(body.choices) == 1


def test_flat_and_parquet_records(checkpoints, tmp_path):
    import pyarrow.parquet as pq
    job = _job(tmp_path / "j.jsonl", [
        {"id": "one", "prompt": "The river", "logprobs": 2, "max_tokens": 4},
        {"id": "many", "prompt": "The river", "n": 3, "temperature": 1.0, "logprobs": True, "top_logprobs": 1,
         "max_tokens": 4},
        {"id": "none", "prompt": "The river", "max_tokens": 4}])
    out = tmp_path / "out.jsonl"
    config = RunConfig(model=str(checkpoints["gqa"]), progress=False, include_token_ids=True)
    run.generate(config, job, str(out))
    rec = {r["id"]: r for r in _records(out)}
    one = rec["one"]
    assert list(one)[:5] == ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert len(one["logprobs"]) == one["completion_tokens"] == len(one["token_ids"])
    assert all(set(x) == {"token", "logprob", "top_logprobs"} and len(x["top_logprobs"]) == 2 for x in one["logprobs"])
    many = rec["many"]
    assert list(many) == ["id", "choices", "prompt_tokens", "completion_tokens"]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["completion_tokens"] == sum(c["completion_tokens"] for c in many["choices"])
    for c in many["choices"]:
        assert set(c) == {"index", "completion", "finish_reason", "completion_tokens", "token_ids", "logprobs"}
        assert len(c["logprobs"]) == c["completion_tokens"]
    assert "logprobs" not in rec["none"] and "choices" not in rec["none"]

    pout = tmp_path / "out.parquet"
    run.generate(config, job, str(pout))
    rows = {r["id"]: r for r in pq.read_table(pout).to_pylist()}
    assert rows["one"]["logprobs"] == one["logprobs"] and rows["one"]["completion"] == one["completion"]
    assert rows["many"]["completion"] is None
    assert [c["completion"] for c in rows["many"]["choices"]] == [c["completion"] for c in many["choices"]]
    assert rows["none"]["choices"] is None and rows["none"]["error"] is None


class Stop(BaseException):
    pass


def test_a_run_stopped_midway_never_leaves_a_partial_line_of_n(checkpoints, tmp_path, monkeypatch):
    lines = [{"id": f"q{i}", "prompt": f"the river {i} flows past the mill", "n": 3, "temperature": 1.0,
              "max_tokens": 2 + i % 3} for i in range(8)]
    job = _job(tmp_path / "j.jsonl", lines)
    config = RunConfig(model=str(checkpoints["gqa"]), progress=False, batch_size=2, num_batches=2, window=4)
    full = tmp_path / "full.jsonl"
    run.generate(config, job, str(full))
    expected = {r["id"]: r for r in _records(full)}
    assert len(expected) == 8 and all(len(r["choices"]) == 3 for r in expected.values())

    out, real, count = tmp_path / "out.jsonl", OutputWriter.write, {"n": 0}

    def write(self, record):
        count["n"] += 1
        if count["n"] > 3:
            raise Stop
        return real(self, record)
    monkeypatch.setattr(OutputWriter, "write", write)
    with pytest.raises(Stop):
        run.generate(config, job, str(out))
    monkeypatch.setattr(OutputWriter, "write", real)
    partial = _records(out)
    assert 0 < len(partial) < 8 and all(r == expected[r["id"]] for r in partial)  # whole lines only
    run.generate(config, job, str(out))
    got = _records(out)
    assert len(got) == 8 and {r["id"]: r for r in got} == expected  # each line once, the same samples


def test_a_token_holding_part_of_a_character_keeps_its_own_bytes(checkpoints):
    from transformers import AutoTokenizer
    from klotski.schedule.logprobs import pieces
    tok = AutoTokenizer.from_pretrained(checkpoints["gqa"])
    lead = tok.convert_tokens_to_ids("Ã")  # byte-level BPE's piece for the byte 0xC3 ("é" starts with it)
    space = tok.convert_tokens_to_ids("Ġ")  # ... and for " "
    got = pieces(tok, [lead, space, lead])
    assert got == {lead: ("\ufffd", [0xC3]), space: (" ", [0x20])}


def test_show_prints_the_first_sample_of_a_line_of_n(tmp_path, capsys):
    from klotski.cli import main as cli
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "many", "choices": [{"index": 0, "completion": "first answer"},
                                                         {"index": 1, "completion": "second"}],
                               "prompt_tokens": 3, "completion_tokens": 4}) + "\n")
    assert cli.main(["show", str(out)]) == 0
    assert "first answer" in capsys.readouterr().out
