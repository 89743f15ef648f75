"""The server's event loop does no work (issue 59): a stream's text is decoded once, in windows
of a few tokens (linear in the answer, stray bytes included), off the event loop; a crash file
and every fsync are written off it; DELETE /v1/files never waits for a batch's state being
fsynced (the store's lock is never held across a write). In process, without an engine: the
app is called as an ASGI app on an event loop of the test's own."""
import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from klotski.builtin.tokenizer import save_tokenizer
from klotski.io.requests import CHAT_URL, Request
from klotski.schedule import sequences as S
from klotski.serve import online
from klotski.serve.app import make_app
from klotski.serve.batches import _refused
from klotski.serve.deps import Served
from klotski.serve.store import Store
from klotski.serve.stream import DONE, Chunks, TextStream

TEXT = "Zürich, naïve café: 日本語の川 😀 and the river flows to the sea. "
SLOW_S = 1.5  # an fsync made this slow


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d, 512, 1024)
    return AutoTokenizer.from_pretrained(d)


def _gpt2_byte(b: int) -> str:
    """The character a byte-level BPE vocabulary spells byte `b` with (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


class Counting:
    """A tokenizer whose decodes are counted (calls and characters), and checked to run off
    any event loop."""

    def __init__(self, tok):
        self.tok, self.calls, self.chars, self.on_loop = tok, 0, 0, 0

    def decode(self, ids, **kw):
        text = self.tok.decode(ids, **kw)
        self.calls, self.chars, self.on_loop = self.calls + 1, self.chars + len(text), self.on_loop + _on_loop()
        return text

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_long_answer_is_decoded_once_in_linear_work(tok):
    stray = tok.convert_tokens_to_ids(_gpt2_byte(0x80))  # a continuation byte alone: never a character
    ids = (tok(TEXT * 20, add_special_tokens=False)["input_ids"] + [stray] * 300
           + tok(TEXT * 5 + "end.", add_special_tokens=False)["input_ids"])
    full = tok.decode(ids, skip_special_tokens=True)
    assert any("\ufffd" in tok.decode([t]) for t in ids[:50])  # characters split over tokens
    counting = Counting(tok)
    stream, sent = TextStream(counting), ""
    for n in range(1, len(ids) + 1):  # one update per token, as the engine's steps make them
        delta, _, _ = stream.next(ids, made=n)
        sent += delta
        assert full.startswith(sent)  # never a character in part, never a wrong one
    assert sent == full
    # one decode per update (the window moving on costs one more every few tokens) where a
    # decode of what was read and another of what came would be two; a few characters of
    # window per character of answer, the 300 stray bytes included (decoded again per token,
    # they would be quadratic: ~45,000 characters)
    assert counting.calls <= 1.25 * len(ids), (counting.calls, len(ids))
    assert counting.chars <= 10 * len(full), (counting.chars, len(full))


def test_a_streams_chunks_are_made_off_the_event_loop(tok, monkeypatch):
    ids = tok(TEXT * 3, add_special_tokens=False)["input_ids"]
    req = Request(id="r", line=1, prompt=None, messages=(("user", "hi"),), openai=CHAT_URL)
    seq = S.Sequence(req, [1, 2, 3], max_new_tokens=len(ids), temperature=0.0, top_p=1.0, stop=(), generator=None)
    counting = Counting(tok)
    chunks = Chunks([seq], counting, CHAT_URL, "tiny", usage=True)
    dumped_on_loop, real_event = [], online.event

    def event(obj):
        dumped_on_loop.append(_on_loop())
        return real_event(obj)
    monkeypatch.setattr(online, "event", event)

    async def main() -> list[str]:
        heard, got = asyncio.Queue(), []
        for t in ids:  # the engine's news, token by token (its listener's tuples), then the answer
            seq.out.append(t)
            if len(seq.out) == len(ids):
                seq.finish_reason, seq.text = "length", tok.decode(seq.out, skip_special_tokens=True)
            heard.put_nowait((0, len(seq.out), seq.finish_reason, seq.text if seq.done else None, None))
        answered = asyncio.get_running_loop().create_future()
        answered.set_result([seq])
        heard.put_nowait(answered)
        async for said in online._events([seq], chunks, heard):
            got.append(said)
        return got

    said = "".join(asyncio.run(main()))
    events = [e.removeprefix("data: ") for e in said.split("\n\n") if e]
    assert events[-1] == DONE.strip().removeprefix("data: ")
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert content == tok.decode(ids, skip_special_tokens=True)
    assert counting.calls and not counting.on_loop and dumped_on_loop and not any(dumped_on_loop)


# ---- the store and the routes, as an ASGI app ------------------------------------------------


class Inbox:
    closed = None

    def notify(self):
        pass


def _served(root: Path) -> Served:
    return Served(store=Store(root), names=("tiny",), config=None, tokenizer=None, spec=None, inbox=Inbox(),
                  stats=None, worker=None, api_key=None, max_upload=1 << 20, max_body=1 << 20,
                  batch_window_s=3600)


async def _call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    given, status, parts = False, None, []

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # (the client never leaves)

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
    await app(scope, receive, send)
    return status, json.loads(b"".join(parts) or b"null")


def _a_file(store: Store, tmp_path: Path, name: str = "in.jsonl") -> str:
    src = tmp_path / name
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": CHAT_URL,
                               "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    return store.add_file(src, name, "batch")["id"]


def _slow_fsync_in(monkeypatch, thread_name: str) -> threading.Event:
    """os.fsync takes SLOW_S on the thread named `thread_name`; the event is set as it starts."""
    started, real = threading.Event(), os.fsync

    def fsync(fd):
        if threading.current_thread().name == thread_name:
            started.set()
            time.sleep(SLOW_S)
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return started


def test_delete_is_not_blocked_by_a_batch_state_being_fsynced(tmp_path, monkeypatch):
    s = _served(tmp_path / "data")
    fid = _a_file(s.store, tmp_path)
    bid = s.store.new_batch({"input_file_id": "file-" + "0" * 24, "endpoint": CHAT_URL})["id"]
    started = _slow_fsync_in(monkeypatch, "saver")
    saver = threading.Thread(target=s.store.update, args=(bid,), kwargs={"status": "in_progress"}, name="saver")
    saver.start()
    assert started.wait(10)
    t = time.monotonic()
    status, body = asyncio.run(_call(make_app(s), "DELETE", f"/v1/files/{fid}"))
    waited = time.monotonic() - t
    saver.join()
    assert status == 200 and body["deleted"] is True
    assert waited < SLOW_S / 3, f"DELETE waited {waited:.2f} s for another request's fsync"
    assert s.store.get_file(fid) is None and not s.store.content_path(fid).exists()
    assert json.loads((s.store.batch_dir(bid) / "batch.json").read_text())["status"] == "in_progress"


def test_a_batch_state_saved_while_another_save_is_slow_ends_newest_on_disk(tmp_path, monkeypatch):
    s = _served(tmp_path / "data")
    bid = s.store.new_batch({"input_file_id": "file-" + "0" * 24, "endpoint": CHAT_URL})["id"]
    started = _slow_fsync_in(monkeypatch, "first")
    first = threading.Thread(target=s.store.update, args=(bid,), kwargs={"status": "in_progress"}, name="first")
    first.start()
    assert started.wait(10)
    s.store.update(bid, status="cancelling")  # while the first save's fsync is under way
    first.join()
    assert s.store.batches[bid]["status"] == "cancelling" and not s.store.unsaved
    assert json.loads((s.store.batch_dir(bid) / "batch.json").read_text())["status"] == "cancelling"


def test_no_fsync_and_no_crash_file_is_written_on_the_event_loop(tmp_path, monkeypatch):
    s = _served(tmp_path / "data")
    fid, other = _a_file(s.store, tmp_path), _a_file(s.store, tmp_path, "other.jsonl")
    on_loop, real_fsync, real_crash = [], os.fsync, s.store.save_crash

    def fsync(fd):
        on_loop.append(("fsync", _on_loop()))
        real_fsync(fd)

    def save_crash(e):
        on_loop.append(("crash", _on_loop()))
        return real_crash(e)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(s.store, "save_crash", save_crash)
    real_get = s.store.get_file
    monkeypatch.setattr(s.store, "get_file", lambda f: (_ for _ in ()).throw(RuntimeError("a bug")) if f == other
                        else real_get(f))
    app = make_app(s)

    async def main():
        created = await _call(app, "POST", "/v1/batches", {"input_file_id": fid, "endpoint": CHAT_URL})
        cancelled = await _call(app, "POST", f"/v1/batches/{created[1]['id']}/cancel")
        crashed = await _call(app, "GET", f"/v1/files/{other}")
        return created, cancelled, crashed
    (c, _), (k, _), (x, error) = asyncio.run(main())
    assert (c, k, x) == (200, 200, 500) and "a bug" in error["error"]["message"]
    assert ("crash", False) in on_loop and ("fsync", False) in on_loop
    assert not [what for what, loop in on_loop if loop], on_loop
    assert len(list(s.store.crashes_dir.iterdir())) == 1


def test_a_model_not_served_is_said_one_way_everywhere(tmp_path):
    s = _served(tmp_path / "data")
    app = make_app(s)

    async def main():
        return (await _call(app, "GET", "/v1/models/gpt-4o"),
                await _call(app, "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": []}))
    (st1, model), (st2, chat) = asyncio.run(main())
    want = "model 'gpt-4o' is not served here; this server serves 'tiny'"
    assert (st1, st2) == (404, 404) and model["error"]["message"] == chat["error"]["message"] == want
    line = {"custom_id": "a", "url": CHAT_URL, "body": {"model": "gpt-4o"}}
    assert _refused(line, CHAT_URL, ("tiny",)) == ("model_not_found", "body." + want)
