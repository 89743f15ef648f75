"""`klotski generate` end to end, as a user runs it: bad lines, exit status, kill and resume."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PROMPTS
from klotski.io.records import is_error, record_key

KLOTSKI = [sys.executable, "-m", "klotski.cli"]


def run(args, **kw):
    return subprocess.run(KLOTSKI + args, capture_output=True, text=True, timeout=300, **kw)


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_become_error_records_and_good_lines_complete(checkpoints, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    with open(jobs, "wb") as f:
        f.write(b'{"id": "good1", "prompt": "The river"}\n')
        f.write(b'{"id": "broken", "prompt": \n')                      # malformed JSON
        f.write(b'{"id": "empty", "prompt": ""}\n')                    # empty prompt
        f.write(b'{"id": "types", "prompt": "x", "max_new_tokens": "ten"}\n')  # wrong type
        f.write(b'{"id": "bytes", "prompt": "caf\xe9"}\n')              # not UTF-8
        f.write(b'{"id": "good1", "prompt": "again"}\n')               # duplicate id
        f.write(b'{"id": "long", "prompt": "' + b"word " * 3000 + b'"}\n')  # longer than the context
        f.write(b'{"messages": [{"role": "user", "content": "Tell me about Paris"}]}\n')
        f.write(b'{"custom_id": "oa", "method": "POST", "url": "/v1/completions", '
                b'"body": {"prompt": "Mount Everest", "max_tokens": 3}}\n')
    out = tmp_path / "out.jsonl"
    r = run(["generate", str(jobs), "--model", str(checkpoints["gqa"]), "-o", str(out), "--no-progress"])
    assert r.returncode == 1, r.stderr                       # some lines failed
    assert "Traceback" not in r.stderr
    records = {record_key(rec): rec for rec in read_lines(out)}
    errors = {i for i, rec in records.items() if is_error(rec)}
    # unparseable lines cannot name their id: they get their line number
    assert {"2", "empty", "types", "5", "long"} <= errors
    assert any(i.startswith("good1#") for i in errors)       # the duplicate
    for ok in ("good1", "8"):
        assert records[ok]["finish_reason"] in ("stop", "length") and "completion" in records[ok]
    body = records["oa"]["response"]["body"]  # an OpenAI Batch line is answered in its own form
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 3
    assert "5 failed" in r.stderr or "6 failed" in r.stderr


def test_user_mistakes_are_one_line(tmp_path, checkpoints):
    r = run(["generate", str(tmp_path / "missing.jsonl"), "--model", str(checkpoints["gqa"])])
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((checkpoints["gqa"] / "config.json").read_text())
    data = (checkpoints["gqa"] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated shard
    jobs = tmp_path / "j.jsonl"
    jobs.write_text('{"prompt": "x"}\n')
    r = run(["generate", str(jobs), "--model", str(bad), "-o", str(tmp_path / "o.jsonl")])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.safetensors" in r.stderr and "truncated" in r.stderr
    if not __import__("torch").cuda.is_available():  # asking for a GPU that is not there
        r = run(["generate", str(jobs), "--model", str(checkpoints["gqa"]), "--device", "cuda",
                 "-o", str(tmp_path / "c.jsonl")])
        assert r.returncode == 2 and "--device cuda" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "c.jsonl").exists()


def test_sigkill_then_resume_yields_every_id_once(checkpoints, tmp_path):
    prompts = [f"{p} number {i}" for i in range(8) for p in PROMPTS[:3]]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    args = ["generate", str(jobs), "--model", str(checkpoints["gqa"]), "--batch-size", "1",
            "--max-new-tokens", "12", "--no-progress"]
    full = tmp_path / "full.jsonl"
    assert run(args + ["-o", str(full)]).returncode == 0

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(KLOTSKI + args + ["-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 3 <= partial < len(prompts), "the kill should land mid-run"

    r = run(args + ["-o", str(out)])
    assert r.returncode == 0, r.stderr
    ids = [rec["id"] for rec in read_lines(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(len(prompts)))  # each exactly once
    expected = {rec["id"]: rec for rec in read_lines(full)}
    assert {rec["id"]: rec for rec in read_lines(out)} == expected


@pytest.mark.parametrize("failure", ["budget", "bug"])
def test_a_run_that_stops_midway_says_so_in_one_line_and_resumes(checkpoints, tmp_path, monkeypatch, capsys,
                                                                 failure):
    """An exhausted budget (a planning or accounting bug, never a user's) or any other failure
    mid-run: one line naming the records kept, exit 3, and the rerun completes the rest."""
    from klotski.cli import main as cli
    from klotski.execute.pipeline import Pipeline
    from placement.tiers import OverBudget
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    args = ["generate", str(jobs), "--model", str(checkpoints["gqa"]), "--batch-size", "1", "--max-new-tokens", "4",
            "--no-progress"]
    full = tmp_path / "full.jsonl"
    assert cli.main(args + ["-o", str(full)]) == 0
    real, calls = Pipeline.forward, []

    def failing(self, kvs, inputs):
        calls.append(1)
        if len(calls) > 12:  # a few sequences in
            raise OverBudget("device budget exceeded (injected)") if failure == "budget" else KeyError("injected")
        return real(self, kvs, inputs)

    monkeypatch.setattr(Pipeline, "forward", failing)
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert cli.main(args + ["-o", str(out)]) == cli.EXIT_STOPPED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "rerun the same command to resume" in err[0]
    assert ("injected" in err[0]) and (failure == "budget" or "details in" in err[0])
    kept = read_lines(out)
    assert 1 <= len(kept) < len(PROMPTS)
    monkeypatch.setattr(Pipeline, "forward", real)
    assert cli.main(args + ["-o", str(out)]) == 0
    assert sorted(r["id"] for r in read_lines(out)) == sorted(r["id"] for r in read_lines(full))
    assert {r["id"]: r for r in read_lines(out)} == {r["id"]: r for r in read_lines(full)}
