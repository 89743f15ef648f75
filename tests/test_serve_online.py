"""`klotski serve`'s online endpoints (issue 48 parts 2 and 3), on a real uvicorn server driven
by the official `openai` client: streamed answers arrive token by token, usage last, and join
to the answer not streamed; a stop string split across tokens never reaches the client; a
client that leaves (streaming or not) frees its row at once (on the server and, in process,
on the engine's own step loop, the others' answers transformers' own); a full inbox is a 429
with Retry-After."""
import functools
import json
import socket
import threading
import time
import types

import openai
import pytest

from test_serve import KEY, Server, _chat, _raw

LONG = 900  # tokens a long request asks for: far more steps than the tests wait


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints["gqa"])


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("online") / "data", "--api-key", KEY, "--max-waiting", "1")
    yield s
    assert s.stop() in (0, 143), s.log.read_text()


def _online(server) -> dict:
    return _raw(server.url + "/health")[1]["online"]


def _until(check, what: str, timeout: float = 60):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_the_openai_client_streams_token_by_token_with_usage_last(server, model):
    client = server.client()
    ask = dict(model=model, messages=_chat("rivers"), max_tokens=12, n=2, temperature=0, logprobs=True,
               top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert sum(bool(c.delta.content) for c in mine) > 3  # token by token
        assert [e for c in mine if c.logprobs for e in c.logprobs.content] == choice.logprobs.content
    text = client.completions.create(model=model, prompt="Paris is", max_tokens=8)
    streamed = list(client.completions.create(model=model, prompt="Paris is", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == text.choices[0].finish_reason


def test_a_stop_string_split_across_tokens_never_reaches_the_client(server, model):
    client = server.client()
    free = client.chat.completions.create(model=model, messages=_chat("music"), max_tokens=16,
                                          logprobs=True).choices[0]
    tokens = [e.token for e in free.logprobs.content]
    # a stop string that begins inside one token and ends inside a later one
    start = sum(map(len, tokens[:4]))
    stop = free.message.content[start - 1:start + len(tokens[4]) + 1]
    assert len(stop) >= 3 and stop.strip(), (tokens, stop)
    expected = free.message.content[:free.message.content.index(stop)]
    stream = client.chat.completions.create(model=model, messages=_chat("music"), max_tokens=16, stop=[stop],
                                            stream=True)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.delta.content or "" for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"


def test_sampling_fields_and_lists_of_prompts_online_streamed_or_not(server, model):
    """Issue 62's fields through the openai client (vLLM's as extra_body): a list of prompts gives
    one choice per prompt, streamed as it is answered whole; a value out of range is a 400
    naming its field and range."""
    client = server.client()
    # greedy (the penalties, bias and min_tokens still shape the pick): an online request's id, and so
    # its samples' streams past the first, is new each time
    fields = dict(model=model, prompt=["Paris is", "The river"], max_tokens=8, n=2, temperature=0, seed=5,
                  top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"7": 3},
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4})
    whole = client.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert all(len(c.text) > 0 for c in whole.choices) and whole.usage.completion_tokens >= 16
    streamed = list(client.completions.create(**fields, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text  # the same answer, streamed
    with pytest.raises(openai.BadRequestError, match=r"min_p must be a number in \[0, 1\], got 2") as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"min_p": 2})
    assert e.value.body["param"] == "min_p"


def test_stream_options_without_stream_is_refused(server, model):
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed when stream is true") as e:
        server.client().chat.completions.create(model=model, messages=_chat("x"), max_tokens=2,
                                                stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_a_streaming_client_that_leaves_frees_its_row(server, model):
    client = server.client()
    before = _online(server)
    stream = client.chat.completions.create(model=model, messages=_chat("the sea"), max_tokens=LONG, stream=True)
    got = [next(stream) for _ in range(3)]
    assert got[0].choices[0].delta.role == "assistant"
    stream.close()
    _until(lambda: _online(server)["left"] == before["left"] + 1, "the request did not end when its client left")
    _until(lambda: _online(server)["in_engine"] == 0, "its row is still held")
    after = _online(server)
    assert after["steps"] - before["steps"] < LONG // 4  # it stopped, long before its max_tokens
    # a short request after it is answered, not queued behind it
    assert client.chat.completions.create(model=model, messages=_chat("x"), max_tokens=2).choices[0].message


def test_a_client_that_hangs_up_before_its_answer_frees_its_row(server, model):
    before = _online(server)
    body = json.dumps({"model": model, "messages": _chat("bread"), "max_tokens": LONG}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        _until(lambda: _online(server)["in_engine"] == 1, "the request did not start")
    _until(lambda: _online(server)["left"] == before["left"] + 1, "the request did not end when its client left")
    _until(lambda: _online(server)["in_engine"] == 0, "its row is still held")
    assert _online(server)["steps"] - before["steps"] < LONG // 4


def test_a_full_inbox_answers_429_with_retry_after(server, model):
    client = server.client()
    running = client.chat.completions.create(model=model, messages=_chat("cats"), max_tokens=LONG // 2, stream=True)
    next(running)
    _until(lambda: _online(server)["in_engine"] == 1, "the first request did not start")
    # longer than the running group's rows: it waits in the inbox for that run to end
    waiting = client.chat.completions.create(model=model, messages=_chat("dogs"), max_tokens=LONG, stream=True)
    answered = threading.Thread(target=lambda: next(waiting))
    answered.start()
    _until(lambda: _online(server)["waiting"] == 1, "the second request is not waiting")
    with pytest.raises(openai.RateLimitError, match="busy") as e:
        client.chat.completions.create(model=model, messages=_chat("x"), max_tokens=2)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["code"] == "too_many_requests"
    running.close()
    answered.join(60)
    waiting.close()
    _until(lambda: _online(server)["in_engine"] == 0 and _online(server)["waiting"] == 0, "rows still held")
    assert client.chat.completions.create(model=model, messages=_chat("x"), max_tokens=2).choices[0].message


def test_the_inbox_bounds_requests_counting_a_requests_samples_once():
    """Without a server: `--max-waiting` counts requests (a request's n samples once)."""
    from klotski.schedule.scheduler import QueueFull as Full
    from klotski.schedule.scheduler import Waiting
    from klotski.schedule.sequences import Sequence
    from klotski.schedule.engine import Engine
    from klotski.serve.worker import Inbox

    def request(n):
        seqs = [Sequence(None, [1, 2], 4, 0.0, 1.0, (), None, sample=i) for i in range(n)]
        for s in seqs:
            s.samples = seqs
        return seqs
    engine = types.SimpleNamespace(waiting=Waiting())  # the engine's queue and its one way in, alone
    engine.add_request = functools.partial(Engine.add_request, engine)
    inbox = Inbox(engine, max_waiting=2)
    inbox.put(request(3))
    inbox.put(request(1))
    with pytest.raises(Full):
        inbox.put(request(1))
    assert inbox.counts() == {"waiting": 2, "in_engine": 0, "left": 0}


def test_a_leaver_frees_its_row_while_the_engine_steps_and_the_others_finish(checkpoints):
    """In process, on the engine's own step loop (what the server's worker runs: `run([])`
    while anything waits or runs), requests put through the Inbox as the endpoints put them:
    one asks for 200 tokens and its client leaves after its third (`leaving` set from its
    listener, between two steps, as an HTTP thread sets it); a request of three samples leaves
    while still in the queue; two others run beside them. The leaver is answered at once with
    `abort` and transformers' first three tokens, and its row is computed no more: no later step
    computes as many rows as before, and the run ends with the others, far short of 200 steps;
    the queue's leaver is answered `abort` without a token; the others' tokens are
    transformers' own; /health's counts end at nothing waiting or held and four left."""
    import dataclasses
    from conftest import PROMPTS, reference_tokens, requests
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.serve.worker import Inbox
    model, long, short = checkpoints["gqa"], 200, 8
    reqs = requests(PROMPTS[:3], short)
    reqs[0] = dataclasses.replace(reqs[0], max_new_tokens=long)
    reqs.append(dataclasses.replace(requests(PROMPTS[3:4], short)[0], id="queued", n=3))
    ref = reference_tokens(model, PROMPTS[:3], short)
    assert len(ref[0]) > 3  # (the leaver would run on past its third token)
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", device="cpu", batch_size=3, num_batches=1)
    engine, seqs, errors = open_engine(cfg, reqs)
    assert not errors
    by_id = {}
    for s in seqs:
        by_id.setdefault(s.request.id, []).append(s)
    rows, left_at = [], []  # rows computed by each step (at its first layer); the step the client left after

    def leave_after_three(s):
        if len(s.out) == 3 and not s.leaving:
            s.leaving = True
            left_at.append(len(rows))
    engine.pipeline.on_layer = lambda layer, hs: rows.append(sum(h.shape[0] for h in hs)) if layer == 0 else None
    by_id["r0"][0].listener = leave_after_three
    inbox = Inbox(engine, max_waiting=8)
    futures = {rid: inbox.put(samples) for rid, samples in by_id.items()}
    for s in by_id["queued"]:
        s.leaving = True  # its client left before the engine took it in
    try:
        list(engine.run([]))
    finally:
        engine.close()
    assert all(f.done() for f in futures.values()), "a request was never answered"
    answered = {rid: f.result() for rid, f in futures.items()}
    assert [(s.finish_reason, s.out) for s in answered["queued"]] == [("abort", [])] * 3
    (leaver,) = answered["r0"]
    assert (leaver.finish_reason, leaver.out) == ("abort", ref[0][:3])
    assert [answered[rid][0].out for rid in ("r1", "r2")] == ref[1:]
    assert inbox.counts() == {"waiting": 0, "in_engine": 0, "left": 4}
    (k,) = left_at
    assert max(rows[:k]) == 3 and max(rows[k:], default=0) < 3, (k, rows)  # its row freed at the next step
    assert len(rows) < long // 4  # the run ended with the others, long before the leaver's 200
