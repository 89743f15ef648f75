"""The Files, Batches and Models routes (`router`, behind the API key) and /health
(`open_router`, without it). Replies are checked against the `openai` package's own types
(FileObject, Batch) before they leave, so what the official client parses is what was built.
Writes to the data dir (and their fsyncs) run in the thread pool, never on the event loop; a
write the disk refuses is a 507 at once, and the server carries on."""
from __future__ import annotations

import threading
import time

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from openai.types import Batch, FileObject

from klotski.io.requests import CHAT_URL, COMPLETIONS_URL
from klotski.serve.batches import validate
from klotski.serve.deps import Problem, Served, authorized, json_body, served
from klotski.serve.worker import not_served
from klotski.serve.store import StoreFailed
from klotski.serve.upload import BadUpload, receive_upload
from klotski.util.writes import reason

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
FAILING_AFTER = 3  # engine runs failed in a row after which /health says failing (503)
open_router = APIRouter()
router = APIRouter(dependencies=[Depends(authorized)])


@open_router.get("/health")
async def health(s: Served = Depends(served)):
    """ok; degraded (the data dir refuses writes: batches wait, online requests are answered;
    or the engine's last run failed); or failing, 503, once the engine's thread has stopped or
    its last FAILING_AFTER runs failed (what a restart may cure: a device left in an error state)."""
    problems = [p for p in (s.store.trouble, s.worker.engine_trouble(), None if s.worker.is_alive() else
                            f"the engine's worker has stopped ({s.inbox.closed or 'unexpectedly'})") if p]
    failing = not s.worker.is_alive() or s.worker.failed_runs >= FAILING_AFTER
    body = {"status": "failing" if failing else "degraded" if problems else "ok", "model": s.names[0],
            "problems": problems, "online": {**vars(s.stats()), **s.inbox.counts()}}
    return JSONResponse(body, status_code=503 if failing else 200)


# ---- models --------------------------------------------------------------------------------
def _model(s: Served, name: str) -> dict:
    return {"id": name, "object": "model", "created": s.started, "owned_by": "klotski"}


@router.get("/v1/models")
async def models(s: Served = Depends(served)):
    return {"object": "list", "data": [_model(s, name) for name in s.names]}


@router.get("/v1/models/{model:path}")
async def model(model: str, s: Served = Depends(served)):
    if model not in s.names:
        raise Problem(404, not_served(model, s.names), "model_not_found", "model")
    return _model(s, model)


# ---- files ---------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload(request: Request, s: Served = Depends(served)):
    tmp = s.store.tmp_path()
    try:
        try:
            up = await receive_upload(request, tmp, s.max_upload, s.store.faults)
        except BadUpload as e:
            raise Problem(400, str(e), "invalid_upload", e.param) from None
        except OSError as e:
            raise _storage(s, e, "the file") from None
        if up.too_big:
            raise Problem(413, f"the file is {up.size} bytes, over this server's limit of {s.max_upload} bytes "
                               "(--max-upload-size); split it into smaller files", "file_too_large", "file")
        purpose = up.fields.get("purpose")
        if purpose != "batch":
            raise Problem(400, f"purpose must be 'batch', got {purpose!r}", "invalid_purpose", "purpose")
        try:
            meta = await run_in_threadpool(s.store.add_file, tmp, up.filename, purpose)
        except OSError as e:
            raise _storage(s, e, "the file") from None
    finally:
        tmp.unlink(missing_ok=True)
    return FileObject.model_validate(meta).model_dump()


def _storage(s: Served, e: OSError, what: str) -> Problem:
    s.store.fault(e, what)
    return Problem(507, f"the server could not store {what}: {reason(e)}; retry later", "storage_error")


def file_or_404(s: Served, file_id: str) -> dict:
    meta = s.store.get_file(file_id)
    if meta is None:
        raise Problem(404, f"no such file: {file_id!r}", "file_not_found", "file_id")
    return meta


