"""`klotski serve` (issue 40): a real uvicorn server in a subprocess, driven by the official
`openai` client unchanged. Batch output equals `klotski generate` on the same input; a
batch survives SIGKILL and SIGTERM; concurrent online calls share engine steps and answer as
the batch does; every mistake is one clear error and the server lives on."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import urllib.error
import urllib.request

import openai
import pytest

from klotski.cli import main as cli

MAX = 5  # tokens an answer
KEY = "sekret"
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TOPICS = ["Paris", "rivers", "music", "Everest", "the sea", "bread", "trains", "winter", "cats", "stars",
          "gold", "rain", "paper", "glass", "salt", "wind"]


def _raw(url: str, *, data: bytes | None = None, key: str | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one plain HTTP request, with no client's help."""
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m klotski.cli serve` on a free port, its log in a file."""

    def __init__(self, model, data: Path, *extra, preexec_fn=None, env=None):
        self.port, self.data = _free_port(), data
        self.log = data.with_name(data.name + f"-{self.port}.log")
        cmd = [sys.executable, "-m", "klotski.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--data-dir", str(data), "--device", "cpu", "--max-new-tokens", str(MAX), *extra]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
                                         env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()}"
            try:
                if _raw(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.3)

    def client(self, key=KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


def _line(cid, url=CHAT, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _chat(topic):
    return [{"role": "user", "content": f"Tell me about {topic}"}]


def _write(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _wait(client, batch_id, until=("completed", "failed", "cancelled", "expired"), timeout=240):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.time() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def _by_id(text: str) -> dict:
    records = [json.loads(x) for x in text.splitlines() if x.strip()]
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a custom_id answered twice"
    return {r["custom_id"]: r for r in records}


def _answer(rec) -> tuple:
    """What must be equal between two runs (ids and `created` are not)."""
    body = rec["response"]["body"]
    choice = body["choices"][0]
    return choice.get("message", {}).get("content", choice.get("text")), choice["finish_reason"], body["usage"]


def _generate(model, jobs: Path) -> dict:
    out = jobs.with_name(jobs.stem + ".generate.jsonl")
    cli.main(["generate", str(jobs), "--model", str(model), "-o", str(out), "--no-progress", "--device", "cpu",
              "--max-new-tokens", str(MAX), "--output-format", "openai"])
    return _by_id(out.read_text())


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints["gqa"])


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("serve") / "data", "--api-key", KEY, "--max-upload-size", "128KB",
               "--batch-size", "4")  # rows of 4: a batch of many lines runs long enough to cancel
    yield s
    assert s.stop() in (0, 143), s.log.read_text()


@pytest.fixture(scope="module")
def batch(server, model, tmp_path_factory):
    """One chat batch: 16 requests, 3 the server refuses, 1 generate refuses."""
    lines = [_line(f"chat-{i}", model=model, messages=_chat(t), max_tokens=MAX) for i, t in enumerate(TOPICS)]
    lines += [_line("other-model", model="gpt-4o", messages=_chat("x")),
              _line("other-url", TEXT, prompt="Paris is"),
              _line("unsupported", messages=_chat("x"), best_of=2)]
    lines.insert(3, "")  # a blank line is no request
    jobs = _write(tmp_path_factory.mktemp("batch") / "in.jsonl", lines)
    client = server.client()
    f = client.files.create(file=jobs.open("rb"), purpose="batch")
    created = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                    metadata={"job": "test"})
    assert created.status == "validating" and created.input_file_id == f.id
    done = _wait(client, created.id)
    return jobs, done, client


def test_batch_output_equals_generate(batch, model):
    jobs, done, client = batch
    assert done.status == "completed", done
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.metadata == {"job": "test"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (19, 16, 3)
    out, err = _by_id(client.files.content(done.output_file_id).text), _by_id(
        client.files.content(done.error_file_id).text)
    assert set(out) == {f"chat-{i}" for i in range(16)}
    assert set(err) == {"other-model", "other-url", "unsupported"}
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in out.values())
    assert all(r["response"] is None and r["error"]["code"] and r["error"]["message"] for r in err.values())
    assert err["other-model"]["error"]["code"] == "model_not_found" and "gpt-4o" in err["other-model"]["error"]["message"]
    assert err["other-url"]["error"]["code"] == "invalid_url"
    assert "best_of" in err["unsupported"]["error"]["message"]
    reference = _generate(model, jobs)
    assert {k: _answer(r) for k, r in out.items()} == {k: _answer(reference[k]) for k in out}
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [done.id]


def test_concurrent_calls_share_steps_and_equal_the_batch(batch, server, model):
    _, done, client = batch
    expected = {k: _answer(r)[0] for k, r in _by_id(client.files.content(done.output_file_id).text).items()}
    before = _raw(server.url + "/health")[1]["online"]
    answers, errors = {}, []

    def ask(i):
        try:
            r = client.chat.completions.create(model=model, messages=_chat(TOPICS[i]), max_tokens=MAX)
            answers[f"chat-{i}"] = r.choices[0].message.content
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and answers == expected
    online = _raw(server.url + "/health")[1]["online"]
    assert online["requests"] - before["requests"] == 16
    # they shared engine steps: one step computed several of them, and far fewer steps ran
    # than one request after another would take
    assert online["most_in_one_step"] >= 4
    assert online["steps"] - before["steps"] < 16 * MAX // 2
    stream = client.chat.completions.create(model=model, messages=_chat(TOPICS[0]), max_tokens=MAX, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected["chat-0"]
    text = client.completions.create(model=model, prompt="Paris is", max_tokens=MAX)
    assert text.choices[0].text and text.usage.completion_tokens <= MAX
    assert [m.id for m in client.models.list().data] == [model]


def test_every_mistake_is_one_clear_error_and_the_server_lives(server, model, tmp_path):
    client = server.client()
    status, body = _raw(server.url + "/v1/models")
    assert status == 401 and "missing API key" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        server.client("wrong").models.list()
    with pytest.raises(openai.NotFoundError, match="no such file"):
        client.files.retrieve("file-" + "0" * 24)
    with pytest.raises(openai.NotFoundError, match="no such batch"):
        client.batches.retrieve("batch_" + "0" * 24)
    for path in ("/v1/files/..%2F..%2Fetc%2Fpasswd/content", "/v1/files/file-..%2F..%2Fetc%2Fpasswd",
                 "/v1/files/..%2Flock"):
        assert _raw(server.url + path, key=KEY)[0] == 404, path
    big = _write(tmp_path / "big.jsonl", [_line(f"r{i}", messages=_chat("x" * 400)) for i in range(400)])
    with pytest.raises(openai.APIStatusError, match="over this server's limit") as e:
        client.files.create(file=big.open("rb"), purpose="batch")
    assert e.value.status_code == 413
    # form fields count towards the limit: a tiny file beside a 200 KB field is refused too
    form = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + b"x" * 200_000 +
            b"\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n{}\n\r\n--b--\r\n")
    request = urllib.request.Request(server.url + "/v1/files", data=form, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary=b"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 413 and "--max-upload-size" in json.loads(e.value.read())["error"]["message"]
    status, body = _raw(server.url + "/v1/batches", data=b"{not json", key=KEY)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=_chat("x"))
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])

    # a file with a line that is not JSON fails validation, naming the line
    bad = _write(tmp_path / "bad.jsonl", [_line("a", messages=_chat("x")), '{"custom_id": "b", "body": {',
                                          _line("c", messages=_chat("y"))])
    f = client.files.create(file=bad.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint must be"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = _wait(client, client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    assert [(x.code, x.line) for x in failed.errors.data] == [("invalid_json_line", 2)]

    # an online request joins a running batch ahead of its waiting lines; the batch's input is
    # in use (409) until the batch is cancelled, then it can go
    many = _write(tmp_path / "many.jsonl", [_line(f"r{i}", messages=_chat(f"topic {i}"), max_tokens=8)
                                            for i in range(400)])
    f = client.files.create(file=many.open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    _wait(client, b.id, until=("in_progress",))
    deadline = time.time() + 240  # in_progress comes before its lines reach the engine: wait for one
    while client.batches.retrieve(b.id).request_counts.completed == 0:
        assert time.time() < deadline, "the batch completed no line"
        time.sleep(0.2)
    joined = _raw(server.url + "/health")[1]["online"]["joined"]
    assert client.chat.completions.create(model=model, messages=_chat("x"), max_tokens=2).choices[0].message
    assert client.batches.retrieve(b.id).status == "in_progress"
    assert _raw(server.url + "/health")[1]["online"]["joined"] == joined + 1
    with pytest.raises(openai.ConflictError, match="in use by batch"):
        client.files.delete(f.id)
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    cancelled = _wait(client, b.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.cancelling_at
    assert cancelled.request_counts.completed < 400
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)

    # a second server on the same data dir is refused in one line
    second = subprocess.run([sys.executable, "-m", "klotski.cli", "serve", "--model", model, "--data-dir",
                             str(server.data), "--port", str(_free_port())], capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 2 and "in use by another klotski server" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert _raw(server.url + "/health")[1]["status"] == "ok"


def test_a_batch_survives_sigkill_and_sigterm(model, tmp_path):
    data = tmp_path / "data"
    jobs = _write(tmp_path / "in.jsonl", [_line(f"r{i}", model=model, messages=_chat(f"topic {i} of many"))
                                          for i in range(40)])
    run = lambda bid: data / "batches" / bid / "run.jsonl"  # noqa: E731
    written = lambda bid: len(run(bid).read_text().splitlines()) if run(bid).exists() else 0  # noqa: E731

    def until_written(bid, n, server):
        deadline = time.time() + 240
        while written(bid) < n:
            assert server.proc.poll() is None and time.time() < deadline, server.log.read_text()
            time.sleep(0.05)

    slow = ("--batch-size", "2", "--num-batches", "1")  # records come a few at a time
    first = Server(model, data, *slow)
    client = first.client()
    f = client.files.create(file=jobs.open("rb"), purpose="batch")
    bid = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id
    until_written(bid, 4, first)
    first.stop(signal.SIGKILL)
    assert 4 <= written(bid) < 40
    kept = {}  # the records written before the kill: resumed, not made again
    for raw in run(bid).read_text().splitlines():
        try:
            kept[json.loads(raw)["custom_id"]] = json.loads(raw)["id"]
        except ValueError:
            pass  # a record the kill cut short

    second = Server(model, data, *slow)
    until_written(bid, written(bid) + 2, second)
    assert second.stop(signal.SIGTERM) in (0, 143)
    on_disk = json.loads((data / "batches" / bid / "batch.json").read_text())
    assert on_disk["status"] in ("in_progress", "completed")

    third = Server(model, data)
    client = third.client()
    done = _wait(client, bid)
    assert done.status == "completed" and done.request_counts.completed == 40
    out = _by_id(client.files.content(done.output_file_id).text)  # (each custom_id once: _by_id checks)
    assert {k: out[k]["id"] for k in kept} == kept
    reference = _generate(model, jobs)
    assert {k: _answer(r) for k, r in out.items()} == {k: _answer(r) for k, r in reference.items()}
    assert third.stop() in (0, 143)
