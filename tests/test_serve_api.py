"""`klotski serve` (issue 50): bodies bounded without being held, the key from the
environment or a file, OpenAI's shapes where clients meet them (content parts, the developer
role, models by id, served names, errors with `param`, list limits and cursors), batches that
expire in their window, duplicate ids refused, a report per batch, and /health answering
quickly while the server is busy."""
import json
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from klotski.cli import main as cli
from klotski.cli.parser import api_key, build_parser
from test_serve import CHAT, KEY, MAX, Server, _by_id, _chat, _free_port, _line, _raw, _wait, _write

ALIAS = "tiny-chat"
WINDOW_S = 12  # the batch window these tests shorten OpenAI's 24h to (the small batches end well within it)


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints["gqa"])


@pytest.fixture(scope="module")
def api(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("api") / "data", "--max-body-size", "1MB", "--max-upload-size",
               "250MB", "--served-model-name", ALIAS, "second-name", "--test-batch-window", str(WINDOW_S),
               "--batch-size", "2", "--num-batches", "1", env={"KLOTSKI_API_KEY": KEY})
    yield s
    assert s.stop() in (0, 143), s.log.read_text()


def _request(port: int, head: bytes, body_chunks=()) -> tuple[int | None, bytes, int]:
    """(status or None, reply, bytes sent) of a raw HTTP request whose body may be cut short by the server."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server refused the body and closed: its reply is what counts
        reply = b""
        try:  # the reply's head, then as many bytes as its Content-Length says (the server may keep the connection)
            while b"\r\n\r\n" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
            length = next((int(x.split(b":")[1]) for x in reply.split(b"\r\n\r\n")[0].split(b"\r\n")
                           if x.lower().startswith(b"content-length:")), 0)
            while len(reply.split(b"\r\n\r\n", 1)[-1]) < length and (chunk := sock.recv(65536)):
                reply += chunk
        except OSError:
            pass
    status = int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else None
    return status, reply, sent


def _hwm(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_body_over_the_limit_is_refused_without_being_held(api):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    # by its Content-Length: refused before a byte is read
    t = time.time()
    status, reply, _ = _request(api.port, (head + "Content-Length: 300000000\r\n\r\n").encode())
    assert status == 413 and time.time() - t < 5
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "--max-body-size" in error["message"] and error["type"] == "invalid_request_error"
    # streamed without a length: counted as it comes, and 300 MB never reach the server's memory
    try:
        Path(f"/proc/{api.proc.pid}/clear_refs").write_text("5")  # the peak starts again from now
    except OSError:
        pytest.skip("the peak resident set cannot be reset here")
    before = _hwm(api.proc.pid)
    piece = b"[" + b" " * (1 << 20)
    chunks = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(300))
    status, reply, _ = _request(api.port, (head + "Transfer-Encoding: chunked\r\n\r\n").encode(), chunks)
    assert status == 413 and b"--max-body-size" in reply  # (uvicorn drops the rest of the body as it comes)
    assert _hwm(api.proc.pid) - before < 64 << 20, "the body was held in memory"
    assert _raw(api.url + "/health")[0] == 200


def test_the_key_comes_from_the_environment_or_a_file(api, tmp_path, model, capsys):
    assert _raw(api.url + "/v1/models")[0] == 401  # (the key came from KLOTSKI_API_KEY)
    with urllib.request.urlopen(urllib.request.Request(api.url + "/v1/models",
                                                       headers={"Authorization": f"bEaReR {KEY}"})) as r:
        assert r.status == 200  # the scheme in any case
    keyfile = tmp_path / "key"
    keyfile.write_text("from-a-file\n")
    args = build_parser().parse_args(["serve", "--model", "m", "--api-key-file", str(keyfile)])
    assert api_key(args) == "from-a-file"
    # without a key on an address others reach: a warning (the model is missing: it stops there)
    assert cli.main(["serve", "--model", str(tmp_path / "none"), "--host", "0.0.0.0", "--port", str(_free_port()),
                     "--data-dir", str(tmp_path / "d")]) == 2
    assert "warning: serving on 0.0.0.0 without an API key" in capsys.readouterr().err
    # a taken port: one line, before anything is built
    t = time.time()
    assert cli.main(["serve", "--model", model, "--port", str(api.port), "--data-dir", str(tmp_path / "d2")]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{api.port}" in err and len(err.strip().splitlines()) == 1
    assert time.time() - t < 5
    # a run's calibration, not a server's: refused in one line
    assert cli.main(["serve", "--model", model, "--port", str(_free_port()), "--data-dir", str(tmp_path / "d3"),
                     "--adaptive-gating"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("klotski: error: --adaptive-gating") and "klotski generate" in err and "\n" not in err


def test_openai_shapes_clients_send_and_expect(api):
    client = api.client()
    plain = client.chat.completions.create(model=ALIAS, max_tokens=MAX, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Paris"}])
    assert plain.model == ALIAS
    parts = client.chat.completions.create(model="second-name", max_tokens=MAX, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Tell me about Paris"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [ALIAS, "second-name"]
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError, match="not served here") as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ALIAS, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role" and "line" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="tools") as e:
        client.chat.completions.create(model=ALIAS, messages=_chat("x"), tools=[
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}])
    assert "the request" in e.value.body["message"] and "line" not in e.value.body["message"]
    for path, status in (("/v1/embeddings", 404), ("/nothing", 404)):
        got, body = _raw(api.url + path, key=KEY)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}
    got, body = _raw(api.url + "/v1/models", data=b"{}", key=KEY)  # POST where only GET is
    assert got == 405 and body["error"]["code"] == "method_not_allowed"
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("after=batch_" + "0" * 24, "after"),
                         ("limit=ten", "limit")):
        got, body = _raw(api.url + "/v1/batches?" + query, key=KEY)
        assert got == 400 and body["error"]["param"] == param, (query, body)
    f1 = client.files.create(file=_write(Path(api.data).parent / "a.jsonl", [_line("a", messages=_chat("x"))]).open(
        "rb"), purpose="batch")
    time.sleep(1.1)
    f2 = client.files.create(file=_write(Path(api.data).parent / "b.jsonl", [_line("b", messages=_chat("x"))]).open(
        "rb"), purpose="batch")
    ids = [f.id for f in client.files.list(order="asc").data]
    assert ids.index(f1.id) < ids.index(f2.id)
    assert [f.id for f in client.files.list(order="desc", limit=1).data] == [f2.id]


def test_batches_expire_refuse_duplicates_and_report_themselves(api, tmp_path):
    client = api.client()

    def submit(name, lines):
        f = client.files.create(file=_write(tmp_path / name, lines).open("rb"), purpose="batch")
        return client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")

    dup = _wait(client, submit("dup.jsonl", [_line("a", messages=_chat("x")), _line("b", messages=_chat("y")),
                                             _line("a", messages=_chat("z"))]).id)
    assert dup.status == "failed" and [(x.code, x.line) for x in dup.errors.data] == [("duplicate_custom_id", 3)]

    small = [_wait(client, submit(f"s{k}.jsonl", [_line(f"r{i}", model=ALIAS, messages=_chat(f"{k} {i}"))
                                                  for i in range(3)]).id) for k in range(2)]
    for done in small:  # each report counts its own batch, not everything since the server started
        assert done.status == "completed"
        out = _by_id(client.files.content(done.output_file_id).text)
        report = json.loads((api.data / "batches" / done.id / "report.json").read_text())
        assert report["requests"]["ok"] == 3
        assert report["tokens"]["generated"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                                    for r in out.values())
        assert {r["response"]["body"]["model"] for r in out.values()} == {ALIAS}

    # (far more than a quiet machine answers in the window)
    long = submit("long.jsonl", [_line(f"r{i}", messages=_chat(f"topic {i}"), max_tokens=8) for i in range(3000)])
    assert long.expires_at - long.created_at == WINDOW_S
    done = _wait(client, long.id, timeout=120)
    assert done.status == "expired" and done.expired_at >= long.expires_at
    out = _by_id(client.files.content(done.output_file_id).text) if done.output_file_id else {}
    err = _by_id(client.files.content(done.error_file_id).text)
    assert len(out) + len(err) == 3000 and not set(out) & set(err) and len(err) > 0
    assert {r["error"]["code"] for r in err.values()} == {"batch_expired"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(err))
    report = json.loads((api.data / "batches" / done.id / "report.json").read_text())
    assert report["requests"]["ok"] == len(out)  # kept for a batch that did not complete

    cancelled = submit("cancel.jsonl", [_line(f"c{i}", messages=_chat(f"topic {i}"), max_tokens=8)
                                        for i in range(3000)])
    _wait(client, cancelled.id, until=("in_progress",))
    deadline = time.time() + 60
    while not (api.data / "batches" / cancelled.id / "run.jsonl").exists() or not (
            api.data / "batches" / cancelled.id / "run.jsonl").read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    client.batches.cancel(cancelled.id)
    done = _wait(client, cancelled.id)
    assert done.status == "cancelled"
    report = json.loads((api.data / "batches" / done.id / "report.json").read_text())
    assert report["requests"]["ok"] == done.request_counts.completed


def test_health_answers_quickly_while_the_server_is_busy(api, tmp_path):
    client = api.client()
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "enum": [f"v{i}", f"w{i}"]}
                                               for i in range(40)}, "required": [f"field_{i}" for i in range(40)]}
    busy = {}

    def upload():
        busy["file"] = client.files.create(file=(tmp_path / "big.jsonl").open("rb"), purpose="batch")

    def constrained():
        busy["chat"] = client.chat.completions.create(model=ALIAS, messages=_chat("x"), max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    with open(tmp_path / "big.jsonl", "wb") as f:
        row = (json.dumps(_line("r", messages=_chat("x" * 900))) + "\n").encode()
        f.write(row * (200 * 1000 * 1000 // len(row)))
    threads = [threading.Thread(target=upload), threading.Thread(target=constrained)]
    threads[0].start()
    while not list((api.data / "tmp").iterdir()):  # the upload is streaming in
        time.sleep(0.01)
    threads[1].start()
    times = []  # of the probes made while the upload was still going
    while len(times) < 50 and threads[0].is_alive():
        t = time.perf_counter()
        assert _raw(api.url + "/health")[0] == 200
        if threads[0].is_alive():
            times.append(time.perf_counter() - t)
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert busy["file"].bytes > 190_000_000 and busy["chat"].choices[0].message.content is not None
    assert len(times) >= 20, f"the upload ended after {len(times)} probes: too few to measure"
    assert statistics.quantiles(times, n=20)[-1] < 0.1, sorted(times)[-5:]


def _lines_written(path: Path) -> int:
    return sum(1 for x in path.read_text().splitlines() if x.strip()) if path.exists() else 0


def test_a_batch_keeps_its_shared_prefix_while_online_requests_join(api, tmp_path):
    """The scheduler issue: the server no longer drops a batch's shared prefix so that online
    requests can join; they sit beside its rows, the prefix masked for them. The overlap is
    shown, not assumed: the request is sent once the batch has written its first answers and
    answered while most of them are still to come (its run file short of its lines, the batch
    in_progress), /health counts it as having joined a run already going, and its answer is
    the one the same request gets from the idle server afterwards (which joins nothing)."""
    client = api.client()
    instruction = ("You are a careful labeller. Read the item below and answer with one word: positive, negative "
                   "or neutral. Think about the tone of the whole item before you answer.")
    lines = [_line(f"p{i}", model=ALIAS, max_tokens=8, messages=[{"role": "system", "content": instruction},
                                                                {"role": "user", "content": f"item number {i}"}])
             for i in range(24)]
    f = client.files.create(file=_write(tmp_path / "prefix.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    run = api.data / "batches" / b.id / "run.jsonl"
    deadline = time.time() + 120
    while not _lines_written(run):  # the batch is stepping: its first answers are written
        assert time.time() < deadline and client.batches.retrieve(b.id).status in ("validating", "in_progress")
        time.sleep(0.02)
    before = _raw(api.url + "/health")[1]["online"]
    ask = dict(model=ALIAS, messages=_chat("the sea"), max_tokens=3)
    joined = client.chat.completions.create(**ask)
    written, status = _lines_written(run), client.batches.retrieve(b.id).status
    after = _raw(api.url + "/health")[1]["online"]
    assert written < 24 and status == "in_progress", f"the batch ended ({written} lines, {status}) before the answer"
    assert (after["requests"] - before["requests"], after["joined"] - before["joined"]) == (1, 1), (before, after)
    done = _wait(client, b.id)
    assert done.status == "completed" and done.request_counts.completed == 24
    prefix = json.loads((api.data / "batches" / b.id / "report.json").read_text())["prefix_cache"]
    assert prefix["status"] == "shared" and prefix["lines"] == 24 and prefix["prefix_tokens"] >= 16
    alone = client.chat.completions.create(**ask)  # the server idle now: it runs by itself
    assert _raw(api.url + "/health")[1]["online"]["joined"] == after["joined"]
    assert joined.choices[0].message.content and joined.usage.completion_tokens > 0
    assert (joined.choices[0].message.content, joined.choices[0].finish_reason, joined.usage) == (
        alone.choices[0].message.content, alone.choices[0].finish_reason, alone.usage)


def test_sixty_four_concurrent_online_requests_during_a_batch_are_all_answered(api, tmp_path):
    """The engine-core issue: 64 online requests sent at once from 64 threads while a batch is
    stepping (its first answers written, most still to come) are all answered, none refused
    or failed, each with the answer the idle server gives the same request afterwards."""
    import concurrent.futures

    client = api.client()
    lines = [_line(f"c{i}", model=ALIAS, max_tokens=8, messages=_chat(f"item {i}")) for i in range(24)]
    f = client.files.create(file=_write(tmp_path / "busy.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    run = api.data / "batches" / b.id / "run.jsonl"
    deadline = time.time() + 120
    while not _lines_written(run):
        assert time.time() < deadline and client.batches.retrieve(b.id).status in ("validating", "in_progress")
        time.sleep(0.02)
    before = _raw(api.url + "/health")[1]["online"]
    topics = ["the sea", "a cat", "the moon", "bread"]
    asks = [dict(model=ALIAS, messages=_chat(topics[i % len(topics)]), max_tokens=3) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda ask: api.client().chat.completions.create(**ask), asks))
    written = _lines_written(run)
    after = _raw(api.url + "/health")[1]["online"]
    assert after["requests"] - before["requests"] == 64
    assert after["joined"] > before["joined"]  # (some joined the batch's run while it went: written = {written})
    done = _wait(client, b.id)
    assert done.status == "completed" and done.request_counts.completed == 24
    alone = {t: client.chat.completions.create(model=ALIAS, messages=_chat(t), max_tokens=3) for t in topics}
    for ask, got in zip(asks, answers):
        want = alone[ask["messages"][0]["content"][len("Tell me about "):]]
        assert (got.choices[0].message.content, got.choices[0].finish_reason, got.usage) == (
            want.choices[0].message.content, want.choices[0].finish_reason, want.usage)
    health = _raw(api.url + "/health")
    assert health[0] == 200 and health[1]["online"]["waiting"] == 0


def test_a_batch_interleaving_three_instructions_shares_each(api, tmp_path):
    """The prefix-groups issue: a Batch API batch whose lines interleave three system
    instructions line by line prefills each once; its report lists the three, four lines each."""
    client = api.client()
    instructions = ["You are a careful labeller. Read the item below and answer with one word: positive, negative "
                    "or neutral. Think about the tone of the whole item before you answer.",
                    "Translate the user's sentence into French, keeping its meaning and its tone exactly as they "
                    "are, and answer with the translation alone.",
                    "Classify the topic of the user's news headline as sport, politics, science or business, and "
                    "answer with that one word only."]
    lines = [_line(f"q{i}", model=ALIAS, max_tokens=3, messages=[{"role": "system", "content": instructions[i % 3]},
                                                               {"role": "user", "content": f"item number {i}"}])
             for i in range(12)]
    f = client.files.create(file=_write(tmp_path / "three.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = _wait(client, b.id)
    assert done.status == "completed" and done.request_counts.completed == 12
    prefix = json.loads((api.data / "batches" / b.id / "report.json").read_text())["prefix_cache"]
    assert prefix["status"] == "shared" and prefix["lines"] == 12
    assert sum(1 for p in prefix["prefixes"] if p["lines"] == 4 and p["prefills"] == 1) == 3
