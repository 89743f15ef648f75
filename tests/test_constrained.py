"""Constrained answers (issue 38): a line's response_format / structured_outputs / guided_*
field holds its answer to a choice, a JSON schema, a regex or a grammar; greedy answers are
token-identical to transformers' generate with an llguidance logits processor; a grammar
llguidance rejects is that line's error record and the other lines complete."""
import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from conftest import PROMPTS
from klotski.cli import main as cli
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.jobs import read_jobs
from klotski.io.records import is_error, record_key
from klotski.schedule import constrain
from klotski.measure.opcounter import OpCounter

CHOICES = ["positive", "negative", "neutral", "not sure at all"]
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["label", "score", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"


def write_jobs(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def constrained_lines(prompts=PROMPTS, max_tokens=48):
    """Each prompt three ways (a choice, a schema, a regex), in the field shapes people write."""
    shapes = [
        lambda p: {"prompt": p, "structured_outputs": {"choice": CHOICES}},
        lambda p: {"prompt": p, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": SCHEMA}}},
        lambda p: {"prompt": p, "guided_regex": REGEX},
    ]
    return [{"id": f"{k}-{i}", "max_tokens": max_tokens, **shape(p)}
            for i, p in enumerate(prompts) for k, shape in enumerate(shapes)]


def check_answer(kind: str, text: str, finish: str) -> None:
    if finish == "length":
        return  # cut off: no promise about a whole answer
    assert finish == "stop"
    if kind == "0":
        assert text in CHOICES
    elif kind == "1":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX, text)


@pytest.mark.parametrize("batching, temperature", [("continuous", 0.0), ("static", 1.0), ("continuous", 1.5)])
def test_every_answer_obeys_its_constraint(checkpoints, tmp_path, batching, temperature):
    """Random weights pull anywhere; the grammar still decides. Continuous batching with 2
    rows of 3 batches moves rows between steps (their masks are gathered); sampling at high
    temperature tries the tails; unconstrained lines in the same batches run as before."""
    lines = constrained_lines() + [{"id": "free", "prompt": PROMPTS[0], "max_tokens": 5}]
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", lines))
    assert errors == []
    config = RunConfig(model=str(checkpoints["gqa"]), batching=batching, temperature=temperature,
                       batch_size=2, num_batches=3)
    engine, seqs, errors = open_engine(config, requests)
    try:
        done = {s.request.id: s for s in engine.run(seqs)}
    finally:
        engine.close()
    assert errors == [] and len(done) == len(lines)
    assert done["free"].finish_reason == "length" and done["free"].grammar is None
    stopped = 0
    for rid, s in done.items():
        if rid != "free":
            assert s.error is None
            check_answer(rid.split("-")[0], s.text, s.finish_reason)
            stopped += s.finish_reason == "stop"
    assert stopped >= len(lines) - 3  # the choices and regexes always end; most schemas too


class LLGuidanceProcessor(LogitsProcessor):
    """The reference: llguidance's matcher driving transformers' generate (batch of one)."""

    def __init__(self, matcher, lltok, prompt_len):
        self.matcher, self.lltok, self.prompt_len, self.fed = matcher, lltok, prompt_len, 0

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len:].tolist()
        assert self.matcher.consume_tokens(new[self.fed:])
        self.fed = len(new)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:scores.shape[-1]].astype(bool))
        return scores.masked_fill(~allowed, float("-inf"))


def test_greedy_choices_match_transformers_with_llguidance_processor(checkpoints, tmp_path):
    model_dir = checkpoints["gqa"]
    choices = ["The river", "Paris is a city", "A quantum theory of nature", "maybe", "no"]
    lines = [{"id": f"r{i}", "prompt": p, "guided_choice": choices, "max_tokens": 16} for i, p in enumerate(PROMPTS)]
    requests, _ = read_jobs(write_jobs(tmp_path / "j.jsonl", lines))
    engine, seqs, errors = open_engine(RunConfig(model=str(model_dir), batch_size=3, num_batches=2), requests)
    try:
        ours = {s.request.id: s.out for s in engine.run(seqs)}
    finally:
        engine.close()
    # a complete answer ends its sequence at once: no step is spent picking the EOS after it
    assert engine.stats.generated_tokens == sum(map(len, ours.values()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=eos)
    grammar = llguidance.grammar_from("choice", choices)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        processor = LLGuidanceProcessor(llguidance.LLMatcher(lltok, grammar), lltok, ids.shape[1])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, pad_token_id=eos,
                                 logits_processor=LogitsProcessorList([processor]))
        theirs = [t for t in out[0, ids.shape[1]:].tolist() if t != eos]
        assert ours[f"r{i}"] == theirs, prompt
        assert tok.decode(theirs) in choices


