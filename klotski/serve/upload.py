"""A multipart/form-data upload (POST /v1/files) streamed to a file under --data-dir, never
held in memory nor spooled to the system's temp directory, and never more than the limit on
disk: past it the rest of the body is read and dropped, and the caller answers 413."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header


class BadUpload(ValueError):
    """The body is not the form the route expects; the message says what is wrong."""


@dataclass
class Upload:
    fields: dict = field(default_factory=dict)   # form fields but the file: name -> text
    filename: str | None = None
    size: int = 0                                 # bytes of the file part (counted past the limit too)
    too_big: bool = False


async def receive_upload(request, dest: Path, limit: int) -> Upload:
    """Parse the form of `request`, the part named `file` into `dest`."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise BadUpload("the body must be multipart/form-data with a 'file' part and a 'purpose' field")
    up = Upload()
    state = {"name": None, "filename": None, "header": b"", "headers": {}, "buf": bytearray()}
    out = open(dest, "wb")

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
                out.write(data[start:end])
        elif len(state["buf"]) < 4096:  # a form field: short text
            state["buf"] += data[start:end]

    def on_part_end():
        if state["name"] and state["name"] != "file":
            up.fields[state["name"]] = state["buf"].decode("utf-8", "replace")
        state["name"], state["buf"] = None, bytearray()

    parser = MultipartParser(options[b"boundary"], {
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end})
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
        out.flush()
        os.fsync(out.fileno())
    except Exception as e:  # the parser's own errors: a body cut short or not multipart at all
        raise BadUpload(f"the multipart body cannot be read ({e})") from None
    finally:
        out.close()
    if up.filename is None:
        raise BadUpload("the form has no 'file' part; send the JSONL file as 'file'")
    return up
