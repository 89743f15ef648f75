"""The HTTP routes: OpenAI's Files and Batches APIs, the online completion endpoints, models,
and an unauthenticated /health. Bodies are checked against the `openai` package's own types
(FileObject, Batch, ChatCompletion, Completion) before they leave, so what the official
client parses is what was built. Every failure is one OpenAI-shaped error
(`{"error": {"message", "type", "param", "code"}}`) with its status; no request can take the
server down (an unexpected exception is a 500 with one line, the server goes on)."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from openai.types import Batch, Completion, FileObject
from openai.types.chat import ChatCompletion

from klotski.io.jobs import claim_items
from klotski.io.records import result_record
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL, LineError
from klotski.runtime.sequences import prepare
from klotski.serve.batches import validate
from klotski.serve.store import Store
from klotski.serve.upload import BadUpload, receive_upload
from klotski.serve.worker import log

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         409: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}}, status_code=status)


class Problem(Exception):
    """An error reply raised from inside a route."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.reply = error(status, message, code)


async def json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise Problem(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
    if not isinstance(body, dict):
        raise Problem(400, "the request body must be a JSON object", "invalid_json")
    return body


def make_app(store: Store, *, model: str, config, tokenizer, spec, inbox, stats, api_key: str | None,
             max_upload: int) -> FastAPI:
    app = FastAPI(title="klotski serve", docs_url=None, redoc_url=None, openapi_url=None)
    tok_lock = threading.Lock()  # the HTTP threads' one tokenizer (the engine's reader has its own)
    started = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not given.startswith("Bearer "):
                return error(401, "missing API key: send the header 'Authorization: Bearer KEY'", "missing_api_key")
            if not secrets.compare_digest(given[7:].encode(), api_key.encode()):
                return error(401, "incorrect API key", "invalid_api_key")
        try:
            return await call_next(request)
        except Problem as p:
            return p.reply
        except Exception as e:  # our bug: one line in the log and the reply; the server goes on
            log(f"internal error on {request.method} {request.url.path}: {type(e).__name__}: {e}")
            return error(500, f"internal error ({type(e).__name__}: {e})", "internal_error")

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        return error(400, f"malformed request: {first.get('msg', 'invalid body')} at "
                          f"{'.'.join(map(str, first.get('loc', ())))}", "invalid_request")

    @app.exception_handler(Problem)
    async def problem(request, exc: Problem):
        return exc.reply

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model, "online": vars(stats)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": started,
                                            "owned_by": "klotski"}]}

    # ---- files ---------------------------------------------------------------------------
    @app.post("/v1/files")
    async def upload(request: Request):
        length = request.headers.get("content-length")
        tmp = store.tmp_path()
        try:
            try:
                up = await receive_upload(request, tmp, max_upload)
            except BadUpload as e:
                raise Problem(400, str(e), "invalid_upload") from None
            if up.too_big or (length and length.isdigit() and int(length) > max_upload + 64 * 1024):
                raise Problem(413, f"the file is {up.size} bytes, over this server's limit of {max_upload} bytes "
                                   "(--max-upload-size); split it into smaller files", "file_too_large")
            purpose = up.fields.get("purpose")
            if purpose != "batch":
                raise Problem(400, f"purpose must be 'batch', got {purpose!r}", "invalid_purpose")
            meta = store.add_file(tmp, up.filename, purpose)
        finally:
            tmp.unlink(missing_ok=True)
        return FileObject.model_validate(meta).model_dump()

    def file_or_404(file_id: str) -> dict:
        meta = store.get_file(file_id)
        if meta is None:
            raise Problem(404, f"no such file: {file_id!r}", "file_not_found")
        return meta

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10000, after: str | None = None):
        return page([f for f in store.files.values() if purpose in (None, f["purpose"])], after, limit)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        return file_or_404(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        file_or_404(file_id)
        return FileResponse(store.content_path(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        file_or_404(file_id)
        if user := store.file_in_use(file_id):
            raise Problem(409, f"file {file_id} is in use by batch {user}, which has not finished; "
                               "cancel it or wait for it", "file_in_use")
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches -------------------------------------------------------------------------
    def batch_or_404(batch_id: str) -> dict:
        batch = store.get_batch(batch_id)
        if batch is None:
            raise Problem(404, f"no such batch: {batch_id!r}", "batch_not_found")
        return Batch.model_validate(batch).model_dump()

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        body = await json_body(request)
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(fid, str):
            raise Problem(400, "input_file_id is required (the id files.create returned)", "invalid_request")
        meta = file_or_404(fid)
        if meta["purpose"] != "batch":
            raise Problem(400, f"file {fid} has purpose {meta['purpose']!r}; upload the input with purpose 'batch'")
        if endpoint not in ENDPOINTS:
            raise Problem(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "invalid_endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise Problem(400, f"completion_window must be '24h', got {body.get('completion_window')!r}")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise Problem(400, "metadata must be an object of at most 16 string keys and string values")
        created = int(time.time())
        batch = store.new_batch({"input_file_id": fid, "endpoint": endpoint, "completion_window": "24h",
                                 "metadata": metadata, "expires_at": created + 24 * 3600})  # on disk before the reply
        threading.Thread(target=validate_then_wake, args=(batch["id"],), daemon=True).start()
        return Batch.model_validate(batch).model_dump()

    def validate_then_wake(batch_id: str) -> None:
        try:
            validate(store, batch_id, model)
        except Exception as e:  # an unreadable input on the server's own disk: the batch fails, not the server
            store.update(batch_id, status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [
                {"code": "validation_failed", "line": None, "param": None, "message": str(e)}]})
        inbox.notify()

    app.state.validate = validate_then_wake

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None):
        return page(list(store.batches.values()), after, limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return batch_or_404(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str):
        batch_or_404(batch_id)
        if store.update(batch_id, only_if=("validating", "in_progress"), status="cancelling",
                        cancelling_at=int(time.time())):
            inbox.notify()
        elif store.batches[batch_id]["status"] not in ("cancelling", "cancelled"):
            raise Problem(409, f"batch {batch_id} is {store.batches[batch_id]['status']}; only a batch that has not finished "
                               "can be cancelled", "batch_not_cancellable")
        return batch_or_404(batch_id)

    # ---- online --------------------------------------------------------------------------
    async def online(request: Request, url: str):
        body = await json_body(request)
        if body.get("model") not in (None, model):
            raise Problem(404, f"model {body.get('model')!r} is not served here; this server serves {model!r}",
                          "model_not_found")
        stream = body.get("stream") is True
        line = {"custom_id": f"online-{uuid.uuid4().hex}", "method": "POST", "url": url,
                "body": {k: v for k, v in body.items() if k not in ("stream", "stream_options")}}
        item = next(iter(claim_items([(1, 0, 0, line, None)])))
        if isinstance(item, LineError):
            raise Problem(400, item.message.removeprefix("body."), item.code)
        with tok_lock:
            seqs, errors = prepare([item], tokenizer, spec, config)
        if errors:
            raise Problem(400, errors[0].message, errors[0].code)
        try:
            samples = await asyncio.wrap_future(inbox.put(seqs))
        except RuntimeError as e:
            raise Problem(503, f"the request could not be run: {e}; retry", "unavailable") from None
        if failed := next((s for s in samples if s.error), None):
            raise Problem(500, f"the model could not answer: {failed.error}", "model_error")
        answer = result_record(samples, fmt="openai", model=model)["response"]["body"]
        (ChatCompletion if url == CHAT_URL else Completion).model_validate(answer)
        if not stream:
            return answer
        return StreamingResponse(sse(answer, url), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await online(request, CHAT_URL)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await online(request, COMPLETIONS_URL)

    return app


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's cursor page, newest first: the items after `after` (an id in the list), at most `limit`."""
    items = sorted(items, key=lambda x: (-x["created_at"], x["id"]))
    limit = max(1, min(limit, 10000))
    ids = [x["id"] for x in items]
    start = ids.index(after) + 1 if after in ids else 0
    data = items[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}


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
