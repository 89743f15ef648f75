"""The online endpoints, /v1/chat/completions and /v1/completions: a request is checked by the
job line's own rules (klotski/io/requests.py) and tokenized (its grammar compiled) in the
thread pool, then waits in the worker's inbox for the engine (klotski/serve/worker.py).

* Answered whole, or streamed (`stream: true`) token by token as server-sent events in
  OpenAI's chunk shape (klotski/serve/stream.py): each sample's `listener` is called on the
  engine's thread after every step that added to it, and hands what it made to the event loop.
* A client that leaves (a stream closed, or a connection dropped while its answer is made:
  polled every POLL_S) sets `leaving` on its sequences: the engine ends them at its next
  step and their rows free, or they leave the inbox if not yet taken.
* A full inbox (--max-waiting) is a 429 with Retry-After; a server that cannot run the
  request (stopping, its engine's thread gone) a 503 at once.
* Nothing heavier than a dict is built on the event loop: checking the line, tokenizing,
  compiling grammars, building the answer and checking it against the `openai` package's
  ChatCompletion or Completion, and a stream's chunks (detokenizing, JSON) run in the thread
  pool.
"""
from __future__ import annotations

import asyncio
import re
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion

from klotski.io.jobs import claim_items
from klotski.io.records import finished_record
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL, LineError
from klotski.schedule.sequences import prepare
from klotski.serve.deps import Problem, Served, authorized, json_body, served
from klotski.serve.worker import not_served
from klotski.serve.stream import DONE, Chunks, error_event, event
from klotski.schedule.scheduler import QueueFull

router = APIRouter(dependencies=[Depends(authorized)])
FIELD = re.compile(r"body\.([A-Za-z_][\w.\[\]]*) ")  # the field a request's error message starts with
POLL_S = 0.25  # how often a request waiting for its whole answer checks that its client is still there
RETRY_AFTER_S = 1  # what a 429 asks a client to wait


@router.post("/v1/chat/completions")
async def chat(request: Request, s: Served = Depends(served)):
    return await online(request, s, CHAT_URL)


@router.post("/v1/completions")
async def completions(request: Request, s: Served = Depends(served)):
    return await online(request, s, COMPLETIONS_URL)


async def online(request: Request, s: Served, url: str):
    body = await json_body(request)
    if body.get("model") not in (None, *s.names):
        raise Problem(404, not_served(body.get("model"), s.names), "model_not_found", "model")
    stream, usage = streaming(body)
    seqs = await run_in_threadpool(_prepare, s, url, body, stream)
    if not stream:
        samples = await _answered(request, seqs, _put(s, seqs))
        return await run_in_threadpool(_answer, s, url, samples)
    loop, heard = asyncio.get_running_loop(), asyncio.Queue()
    for seq in seqs:
        seq.listener = _listener(loop, heard, seq.sample)
    future = _put(s, seqs)
    if future.done() and future.exception() is not None:  # (the inbox is closed: nothing would answer)
        raise _unavailable(future.exception())
    asyncio.wrap_future(future).add_done_callback(_answered_to(heard))
    chunks = Chunks(seqs, s.detokenizer, url, s.names[0], usage=usage)
    return StreamingResponse(_events(seqs, chunks, heard), media_type="text/event-stream")


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request, refused with a 400 where they are not OpenAI's."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream not in (None, True, False):
        raise Problem(400, f"stream must be true or false, got {stream!r}", "invalid_request", "stream")
    if options is None:
        return stream is True, False
    if stream is not True:
        raise Problem(400, "stream_options is only allowed when stream is true", "invalid_request", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            options.get("include_usage", False) not in (True, False):
        raise Problem(400, f"stream_options must be {{\"include_usage\": true or false}}, got {options!r}",
                      "invalid_request", "stream_options")
    return True, options.get("include_usage", False)


def _prepare(s: Served, url: str, body: dict, stream: bool) -> list:
    """The request's sequences, checked and tokenized as a job line is (in the thread pool)."""
    line = {"custom_id": f"online-{uuid.uuid4().hex}", "method": "POST", "url": url,
            "body": {k: v for k, v in body.items() if k not in ("stream", "stream_options")}}
    item = next(iter(claim_items([(1, 0, 0, line, None)])))
    if isinstance(item, LineError):
        raise _refused(item.message, item.code)
    if stream and item.choice_logprobs:
        raise Problem(400, "choice_logprobs is not available when streaming; send stream: false",
                      "invalid_request", "choice_logprobs")
    with s.tok_lock:  # (the engine's reader has a tokenizer of its own)
        seqs, errors = prepare([item], s.tokenizer, s.spec, s.config)
    if errors:
        raise _refused(errors[0].message, errors[0].code)
    return seqs


def _put(s: Served, seqs: list):
    try:
        return s.inbox.put(seqs)
    except QueueFull as e:
        raise Problem(429, f"the server is busy ({e}); retry after {RETRY_AFTER_S} s", "too_many_requests",
                      headers={"Retry-After": str(RETRY_AFTER_S)}) from None


def _unavailable(e: BaseException) -> Problem:
    return Problem(503, f"the request could not be run: {e}; retry", "unavailable")


async def _answered(request: Request, seqs: list, future) -> list:
    """The finished samples, once the engine made them; a client that leaves meanwhile sets
    its sequences `leaving` (nobody reads the reply)."""
    waiting = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=POLL_S)
            if done:
                break
            if await request.is_disconnected():
                _leave(seqs)
                raise Problem(400, "the client disconnected before its answer was made", "client_disconnected")
    except asyncio.CancelledError:
        _leave(seqs)
        raise
    try:
        return waiting.result()
    except RuntimeError as e:
        raise _unavailable(e) from None