def test_bad_constraint_is_that_lines_error_record(checkpoints, tmp_path, capsys):
    """A schema, regex or grammar llguidance rejects: one line naming the field; the rest run."""
    lines = [
        {"id": "good", "prompt": "The river", "guided_choice": ["yes", "no"]},
        {"id": "schema", "prompt": "Paris", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
        {"id": "type", "prompt": "Paris", "structured_outputs": {"json": {"type": "nonsense"}}},
        {"id": "regex", "prompt": "Paris", "guided_regex": "[a-"},
        {"id": "grammar", "prompt": "Paris", "structured_outputs": {"grammar": "start: undefined_rule"}},
        {"id": "plain", "prompt": "Mount Everest"},
    ]
    jobs, out = write_jobs(tmp_path / "j.jsonl", lines), tmp_path / "out.jsonl"
    rc = cli.main(["generate", str(jobs), "--model", str(checkpoints["gqa"]), "-o", str(out), "--max-new-tokens",
                   "4", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    records = {record_key(r): r for r in map(json.loads, out.read_text().splitlines())}
    assert records["good"]["completion"] in ("yes", "no") and records["plain"]["finish_reason"] == "length"
    expected = {"schema": "response_format.json_schema.schema is not a usable JSON schema",
                "type": "structured_outputs.json is not a usable JSON schema: Invalid type",
                "regex": "guided_regex is not a usable regular expression",
                "grammar": "structured_outputs.grammar is not a usable grammar"}
    for rid, words in expected.items():
        assert is_error(records[rid])
        message = records[rid]["error"]["message"]
        assert words in message and "\n" not in message, message


SHAPES = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("response_format", "json", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
     ("response_format.json_schema.schema", "json", '{"type": "integer"}')),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("structured_outputs.choice", "choice", '["a", "b"]')),
    ({"structured_outputs": {"regex": "a+"}}, ("structured_outputs.regex", "regex", "a+")),
    ({"structured_outputs": {"json": {"type": "integer"}}}, ("structured_outputs.json", "json", '{"type": "integer"}')),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, ("structured_outputs.grammar", "grammar", 'start: "a"')),
    ({"structured_outputs": {"json_object": True}}, ("structured_outputs.json_object", "json", '{"type": "object"}')),
    ({"guided_choice": ["a", "b"]}, ("guided_choice", "choice", '["a", "b"]')),
    ({"guided_regex": "a+"}, ("guided_regex", "regex", "a+")),
    ({"guided_json": {"type": "integer"}}, ("guided_json", "json", '{"type": "integer"}')),
    ({"guided_json": '{"type": "integer"}'}, ("guided_json", "json", '{"type": "integer"}')),
    ({"guided_grammar": "root ::= \"a\""}, ("guided_grammar", "grammar", 'root ::= "a"')),
]


@pytest.mark.parametrize("fields, constraint", SHAPES, ids=[json.dumps(f)[:40] for f, _ in SHAPES])
def test_constraint_fields_and_aliases(tmp_path, fields, constraint):
    """Every shape and alias reads to the same (field, kind, text); in an OpenAI body the
    field is named with its body. prefix."""
    path = write_jobs(tmp_path / "j.jsonl", [{"id": "a", "prompt": "x", **fields},
                                             {"custom_id": "b", "body": {"prompt": "x", **fields}}])
    requests, errors = read_jobs(path)
    assert errors == []
    assert requests[0].constraint == constraint
    body = None if constraint is None else ("body." + constraint[0], *constraint[1:])
    assert requests[1].constraint == body


BAD_SHAPES = [
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object with a"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice must be a non-empty list"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs must give exactly one"),
    ({"structured_outputs": {"structural_tag": "x", "regex": "a"}}, "structured_outputs.structural_tag is not"),
    ({"structured_outputs": "a+"}, "structured_outputs must be an object"),
    ({"guided_json": "{not json"}, "guided_json must be a JSON schema"),
    ({"guided_json": [1]}, "guided_json must be a JSON schema"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "give only one of response_format, "),
]


