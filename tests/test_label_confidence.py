"""A label's confidence (issue 47): a line with a choice constraint and `"choice_logprobs": true`
gets every option's log-probability (the sum over its tokens under the grammar's mask, EOS's
too where another option could go on), in the klotski, OpenAI Batch and Parquet records. Here
on the tiny checkpoint in fp32 the numbers are checked against transformers' own forward
(log_softmax at each position under an independent llguidance matcher's mask, summed over the
option's token ids) within 1e-5, and none may be missing; on the trained model in the box the
same check is in test_smollm.py, with every test of the trained model."""
import json

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from klotski.cli import main as cli
from test_constrained import write_jobs

LABELS = ["positive", "negative", "very negative", "neutral"]  # one label of several tokens, one a prefix's kin


def _masked_logprob(matcher, logits: torch.Tensor, token: int) -> float:
    """log p(token) renormalised over the tokens llguidance's own matcher allows here."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:logits.shape[-1]].astype(bool))
    return torch.log_softmax(logits.float().masked_fill(~allowed, float("-inf")), dim=-1)[token].item()


def transformers_option_logprobs(model, tok, prompt_ids: list[int], choices: list[str]) -> list[float]:
    """The reference: for each option as the tokenizer splits it, transformers' forward over
    prompt + option (+ EOS where the grammar could still go on), each token's log-probability
    under an independent llguidance matcher's mask, summed."""
    eos = model.generation_config.eos_token_id
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=eos)
    out = []
    for option in choices:
        matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("choice", choices))
        ids = tok(option, add_special_tokens=False)["input_ids"]
        path = list(ids)
        for t in ids:
            assert matcher.consume_token(t)
        if not matcher.is_stopped():
            path.append(tok.eos_token_id)
        matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("choice", choices))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + path])).logits[0, len(prompt_ids) - 1:]
        total = 0.0
        for j, t in enumerate(path):
            total += _masked_logprob(matcher, logits[j], t)
            matcher.consume_token(t)
        out.append(total)
    return out


TOLERANCE = 1e-5  # fp32 on both sides: the engine's sums and transformers' agree to a few 1e-7 here


def test_every_output_shape_carries_the_options(checkpoints, tmp_path):
    """klotski's record, an OpenAI Batch line's body (the extension field) and a Parquet column;
    a line of n samples has them once; a choice_logprobs without a choice is that line's error.
    Every option's number is there (never None: each of LABELS is a path the grammar takes as
    the tokenizer splits it) and equals transformers' masked sum within TOLERANCE, for a greedy
    line, a sampled line of n (log-probabilities are taken before temperature) and an OpenAI one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    prompts = {"plain": "The river", "many": "Paris is", "oai": "A quantum"}
    lines = [{"id": "plain", "prompt": prompts["plain"], "guided_choice": LABELS, "choice_logprobs": True},
             {"id": "many", "prompt": prompts["many"], "structured_outputs": {"choice": LABELS},
              "choice_logprobs": True, "n": 3, "temperature": 1.0},
             {"custom_id": "oai", "body": {"prompt": prompts["oai"], "guided_choice": LABELS, "choice_logprobs": True}},
             {"id": "free", "prompt": "maybe", "max_tokens": 3},
             {"id": "bad", "prompt": "no", "guided_regex": "[a-z]+", "choice_logprobs": True}]
    jobs = write_jobs(tmp_path / "j.jsonl", lines)
    model = ["--model", str(checkpoints["gqa"]), "--no-progress", "--batch-size", "4", "--dtype", "float32",
             "--device", "cpu"]
    assert cli.main(["generate", str(jobs), "-o", str(tmp_path / "o.jsonl"), *model]) == 1  # one line error
    records = {r.get("custom_id") or r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(checkpoints["gqa"])
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["gqa"], dtype=torch.float32).eval()
    expected = {rid: transformers_option_logprobs(reference, tok, tok(prompt)["input_ids"], LABELS)
                for rid, prompt in prompts.items()}
    assert all(len(set(np.round(v, 3))) == len(LABELS) for v in expected.values())  # distinct: a swap shows
    for rid, where in (("plain", records["plain"]), ("many", records["many"]),
                       ("oai", records["oai"]["response"]["body"])):
        options = where["choice_logprobs"]
        assert [o["choice"] for o in options] == LABELS, rid
        got = [o["logprob"] for o in options]
        assert all(isinstance(x, float) for x in got), (rid, got)  # never None: every option scored
        assert got == pytest.approx(expected[rid], abs=TOLERANCE), (rid, got, expected[rid])
        assert sum(np.exp(got)) <= 1 + 1e-6
    assert len(records["many"]["choices"]) == 3 and "choice_logprobs" not in records["free"]
    assert "choice_logprobs scores the options of a choice" in records["bad"]["error"]["message"]
    assert cli.main(["generate", str(jobs), "-o", str(tmp_path / "o.parquet"), *model]) == 1
    import pyarrow.parquet as pq
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "o.parquet").to_pylist()}
    assert [o["choice"] for o in rows["plain"]["choice_logprobs"]] == LABELS
    assert [o["logprob"] for o in rows["plain"]["choice_logprobs"]] == pytest.approx(expected["plain"], abs=TOLERANCE)
    assert rows["free"]["choice_logprobs"] is None