def _answer(s: Served, url: str, samples: list) -> dict:
    """The whole answer, checked against the `openai` package's type (in the thread pool)."""
    record, failed = finished_record(samples, fmt="openai", model=s.names[0])
    if failed is not None:
        raise Problem(500, f"the model could not answer: {failed.message}", "model_error")
    answer = record["response"]["body"]
    (ChatCompletion if url == CHAT_URL else Completion).model_validate(answer)
    return answer


def _answered_to(heard: asyncio.Queue):
    """The inbox's answer, handed to the stream after its samples' last news (its failure marked
    read: a stream that has ended no longer reads it)."""
    def answered(future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()
        heard.put_nowait(future)
    return answered


def _listener(loop, heard: asyncio.Queue, sample: int):
    """What the engine's thread calls after each step that added to a sample: its state then
    (what it made, and once done its finish reason, text and error), handed to the event loop."""
    def listener(seq) -> None:
        try:
            loop.call_soon_threadsafe(heard.put_nowait, (sample, len(seq.out), seq.finish_reason, seq.text, seq.error))
        except RuntimeError:  # the event loop has closed (the server stops): nobody is listening
            pass
    return listener


async def _events(seqs: list, chunks: Chunks, heard: asyncio.Queue):
    """The stream: each sample's chunks as its tokens come, then usage, then [DONE]. Closed or
    cancelled before the end (the client left), its sequences are set `leaving`. The event
    loop only waits and passes text on: the chunks (detokenizing, JSON) are made in the
    thread pool."""
    try:
        if opening := await run_in_threadpool(lambda: "".join(map(event, chunks.opening()))):
            yield opening
        going = set(range(len(seqs)))
        while going:
            heard_now, news = [await heard.get()], []
            while not heard.empty():  # what came meanwhile goes out together
                heard_now.append(heard.get_nowait())
            for item in heard_now:
                if not isinstance(item, asyncio.Future):
                    news.append(item)
                elif item.exception() is not None:  # the inbox's answer: failed
                    news.append(error_event(f"the request could not be run: {item.exception()}; retry",
                                            "unavailable", 503))
                    break
                else:  # all done: every sample's last news came before it; should one not have, it is read now
                    news.extend((i, len(s.out), s.finish_reason, s.text, s.error) for i, s in enumerate(seqs))
            said, ended = await run_in_threadpool(_said, chunks, news, going)
            if said:
                yield said
            if ended:
                return
    finally:
        _leave(seqs)


def _said(chunks: Chunks, news: list, going: set) -> tuple[str, bool]:
    """The events `news` make (each sample's progress, in order; an error event is the last
    word), the usage and [DONE] once no sample is `going`; and whether the stream has ended.
    In the thread pool."""
    out = []
    for item in news:
        if isinstance(item, str):  # (an error event)
            return "".join([*out, item]), True
        sample, made, finish, text, error = item
        if sample not in going:
            continue
        if finish == "error":
            return "".join([*out, error_event(f"the model could not answer: {error}", "model_error")]), True
        out.extend(map(event, chunks.progress(sample, made, finish, text)))
        if finish is not None:
            going.discard(sample)
    if not going:
        out.extend([*map(event, chunks.closing()), DONE])
    return "".join(out), not going


def _leave(seqs: list) -> None:
    for seq in seqs:
        if not seq.done:
            seq.leaving = True


def _refused(message: str, code: str) -> Problem:
    """A 400 for a request the job-line rules refuse, worded for a request and naming its field."""
    field = FIELD.match(message)
    message = message.removeprefix("body.").replace("the line", "the request")
    return Problem(400, message, code, field.group(1) if field else None)