@pytest.mark.parametrize("fields, expected", BAD_SHAPES, ids=[m for _, m in BAD_SHAPES])
def test_misshapen_constraint_is_a_line_error(tmp_path, fields, expected):
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", [{"id": "a", "prompt": "x", **fields},
                                                                   {"id": "b", "prompt": "y"}]))
    assert [r.id for r in requests] == ["b"] and len(errors) == 1
    assert expected in errors[0].message and "\n" not in errors[0].message


class _Row:
    def __init__(self, grammar):
        self.grammar, self.done = grammar, False


def test_mask_costs_nothing_unconstrained_and_one_op_for_any_number_of_rows(checkpoints):
    """No row constrained: not one ATen op (the step's launch count is unchanged). Rows
    constrained: the masks of every row arrive computed on the worker thread, and applying
    them is one op whether 2 rows or 8 are constrained (no per-row op)."""
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(checkpoints["gqa"]))
    tokenizer, spec = ckpt.tokenizer, ckpt.spec
    logits = torch.randn(8, spec.shape.vocab_size)
    free = [_Row(None) for _ in range(8)]
    with OpCounter() as ops:
        constrain.mask(free, logits)
        constrain.start(free)
    assert ops.total == 0
    kernels = []
    for constrained in (2, 8):
        rows = [_Row(constrain.compile_grammar(("f", "choice", json.dumps(CHOICES)), tokenizer, spec))
                if i < constrained else _Row(None) for i in range(8)]
        constrain.start(rows)  # what the engine does after appending: the masks start now...
        assert all(r.grammar.pending[0].future is not None for r in rows[:constrained])
        rows[0].grammar.pending[0].future.result(timeout=30)  # ...and finish without the pick asking
        masked = logits.clone()
        with OpCounter() as ops:
            constrain.mask(rows, masked)
        kernels.append(ops.kernels)
        assert torch.isinf(masked[:constrained]).any(dim=-1).all()  # every constrained row masked
        assert torch.isfinite(masked[constrained:]).all()  # the others untouched
        assert all(r.grammar.pending is None for r in rows[:constrained])
    assert kernels[0] == kernels[1] == 1, kernels


def test_masks_follow_their_sequences_when_rows_move(checkpoints):
    """Continuous batching moves rows and brings in newcomers between a mask's start and its
    use: each mask lands on its own sequence's row, and a row that is not constrained now is
    not masked by what was computed for another."""
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(checkpoints["gqa"]))
    tokenizer, spec = ckpt.tokenizer, ckpt.spec
    digits = _Row(constrain.compile_grammar(("f", "regex", "[0-9]+"), tokenizer, spec))
    words = _Row(constrain.compile_grammar(("f", "choice", json.dumps(["yes", "no"])), tokenizer, spec))
    constrain.start([digits, words, _Row(None)])
    logits = torch.zeros(3, spec.shape.vocab_size)
    constrain.mask([words, _Row(None), digits], logits)  # rows moved; a newcomer in the middle
    allowed = [{tokenizer.decode([t]) for t in torch.isfinite(row).nonzero()[:, 0].tolist()} for row in logits]
    # exactly the tokens that begin "yes" or "no" (not a subset: a row with every token masked
    # would pass that); llguidance also lets a token end the answer, so each must be a prefix
    texts = {tokenizer.decode([t]) for t in range(spec.shape.vocab_size)}
    assert allowed[0] == {x for x in texts if x and ("yes".startswith(x) or "no".startswith(x))}, allowed[0]
    assert allowed[1] == {tokenizer.decode([t]) for t in range(spec.shape.vocab_size)}  # untouched
    assert allowed[2] and all(text.isdigit() for text in allowed[2])


