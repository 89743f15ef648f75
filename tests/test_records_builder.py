"""One builder of a finished line's record (issue 59): io.records.finished_record is what a job's
output and a Ray worker's shard write (schedule.sequences.line_record), what Ray Data's columns
hold (klotski.ray.Generator) and what klotski serve answers online with."""
import json
import re

import pytest

from conftest import PROMPTS
from klotski.config import RunConfig
from klotski.io.records import error_record, finished_record, result_record
from klotski.io.requests import CHAT_URL, LineError, Request
from klotski.schedule import sequences as S

UUIDS = re.compile(r"(batch_req_|chatcmpl-|cmpl-)?[0-9a-f]{32}")


def _seq(rid="r1", text="a river", out=(5, 6, 7), error=None, openai=None, sample=0):
    req = Request(id=rid, line=3, prompt=None if openai else "p", messages=(("user", "hi"),) if openai else None,
                  openai=openai)
    return S.Sequence(req, [1, 2], max_new_tokens=8, temperature=0.0, top_p=1.0, stop=(), generator=None,
                      out=list(out), finish_reason="error" if error else "length", text=text, error=error,
                      sample=sample)


def _same(a: dict, b: dict) -> bool:
    """Equal but for the ids and times an OpenAI record draws afresh."""
    def plain(r):
        return json.loads(UUIDS.sub("ID", json.dumps({**r, "response": r.get("response") and {
            **r["response"], "body": {k: v for k, v in r["response"]["body"].items() if k != "created"}}})))
    return plain(a) == plain(b)


@pytest.mark.parametrize("fmt,openai", [("klotski", None), ("openai", CHAT_URL), ("auto", CHAT_URL)])
def test_a_finished_line_is_its_result_record(fmt, openai):
    samples = [_seq(openai=openai)]
    record, failed = finished_record(samples, fmt=fmt, model="tiny")
    assert failed is None and _same(record, result_record(samples, fmt=fmt, model="tiny"))
    if fmt == "klotski":  # the form, written out here rather than read from the code
        assert record == {"id": "r1", "completion": "a river", "finish_reason": "length", "prompt_tokens": 2,
                          "completion_tokens": 3}
    # line_record gathers the samples and answers the same
    via_line, none = S.line_record(samples[0], fmt=fmt, model="tiny")
    assert none is None and _same(via_line, record)


@pytest.mark.parametrize("fmt", ["klotski", "openai"])
def test_a_line_with_a_failed_sample_is_its_error_record(fmt):
    ok, bad = _seq(sample=0, openai=CHAT_URL), _seq(sample=1, error="non-finite logits", openai=CHAT_URL)
    ok.samples = bad.samples = [ok, bad]
    record, failed = finished_record([ok, bad], fmt=fmt, model="tiny")
    assert failed == LineError("r1", 3, "non-finite logits", openai=CHAT_URL, code="model_error")
    assert _same(record, error_record(failed, fmt=fmt))
    assert S.line_record(ok, fmt=fmt, model="tiny")[1] == failed
    unfinished = _seq(openai=CHAT_URL)
    unfinished.finish_reason = None
    assert S.line_record(unfinished, fmt=fmt, model="tiny") is None


def test_ray_datas_columns_are_the_lines_klotski_records(checkpoints, tmp_path):
    """klotski.ray.Generator (Ray Data's engine) called as Ray would, without Ray: each row's
    columns are the fields of the record the same line gets in a job's output."""
    from klotski.generate import generate
    from klotski.ray import Generator
    config = RunConfig(model=str(checkpoints["gqa"]), max_new_tokens=6, progress=False)
    rows = {"id": ["a", "b", "c"], "prompt": [PROMPTS[0], "", PROMPTS[3]]}
    got = Generator(config.to_json())(dict(rows))
    assert got["error"][1] and "empty" in got["error"][1] and got["completion"][1] is None
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in zip(rows["id"], rows["prompt"])))
    generate(config, jobs, str(tmp_path / "out.jsonl"))
    want = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i in (0, 2):
        rid = rows["id"][i]
        assert {k: got[k][i] for k in Generator.FIELDS} == {k: want[rid][k] for k in Generator.FIELDS}
        assert got["error"][i] is None and got["completion_tokens"][i] > 0
