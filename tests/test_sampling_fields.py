"""The sampling fields a labelling or synthetic-data job sets (issue 62): greedy answers with
repetition_penalty, logit_bias and min_tokens are transformers' own generate with the matching
logits processors; the warped distributions are transformers' LogitsProcessorList on the same
logits; presence and frequency penalties are OpenAI's formula on hand-computed numbers; a seeded
row draws the same whatever shares its batch; the batched pass issues as many ops for 64 rows
as for 1; token-id prompts, lists of prompts and chat template variables."""
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import (
    LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.records import result_record
from klotski.io.requests import Request, line_fields, openai_endpoint
from klotski.measure.opcounter import OpCounter
from klotski.schedule import logits_processing as lp
from klotski.schedule.sequences import Sequence, gather, prepare

PROMPTS = ["The history of the city begins", "A river is a natural flowing watercourse", "Mount Everest"]


def _line(rid, obj) -> Request:
    return Request(id=rid, line=1, **line_fields(obj))


def _run(model, reqs, **config):
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", **config)
    engine, seqs, errors = open_engine(cfg, reqs)
    assert not errors, errors
    done = list(engine.run(seqs))
    engine.close()
    return done


def _row(logits_width=0, out=(), prompt=(1,), temperature=1.0, seed=None, **fields) -> Sequence:
    """A sequence as prepare makes one, with the sampling fields given."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence(None, list(prompt), 100, temperature, fields.pop("top_p", 1.0), (), gen, out=list(out), **fields)


# ---------------------------------------------------------------- greedy: transformers' generate


def test_greedy_with_penalty_bias_and_min_tokens_equals_transformers(checkpoints):
    model_dir = checkpoints["gqa"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    steps = 12
    cases = [dict(repetition_penalty=1.6), dict(logit_bias={"17": 6.5, "40": -100, "63": 9}),
             dict(logit_bias={str(eos[0]): 12.0}, min_tokens=5),
             dict(repetition_penalty=0.7, logit_bias={"5": 4.0, str(eos[0]): 8.0}, min_tokens=3)]

    def reference(prompt, case):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        procs = LogitsProcessorList()
        if "logit_bias" in case:  # transformers applies sequence bias first, then the penalty, then min length
            procs.append(SequenceBiasLogitsProcessor({(int(t),): float(b) for t, b in case["logit_bias"].items()}))
        if "repetition_penalty" in case:
            procs.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
        if "min_tokens" in case:
            procs.append(MinNewTokensLengthLogitsProcessor(ids.shape[1], case["min_tokens"], eos))
        with torch.no_grad():  # one prompt at a time: no pad id is ever penalised
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                 do_sample=False, logits_processor=procs, pad_token_id=eos[0])[0, ids.shape[1]:]
        row = out.tolist()
        return row[:next((i for i, t in enumerate(row) if t in eos), len(row))]

    reqs = [_line(f"{c}-{p}", {"prompt": prompt, "max_new_tokens": steps, **case})
            for c, case in enumerate(cases) for p, prompt in enumerate(PROMPTS)]
    plain = [_line(f"plain-{p}", {"prompt": prompt, "max_new_tokens": steps}) for p, prompt in enumerate(PROMPTS)]
    done = {s.request.id: s.out for s in _run(model_dir, reqs + plain, batch_size=8)}  # mixed fields in a batch
    for c, case in enumerate(cases):
        for p, prompt in enumerate(PROMPTS):
            assert done[f"{c}-{p}"] == reference(prompt, case), (case, prompt)
        # each case changes the answer of some prompt: the comparison means something
        assert any(done[f"{c}-{p}"] != done[f"plain-{p}"] for p in range(len(PROMPTS))), case
    assert all(len(done[f"2-{p}"]) >= 5 for p in range(len(PROMPTS)))  # EOS held back, then taken
    assert any(len(done[f"2-{p}"]) < steps for p in range(len(PROMPTS)))


# ---------------------------------------------------------------- warped distributions


def _logits(rows=6, width=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    x[:, :4] = x[:, :1]  # ties at the top
    return x


@pytest.mark.parametrize("fields, reference", [
    (dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    (dict(top_k=7), [TopKLogitsWarper(7)]),
    (dict(top_p=0.8), [TopPLogitsWarper(0.8)]),
    (dict(top_p=0.9), [TopPLogitsWarper(0.9)]),
    (dict(min_p=0.1), [MinPLogitsWarper(0.1)]),
    # all at once, in vLLM's order (min-p before top-k and top-p), transformers' processors so listed
    (dict(temperature=1.3, min_p=0.02, top_k=40, top_p=0.85),
     [TemperatureLogitsWarper(1.3), MinPLogitsWarper(0.02), TopKLogitsWarper(40), TopPLogitsWarper(0.85)]),
], ids=["temperature", "top_k", "top_p-0.8", "top_p-0.9", "min_p", "all-in-vllm-order"])
def test_warped_logits_equal_transformers_processors(fields, reference):
    x = _logits()
    rows = [_row(**fields) for _ in range(x.shape[0])]
    ours = lp.warp(rows, x.clone())
    theirs = LogitsProcessorList(reference)(torch.zeros(x.shape[0], 1, dtype=torch.long), x.clone())
    assert torch.equal(ours, theirs)
    assert (ours == -math.inf).any() or fields == dict(temperature=0.7)  # something was cut


def test_each_row_warps_by_its_own_fields_in_one_pass():
    """Rows with different fields in one batch: each row as transformers' processors on that row alone."""
    x = _logits(rows=4)
    fields = [dict(temperature=0.5, top_k=3), dict(top_p=0.7), dict(min_p=0.2, temperature=2.0), dict()]
    refs = [[TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)], [TopPLogitsWarper(0.7)],
            [TemperatureLogitsWarper(2.0), MinPLogitsWarper(0.2)], []]
    ours = lp.warp([_row(**f) for f in fields], x.clone())
    for i, ref in enumerate(refs):
        theirs = LogitsProcessorList(ref)(torch.zeros(1, 1, dtype=torch.long), x[i:i + 1].clone())
        assert torch.equal(ours[i:i + 1], theirs), fields[i]