@router.get("/v1/files")
async def list_files(purpose: str | None = None, limit: int = 10000, after: str | None = None,
                     order: str = "desc", s: Served = Depends(served)):
    _limit(limit, 10000)
    return page([f for f in list(s.store.files.values()) if purpose in (None, f["purpose"])], after, limit, order)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, s: Served = Depends(served)):
    return file_or_404(s, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, s: Served = Depends(served)):
    file_or_404(s, file_id)
    return FileResponse(s.store.content_path(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, s: Served = Depends(served)):
    file_or_404(s, file_id)
    if user := s.store.file_in_use(file_id):
        raise Problem(409, f"file {file_id} is in use by batch {user}, which has not finished; "
                           "cancel it or wait for it", "file_in_use", "file_id")
    await run_in_threadpool(s.store.delete_file, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# ---- batches -------------------------------------------------------------------------------
def batch_or_404(s: Served, batch_id: str) -> dict:
    batch = s.store.get_batch(batch_id)
    if batch is None:
        raise Problem(404, f"no such batch: {batch_id!r}", "batch_not_found", "batch_id")
    return Batch.model_validate(batch).model_dump()


@router.post("/v1/batches")
async def create_batch(request: Request, s: Served = Depends(served)):
    body = await json_body(request)
    fid, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(fid, str):
        raise Problem(400, "input_file_id is required (the id files.create returned)", "invalid_request",
                      "input_file_id")
    meta = s.store.get_file(fid)
    if meta is None:
        raise Problem(404, f"no such file: {fid!r}", "file_not_found", "input_file_id")
    if meta["purpose"] != "batch":
        raise Problem(400, f"file {fid} has purpose {meta['purpose']!r}; upload the input with purpose 'batch'",
                      "invalid_request", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise Problem(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "invalid_endpoint",
                      "endpoint")
    if body.get("completion_window", "24h") != "24h":
        raise Problem(400, f"completion_window must be '24h', got {body.get('completion_window')!r}",
                      "invalid_request", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise Problem(400, "metadata must be an object of at most 16 string keys and string values",
                      "invalid_request", "metadata")
    fields = {"input_file_id": fid, "endpoint": endpoint, "completion_window": "24h", "metadata": metadata,
              "expires_at": int(time.time()) + s.batch_window_s}
    try:
        batch = await run_in_threadpool(s.store.new_batch, fields)  # on disk before the reply
    except StoreFailed as e:
        raise Problem(507, str(e), "storage_error") from None
    start_validation(s, batch["id"])
    return Batch.model_validate(batch).model_dump()


def start_validation(s: Served, batch_id: str) -> None:
    """Validate a batch on a thread of its own, then wake the worker."""
    def run():
        try:
            validate(s.store, batch_id, s.names)
        except Exception as e:  # our bug, or an unreadable input: the batch fails, not the server
            s.store.update(batch_id, only_if=("validating",), status="failed", failed_at=int(time.time()), errors={
                "object": "list", "data": [{"code": "validation_failed", "line": None, "param": None,
                                            "message": f"{type(e).__name__}: {e}; {s.store.save_crash(e)}"}]})
        s.inbox.notify()
    threading.Thread(target=run, name=f"validate-{batch_id}", daemon=True).start()


@router.get("/v1/batches")
async def list_batches(limit: int = 20, after: str | None = None, s: Served = Depends(served)):
    _limit(limit, 100)
    return page(list(s.store.batches.values()), after, limit, "desc")


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, s: Served = Depends(served)):
    return batch_or_404(s, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(batch_id: str, s: Served = Depends(served)):
    batch_or_404(s, batch_id)
    if await run_in_threadpool(s.store.update, batch_id, ("validating", "in_progress"), status="cancelling",
                               cancelling_at=int(time.time())):
        s.inbox.notify()
    elif (status := s.store.batches[batch_id]["status"]) not in ("cancelling", "cancelled"):
        raise Problem(409, f"batch {batch_id} is {status}; only a batch that has not finished can be cancelled",
                      "batch_not_cancellable", "batch_id")
    return batch_or_404(s, batch_id)


def _limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise Problem(400, f"limit must be between 1 and {most}, got {limit}", "invalid_request", "limit")


def page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """OpenAI's cursor page: the items after `after` (an id in the list), at most `limit`,
    newest first (`order` desc) or oldest first (asc)."""
    if order not in ("asc", "desc"):
        raise Problem(400, f"order must be 'asc' or 'desc', got {order!r}", "invalid_request", "order")
    items = sorted(items, key=lambda x: (x["created_at"], x["id"]), reverse=order == "desc")
    ids = [x["id"] for x in items]
    if after is not None and after not in ids:
        raise Problem(400, f"after is {after!r}, which is not in this list; give the last id of the page before",
                      "invalid_request", "after")
    start = ids.index(after) + 1 if after is not None else 0
    data = items[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}
