"""A multipart/form-data upload (POST /v1/files) streamed to a file under --data-dir, never
held in memory nor spooled to the system's temp directory, and never more than the limit on
disk: past it the rest of the body is read and dropped, and the caller answers 413 (the
whole body, form fields too, is bounded before this by the app's Guard). Each piece is
written, and the file fsynced, in the thread pool: the event loop never waits on the disk.
A write the disk refuses stops the writing, not the reading: the body is drained and the
OSError raised once it is, so the client reads the server's answer, not a reset."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fastapi.concurrency import run_in_threadpool
from python_multipart.exceptions import ParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect


class BadUpload(ValueError):
    """The body is not the form the route expects; the message says what is wrong, `param`
    which form field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Upload:
    fields: dict = field(default_factory=dict)   # form fields but the file: name -> text
    filename: str | None = None
    size: int = 0                                 # bytes of the file part (counted past the limit too)
    too_big: bool = False


async def receive_upload(request, dest: Path, limit: int, faults) -> Upload:
    """Parse the form of `request`, the part named `file` into `dest` (its writes through the
    store's fault seam `faults`)."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise BadUpload("the body must be multipart/form-data with a 'file' part and a 'purpose' field")
    up = Upload()
    state = {"name": None, "header": b"", "headers": {}, "buf": bytearray()}
    pending = bytearray()  # the file's bytes of the piece just parsed, to be written

    def on_header_field(data, start, end):
        state["header"] += data[start:end]

    def on_header_value(data, start, end):
        key = state["header"].lower()
        state["headers"][key] = state["headers"].get(key, b"") + data[start:end]

    def on_header_end():
        state["header"] = b""

    def on_headers_finished():
        _, opts = parse_options_header(state["headers"].get(b"content-disposition", b""))
        state["name"] = opts.get(b"name", b"").decode("utf-8", "replace")
        filename = opts.get(b"filename")
        if state["name"] == "file":
            up.filename = (filename or b"upload.jsonl").decode("utf-8", "replace")
        state["headers"] = {}

    def on_part_data(data, start, end):
        if state["name"] == "file":
            up.size += end - start
            up.too_big |= up.size > limit
            if not up.too_big:
                pending.extend(data[start:end])
        elif len(state["buf"]) < 4096:  # a form field: short text
            state["buf"] += data[start:end]

    def on_part_end():
        if state["name"] and state["name"] != "file":
            up.fields[state["name"]] = state["buf"].decode("utf-8", "replace")
        state["name"], state["buf"] = None, bytearray()

    parser = MultipartParser(options[b"boundary"], {
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end})
    out, refused = open(dest, "wb"), None

    def write(data: bytes) -> None:
        faults.check(dest, len(data))
        out.write(data)
    try:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except ParseError as e:
                raise BadUpload(f"the multipart body cannot be read ({e})") from None
            if pending and refused is None:
                try:
                    await run_in_threadpool(write, bytes(pending))
                except OSError as e:
                    refused = e
            pending.clear()
        try:
            parser.finalize()
        except ParseError as e:
            raise BadUpload(f"the multipart body cannot be read ({e})") from None
        if refused is None:
            await run_in_threadpool(_sync, out)
    except ClientDisconnect:
        raise BadUpload("the body was cut short (the client went away)") from None
    except OSError as e:
        refused = e
    finally:
        out.close()
    if refused is not None:
        raise refused
    if up.filename is None:
        raise BadUpload("the form has no 'file' part; send the JSONL file as 'file'", "file")
    return up


def _sync(out) -> None:
    out.flush()
    os.fsync(out.fileno())