# keys deliberately not in alphabetical order: the answer must keep the schema's order
ORDERED = {"type": "object", "properties": {"zeta": {"enum": ["cat", "dog"]}, "alpha": {"type": "boolean"},
                                            "middle": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["zeta", "alpha", "middle"], "additionalProperties": False}


def test_answer_keys_come_in_the_schemas_order(checkpoints, tmp_path):
    """OpenAI's structured outputs write keys in the schema's order (a schema written
    reasoning-first makes the model reason before it answers): so does every answer here,
    read off the answer's text, in each field shape that carries a schema."""
    shapes = [{"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ORDERED,
                                                                          "strict": True}}},
              {"structured_outputs": {"json": ORDERED}}, {"guided_json": json.dumps(ORDERED)}]
    lines = [{"id": f"{k}-{i}", "prompt": p, "max_tokens": 64, **shape}
             for i, p in enumerate(PROMPTS) for k, shape in enumerate(shapes)]
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", lines))
    assert errors == []
    engine, seqs, errors = open_engine(RunConfig(model=str(checkpoints["gqa"]), batch_size=3, num_batches=2),
                                       requests)
    try:
        done = {s.request.id: s for s in engine.run(seqs)}
    finally:
        engine.close()
    assert len(done) == len(lines)
    for rid, s in done.items():
        assert s.text.startswith('{"zeta": "'), (rid, s.text)
        assert s.finish_reason == "stop", (rid, s.text)  # three short fields: every answer completes
        keys = json.loads(s.text, object_pairs_hook=lambda pairs: [k for k, _ in pairs])
        assert keys == ["zeta", "alpha", "middle"], (rid, s.text)


def _strict(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                      "strict": True}}}


NESTED = {"type": "object", "additionalProperties": False, "required": ["who"],
          "properties": {"who": {"type": "object", "properties": {"name": {"type": "string"}}}}}
STRICT_REFUSALS = [
    ({**ORDERED, "required": ["zeta", "alpha"]},
     'response_format.json_schema.schema: with "strict": true every property must be listed in "required" '
     '(missing "middle")'),
    ({k: v for k, v in ORDERED.items() if k != "additionalProperties"},
     'response_format.json_schema.schema: with "strict": true every object needs "additionalProperties": false'),
    (NESTED, 'response_format.json_schema.schema.properties.who: with "strict": true every object needs '
             '"additionalProperties": false'),
    ({"type": "object", "additionalProperties": False, "required": ["x"], "properties": {"x": {"$ref": "#/$defs/p"}},
      "$defs": {"p": {"type": "object", "additionalProperties": False, "properties": {"q": {"type": "integer"}}}}},
     'response_format.json_schema.schema.$defs.p: with "strict": true every property must be listed'),
    ({"anyOf": [ORDERED, {"type": "string"}]}, 'with "strict": true the root schema must be {"type": "object"'),
    ({"type": "string"}, 'with "strict": true the root schema must be {"type": "object"'),
]


@pytest.mark.parametrize("schema, expected", STRICT_REFUSALS, ids=[str(i) for i in range(len(STRICT_REFUSALS))])
def test_strict_schema_outside_openais_rules_is_refused_naming_the_rule(tmp_path, schema, expected):
    """With "strict": true, a schema OpenAI's strict mode would refuse is that line's error
    record, one line naming the rule and where; without strict, the same schema is accepted
    and constrains the answer (best effort, as OpenAI's non-strict json_schema)."""
    loose = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", [{"id": "a", "prompt": "x", **_strict(schema)},
                                                                   {"id": "b", "prompt": "y", **loose}]))
    assert [r.id for r in requests] == ["b"] and requests[0].constraint[1] == "json"
    assert len(errors) == 1 and errors[0].message.startswith("response_format.json_schema.schema")
    assert expected in errors[0].message and "\n" not in errors[0].message


def test_strict_schema_within_the_rules_is_accepted_and_strict_must_be_a_bool(tmp_path):
    good = {"type": "object", "additionalProperties": False, "required": ["who", "tags"],
            "properties": {"who": {"anyOf": [{"type": "null"}, {**NESTED["properties"]["who"], "required": ["name"],
                                                                 "additionalProperties": False}]},
                           "tags": {"type": "array", "items": {"type": "string"}}}}
    bad_flag = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": good,
                                                                          "strict": "yes"}}}
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", [{"id": "a", "prompt": "x", **_strict(good)},
                                                                   {"id": "b", "prompt": "x", **bad_flag}]))
    assert [r.id for r in requests] == ["a"]
    assert json.loads(requests[0].constraint[2]) == good and list(json.loads(requests[0].constraint[2])) == list(good)
    assert [e.message for e in errors] == ['response_format.json_schema.strict must be true or false, got "yes"']
