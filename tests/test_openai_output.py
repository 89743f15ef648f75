"""OpenAI Batch output: an OpenAI Batch request is answered by an OpenAI Batch output line
whose body the `openai` package's own types accept; resume keys on custom_id."""
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from klotski.cli import main as cli
from klotski.io.records import record_key

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def _batch_line(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


@pytest.fixture
def job(tmp_path):
    lines = [_batch_line(f"chat-{i}", CHAT, model="x", messages=[{"role": "user", "content": f"Tell me about {w}"}],
                         max_tokens=4) for i, w in enumerate(["Paris", "rivers", "music", "Everest"])]
    lines += [_batch_line(f"text-{i}", TEXT, model="x", prompt=p, max_tokens=3)
              for i, p in enumerate(["The history of the city", "A river is", "Mount Everest"])]
    lines.append(_batch_line("bad", TEXT, prompt=""))                      # cannot be served
    lines.append(_batch_line("huge", TEXT, prompt="word " * 3000))         # longer than the context
    lines.append(json.dumps({"id": "plain", "prompt": "Paris is"}) + "\n")  # klotski's own form
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(lines))
    return path


def _generate(job, out, checkpoints, *extra):
    return cli.main(["generate", str(job), "--model", str(checkpoints["gqa"]), "-o", str(out), "--no-progress",
                     "--max-new-tokens", "5", *extra])


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_batch_requests_get_batch_output_lines_the_openai_types_accept(job, tmp_path, checkpoints):
    out = tmp_path / "out.jsonl"
    assert _generate(job, out, checkpoints) == 1  # two lines could not be served
    records = {record_key(r): r for r in _records(out)}
    assert set(records) == {f"chat-{i}" for i in range(4)} | {f"text-{i}" for i in range(3)} | {"bad", "huge",
                                                                                                 "plain"}
    for key, rec in records.items():
        if key == "plain":
            assert set(rec) >= {"id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"}
            continue
        assert rec["id"].startswith("batch_req_") and rec["custom_id"] == key
        if key in ("bad", "huge"):
            assert rec["response"] is None and rec["error"]["message"]
            assert rec["error"]["code"] == ("context_length_exceeded" if key == "huge" else "invalid_request")
            continue
        assert rec["error"] is None and rec["response"]["status_code"] == 200 and rec["response"]["request_id"]
        body = rec["response"]["body"]
        parsed = (ChatCompletion if key.startswith("chat") else Completion).model_validate(body)
        choice = parsed.choices[0]
        text = choice.message.content if key.startswith("chat") else choice.text
        assert isinstance(text, str) and choice.finish_reason in ("stop", "length")
        usage = parsed.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert 1 <= usage.completion_tokens <= (4 if key.startswith("chat") else 3)
        assert parsed.model == str(checkpoints["gqa"])


def test_resume_of_a_batch_job_writes_no_custom_id_twice(job, tmp_path, checkpoints):
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    _generate(job, full, checkpoints)
    kept = out.write_text("".join(json.dumps(r) + "\n" for r in _records(full)[:4]))  # a run cut short
    assert kept
    assert _generate(job, out, checkpoints) == 1
    keys = [record_key(r) for r in _records(out)]
    assert len(keys) == len(set(keys)) == len(_records(full))
    assert _generate(job, out, checkpoints) == 1  # everything done: nothing new but the retried errors
    keys = [record_key(r) for r in _records(out)]
    assert len(keys) == len(set(keys)) == len(_records(full))


def test_output_format_can_be_forced_either_way(job, tmp_path, checkpoints):
    out = tmp_path / "k.jsonl"
    _generate(job, out, checkpoints, "--output-format", "klotski")
    assert all("custom_id" not in r and "id" in r for r in _records(out))
    out = tmp_path / "o.jsonl"
    _generate(job, out, checkpoints, "--output-format", "openai")
    plain = next(r for r in _records(out) if r.get("custom_id") == "plain")
    Completion.model_validate(plain["response"]["body"])


def test_a_line_that_is_not_json_gets_openais_error_shape(tmp_path, checkpoints):
    """Among OpenAI requests (auto) or with --output-format openai, a line that cannot be read
    as JSON is answered as OpenAI does: custom_id null, code invalid_json_line, its line number;
    a rerun retries it without writing it twice."""
    job = tmp_path / "batch.jsonl"
    job.write_text(_batch_line("a", TEXT, prompt="Paris is", max_tokens=2)
                   + '{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {\n'
                   + "not json at all\n" + _batch_line("c", TEXT, prompt="A river is", max_tokens=2))
    for extra in ((), ("--output-format", "openai")):
        out = tmp_path / f"out{len(extra)}.jsonl"
        for _ in range(2):  # the rerun: the error records are retried, never duplicated
            assert _generate(job, out, checkpoints, *extra) == 1
            records = _records(out)
            bad = [r for r in records if r["response"] is None] if extra else [r for r in records if r.get("error")]
            assert len(records) == 4 and len(bad) == 2
        by_line = {r["error"]["line"]: r for r in bad} if extra else None
        if extra:
            assert set(by_line) == {2, 3}
            for line, r in by_line.items():
                assert r["custom_id"] is None and r["id"].startswith("batch_req_")
                assert r["error"]["code"] == "invalid_json_line" and r["error"]["message"].startswith(f"line {line}: ")
        else:  # auto: the line that names a custom_id is OpenAI's; the other has no form to follow
            meant = next(r for r in bad if "custom_id" in r)
            assert meant["custom_id"] is None and meant["error"]["code"] == "invalid_json_line"
            assert meant["error"]["message"].startswith("line 2: ")