def test_presence_and_frequency_penalties_are_openais_formula():
    """OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c counting the
    answer's tokens (not the prompt's); worked out by hand."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    rows = [_row(out=[1, 1, 3], prompt=[0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25),
            _row(out=[2], presence_penalty=-1.0)]
    got = lp.shape(rows, logits, eos=set())
    # row 0: token 1 twice: 2 - 2*0.5 - 0.25 = 0.75; token 3 once: 0.5 - 0.5 - 0.25 = -0.25; 0 and 2 only in the prompt
    # row 1: token 2 once, frequency 0: 0 - 0 - (-1) = 1
    assert got.tolist() == [[1.0, 0.75, -1.0, -0.25], [0.0, 0.0, 1.0, 0.0]]


def test_min_tokens_holds_back_eos_and_stop_token_ids_unless_eos_is_ignored():
    logits = torch.zeros(3, 8)
    rows = [_row(out=[1], min_tokens=2, stop_token_ids=(4,)), _row(out=[1, 2], min_tokens=2, stop_token_ids=(4,)),
            _row(out=[], min_tokens=3, ignore_eos=True)]
    got = lp.shape(rows, logits, eos={7})
    assert (got[0] == -math.inf).nonzero().flatten().tolist() == [4, 7]
    assert torch.equal(got[1], logits[1])  # reached min_tokens: nothing held
    assert torch.equal(got[2], logits[2])  # EOS is no stop for it


# ---------------------------------------------------------------- the batch: streams and op counts


def _every_field(seed, out):
    return _row(out=out, prompt=list(range(3, 40)), temperature=0.9, seed=seed, top_k=50, top_p=0.9, min_p=0.01,
                repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, logit_bias=((5, 2.0), (9, -3.0)),
                min_tokens=4, stop_token_ids=(11,))


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    width = 500
    alone, crowded = _every_field(7, [1, 2]), _every_field(7, [1, 2])
    others = [_row(temperature=1.5, seed=s, top_p=0.5, out=[3]) for s in range(5)] + [_row(temperature=0.0)]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(1, width, generator=g) * 4
        mine = lp.pick_tokens([alone], x, eos={0})[0]
        noise = torch.randn(len(others), width, generator=g) * 4
        batch = others[:3] + [crowded] + others[3:]
        theirs = lp.pick_tokens(batch, torch.cat([noise[:3], x, noise[3:]]), eos={0})[3]
        assert mine == theirs
        alone.out.append(mine)
        crowded.out.append(theirs)


def test_a_rows_candidates_are_its_own_to_the_bit_beside_wider_neighbours(monkeypatch):
    """What a seeded row draws from (its warped logits, in rank order) is bit for bit the same
    alone as beside rows ranking more candidates (a larger top_k, or top_p over the whole
    vocabulary): a pass over their width would sum its top_p mass in other places and round it
    otherwise."""
    seen = []
    real = lp.draw
    monkeypatch.setattr(lp, "draw", lambda values, ids, gens: (seen.append((values, ids)), real(values, ids, gens))[1])
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(1, 500, generator=g) * 4
        seen.clear()
        lp.pick_tokens([_every_field(7, [1, 2])], x, eos={0})
        (alone, alone_ids), = seen
        seen.clear()
        others = [_row(temperature=1.3, seed=1, top_k=400, out=[3]), _row(temperature=0.8, seed=2, top_p=0.7, out=[4])]
        noise = torch.randn(2, 500, generator=g) * 4
        lp.pick_tokens([others[0], _every_field(7, [1, 2]), others[1]], torch.cat([noise[:1], x, noise[1:]]), eos={0})
        mine = [(v, i) for v, i in seen if any(torch.equal(i[r], alone_ids[0]) for r in range(len(i)))]
        assert len(mine) == 1
        values, ids = mine[0]
        row = next(r for r in range(len(ids)) if torch.equal(ids[r], alone_ids[0]))
        assert values.shape == alone.shape and torch.equal(values[row], alone[0])


def test_the_ops_of_a_step_do_not_grow_with_rows():
    """The processing is one vectorised pass: the same ATen ops for 1 row as for 64 (every field
    set on every row); the draw adds one op per sampled row, its number from the row's own stream."""
    width = 1000

    def count(rows):
        batch = [_every_field(i, [1, 2, 3] * (i % 4 + 1)) for i in range(rows)]
        x = torch.randn(rows, width)
        with OpCounter() as processing:
            values, ids = lp.candidates(batch, lp.shape(batch, x, eos={0}))
        with OpCounter() as drawing:
            lp.draw(values, ids, [s.generator for s in batch])
        return processing.by_name, drawing.kernels

    (one, draw_one), (many, draw_many) = count(1), count(64)
    assert one == many and sum(one.values()) < 80
    assert draw_many - draw_one == 63


