"""The online endpoints, /v1/chat/completions and /v1/completions: a request is checked by the
job line's own rules (klotski/io/requests.py), tokenized (and its grammar compiled) in the
thread pool, then waits in the worker's inbox for the engine (klotski/serve/worker.py). A
server that cannot run it (stopping, its engine's thread gone) answers 503 at once; the
answer is checked against the `openai` package's ChatCompletion or Completion before it
leaves."""
from __future__ import annotations

import asyncio
import json
import re
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion

from klotski.io.jobs import claim_items
from klotski.io.records import result_record
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL, LineError
from klotski.runtime.sequences import prepare
from klotski.serve.deps import Problem, Served, authorized, json_body, served

router = APIRouter(dependencies=[Depends(authorized)])
FIELD = re.compile(r"body\.([A-Za-z_][\w.\[\]]*) ")  # the field a request's error message starts with


@router.post("/v1/chat/completions")
async def chat(request: Request, s: Served = Depends(served)):
    return await online(request, s, CHAT_URL)


@router.post("/v1/completions")
async def completions(request: Request, s: Served = Depends(served)):
    return await online(request, s, COMPLETIONS_URL)


async def online(request: Request, s: Served, url: str):
    body = await json_body(request)
    if body.get("model") not in (None, *s.names):
        raise Problem(404, f"model {body.get('model')!r} is not served here; this server serves "
                           f"{' or '.join(map(repr, s.names))}", "model_not_found", "model")
    stream = body.get("stream") is True
    line = {"custom_id": f"online-{uuid.uuid4().hex}", "method": "POST", "url": url,
            "body": {k: v for k, v in body.items() if k not in ("stream", "stream_options")}}
    item = next(iter(claim_items([(1, 0, 0, line, None)])))
    if isinstance(item, LineError):
        raise _refused(item.message, item.code)
    seqs, errors = await run_in_threadpool(_prepare, s, item)
    if errors:
        raise _refused(errors[0].message, errors[0].code)
    try:
        samples = await asyncio.wrap_future(s.inbox.put(seqs))
    except RuntimeError as e:
        raise Problem(503, f"the request could not be run: {e}; retry", "unavailable") from None
    if failed := next((x for x in samples if x.error), None):
        raise Problem(500, f"the model could not answer: {failed.error}", "model_error")
    answer = result_record(samples, fmt="openai", model=s.names[0])["response"]["body"]
    (ChatCompletion if url == CHAT_URL else Completion).model_validate(answer)
    if not stream:
        return answer
    return StreamingResponse(sse(answer, url), media_type="text/event-stream")


def _prepare(s: Served, item):
    with s.tok_lock:  # (the engine's reader has a tokenizer of its own)
        return prepare([item], s.tokenizer, s.spec, s.config)


def _refused(message: str, code: str) -> Problem:
    """A 400 for a request the job-line rules refuse, worded for a request and naming its field."""
    field = FIELD.match(message)
    message = message.removeprefix("body.").replace("the line", "the request")
    return Problem(400, message, code, field.group(1) if field else None)


def sse(answer: dict, url: str):
    """The answer as server-sent events: each choice's whole text in one chunk (it is
    generated before the reply starts), its finish reason in the next, then [DONE]."""
    base = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
    for choice in answer["choices"]:
        i = choice["index"]
        if url == CHAT_URL:
            kind = "chat.completion.chunk"
            first = {"index": i, "delta": {"role": "assistant", "content": choice["message"]["content"]},
                     "finish_reason": None}
            last = {"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}
        else:
            kind = "text_completion"
            first = {"index": i, "text": choice["text"], "finish_reason": None}
            last = {"index": i, "text": "", "finish_reason": choice["finish_reason"]}
        for part in (first, last):
            yield f"data: {json.dumps({**base, 'object': kind, 'choices': [part]})}\n\n"
    yield "data: [DONE]\n\n"