# ---------------------------------------------------------------- prompts: token ids, lists, templates


def test_token_id_prompts_and_lists_of_prompts(checkpoints):
    model_dir = checkpoints["gqa"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPTS[0])["input_ids"]
    url = "/v1/completions"
    reqs = [_line("text", {"prompt": PROMPTS[0], "max_new_tokens": 8}),
            _line("ids", {"prompt": ids, "max_new_tokens": 8}),
            Request(id="list", line=3, **line_fields({"custom_id": "list", "url": url, "body": {
                "prompt": [PROMPTS[0], PROMPTS[2]], "n": 2, "max_tokens": 8}})),
            Request(id="id-lists", line=4, **line_fields({"custom_id": "id-lists", "url": url, "body": {
                "prompt": [ids, tok(PROMPTS[1])["input_ids"]], "max_tokens": 8, "temperature": 1.0, "seed": 3}})),
            Request(id="too-big", line=5, **line_fields({"prompt": [1, 10 ** 6]})),
            Request(id="bias-too-big", line=6, **line_fields({"prompt": "a", "logit_bias": {"999999": 1}}))]
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", batch_size=8)
    engine, seqs, errors = open_engine(cfg, reqs)
    assert {e.id: e.message for e in errors} == {
        "too-big": "prompt has token id 1000000, outside the model's vocabulary [0, 32000)"
        .replace("32000", str(engine.spec.shape.vocab_size)),
        "bias-too-big": f"logit_bias has token id 999999, outside the model's vocabulary [0, {engine.spec.shape.vocab_size})"}
    done = list(engine.run(seqs))
    engine.close()
    by_id = {}
    for s in done:
        by_id.setdefault(s.request.id, []).append(s)
    assert by_id["ids"][0].out == by_id["text"][0].out and by_id["ids"][0].prompt_ids == ids
    answers = gather(by_id["list"][0])
    record = result_record(answers, fmt="openai", model="m")["response"]["body"]
    choices = record["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt p's j-th sample is choice p*n + j
    assert choices[0]["text"] == choices[1]["text"] == by_id["text"][0].text  # greedy: prompt 0's, twice
    assert choices[2]["text"] == choices[3]["text"] != choices[0]["text"]
    assert record["usage"]["prompt_tokens"] == len(ids) + len(tok(PROMPTS[2])["input_ids"])
    sampled = gather(by_id["id-lists"][0])
    assert [s.prompt_ids for s in sampled] == [ids, tok(PROMPTS[1])["input_ids"]]


QWEN3_STYLE = """{%- for message in messages -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{% else %}
{% endif -%}
{%- endif -%}"""


def test_chat_template_kwargs_render_as_transformers_apply_chat_template(checkpoints, tmp_path):
    path = tmp_path / "qwen3-style"
    shutil.copytree(checkpoints["gqa"], path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN3_STYLE
    tok.save_pretrained(path)
    ckpt = Checkpoint.open(str(path))
    chat = [{"role": "user", "content": "Name a river."}]
    lines = [{"custom_id": "off", "body": {"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}},
             {"custom_id": "default", "body": {"messages": chat}},
             {"custom_id": "unread", "body": {"messages": chat, "chat_template_kwargs": {"max_depth": 2}}},
             {"custom_id": "effort", "body": {"messages": chat, "reasoning_effort": "low"}}]
    reqs = [Request(id=x["custom_id"], line=i + 1, openai=openai_endpoint(x), **line_fields(x))
            for i, x in enumerate(lines)]
    seqs, errors = prepare(reqs, ckpt.tokenizer, ckpt.spec, RunConfig(model=str(path)))
    ids = {s.request.id: s.prompt_ids for s in seqs}
    theirs = AutoTokenizer.from_pretrained(path)
    assert ids["off"] == list(theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                          enable_thinking=False)["input_ids"])
    assert ids["default"] == list(theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ids["off"] != ids["default"]
    assert "<think>" in ckpt.tokenizer.decode(ids["off"]) and "<think>" not in ckpt.tokenizer.decode(ids["default"])
    assert {e.id: e.message for e in errors} == {
        "unread": "body.chat_template_kwargs.max_depth: this model's chat template does not read 'max_depth'; drop it",
        "effort": "body.reasoning_effort: this model's chat template does not read 'reasoning_effort'; drop it"}


# ---------------------------------------------------------------- ending: ignore_eos, stop ids, held stop strings


def test_ignore_eos_stop_token_ids_and_stop_strings_held_by_min_tokens(checkpoints):
    model_dir = checkpoints["gqa"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    plain = _run(model_dir, [_line("p", {"prompt": PROMPTS[1], "max_new_tokens": 10})])[0]
    first = tok.decode(plain.out[:1]).strip()
    assert first and len(plain.out) >= 6
    reqs = [_line("ignore", {"prompt": PROMPTS[1], "max_new_tokens": 6, "ignore_eos": True,
                             "logit_bias": {str(eos): 100}}),
            _line("stop-id", {"prompt": PROMPTS[1], "max_new_tokens": 10, "stop_token_ids": [plain.out[2]]}),
            _line("stop", {"prompt": PROMPTS[1], "max_new_tokens": 10, "stop": [first]}),
            _line("held", {"prompt": PROMPTS[1], "max_new_tokens": 10, "stop": [first], "min_tokens": 4})]
    done = {s.request.id: s for s in _run(model_dir, reqs, batch_size=4)}
    assert done["ignore"].out == [eos] * 6 and done["ignore"].finish_reason == "length"
    cut = plain.out.index(plain.out[2]) + 1
    assert done["stop-id"].out == plain.out[:cut] and done["stop-id"].finish_reason == "stop"
    assert done["stop"].text.strip() == "" and done["stop"].finish_reason == "stop"
    assert len(done["held"].out) >= 4 and done["held"].out[:4] == plain.out[:4]  # not cut at the first token
