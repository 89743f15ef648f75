"""Output records: their two forms, written and recognised again.

Two record forms (``--output-format``; ``auto`` answers each line in its own form):

* klotski: ``{"id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"}``
  (+ ``token_ids``); a line that cannot be served: ``{"id", "error": {"line", "message"}}``.
* openai: an OpenAI Batch output line, ``{"id": "batch_req_…", "custom_id", "response":
  {"status_code": 200, "request_id", "body": <chat.completion | text_completion>}, "error":
  null}``; a line that cannot be served: ``"response": null, "error": {"code", "message"}``.

A record's key is its ``custom_id`` in the OpenAI form, its ``id`` otherwise: that is what
resume skips and what is never written twice.

``scan_file`` reads an output back in one pass (what resume and repair need, never the
lines): it keeps keys as 64-bit hashes (klotski/io/idset.py) and error lines as byte spans,
and recognises the records Klotski itself wrote by their opening (``{"id": "…",
"completion":``) instead of parsing each in full.

This module only uses the standard library.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from array import array
from dataclasses import dataclass

from klotski.io.idset import IdSet
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL


# ---------------------------------------------------------------- writing a record


def record_form(fmt: str, openai_endpoint: str | None) -> str:
    """'klotski' or 'openai' for one line: `fmt` unless it is auto, then the line's own form."""
    if fmt == "auto":
        return "openai" if openai_endpoint else "klotski"
    return fmt


def result_record(seq, *, fmt: str, model: str, include_token_ids: bool = False) -> dict:
    """The output line of a finished sequence."""
    req = seq.request
    if record_form(fmt, req.openai) == "klotski":
        rec = {"id": req.id, "completion": seq.text, "finish_reason": seq.finish_reason,
               "prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.out)}
        if include_token_ids:
            rec["token_ids"] = list(seq.out)
        return rec
    endpoint = req.openai or (CHAT_URL if req.messages is not None else COMPLETIONS_URL)
    usage = {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.out),
             "total_tokens": len(seq.prompt_ids) + len(seq.out)}
    if endpoint == CHAT_URL:
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": seq.text},
                             "finish_reason": seq.finish_reason, "logprobs": None}]}
    else:
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "choices": [{"index": 0, "text": seq.text, "finish_reason": seq.finish_reason, "logprobs": None}]}
    body.update(created=int(time.time()), model=model, usage=usage)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def error_record(err, *, fmt: str) -> dict:
    """The output line of a job that cannot be served (a klotski.io.requests.LineError)."""
    if record_form(fmt, err.openai) == "klotski":
        return {"id": err.id, "error": {"line": err.line, "message": err.message}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": err.id, "response": None,
            "error": {"code": err.code, "message": f"line {err.line}: {err.message}"}}


def record_key(obj) -> str | None:
    """The id a record answers for: custom_id in the OpenAI form, id otherwise."""
    if not isinstance(obj, dict):
        return None
    key = obj.get("custom_id") if "custom_id" in obj else obj.get("id")
    return key if isinstance(key, str) else None


def is_error(obj: dict) -> bool:
    return bool(obj.get("error")) if "custom_id" in obj else "error" in obj


# ---------------------------------------------------------------- reading records back


@dataclass
class Scan:
    """One pass over an output file, keeping only what resume and repair need (never the
    lines): ok keys and error keys (hashed), the byte spans of error lines, the end of the
    last valid record, the corrupt lines before it, ``foreign`` (a complete line is
    corrupt), and the file's identity (inode, size, mtime) when it was read."""
    ok: IdSet
    errors: IdSet
    error_spans: array
    good_end: int
    end: int
    corrupt: int
    foreign: bool
    seen_any: bool
    identity: tuple
    ok_records: int | None = None  # when `ok` holds more or fewer ids than the file (a sidecar's)


def file_identity(st) -> tuple:
    """What tells a file apart from itself changed (device, inode, size, mtime), from its stat."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def scan_file(f, base: int = 0) -> Scan:
    """The file from byte `base` on (where `f` is), offsets counted from the file's start."""
    identity = file_identity(os.fstat(f.fileno()))
    ok, errors, error_spans = IdSet(), IdSet(), array("q")
    good_end = offset = base
    corrupt = corrupt_since = 0
    foreign = seen_any = False
    for raw in f:
        seen_any = True
        start, offset = offset, offset + len(raw)
        kind, rid = classify(raw)
        if kind in ("ok", "error"):
            good_end, corrupt, corrupt_since = offset, corrupt + corrupt_since, 0
            if kind == "ok":
                ok.add(rid)
            else:
                errors.add(rid)
                error_spans.extend((start, offset))
        corrupt_since += kind == "corrupt"
        foreign |= kind == "corrupt" and raw.endswith(b"\n")
    return Scan(ok, errors, error_spans, good_end, offset, corrupt, foreign, seen_any, identity)


# The openings klotski's own writer gives its records (json.dumps keeps key order), so a
# whole line (ending in "}\n": a crash can only cut a record short) is classified without
# parsing it; anything else is parsed in full.
_KLOTSKI = re.compile(rb'\{"id": "((?:[^"\\]|\\.)*)", "(completion|error)": ')
_OPENAI = re.compile(rb'\{"id": "batch_req_[0-9a-f]+", "custom_id": "((?:[^"\\]|\\.)*)", "response": ')


def classify(raw: bytes) -> tuple[str, str | None]:
    """One raw line's kind ("ok", "error", "blank" or "corrupt") and key: what ``parse`` says,
    found without parsing for the lines Klotski wrote."""
    if raw.endswith(b"}\n"):
        try:
            if m := _KLOTSKI.match(raw):
                return ("ok" if m.group(2) == b"completion" else "error"), _key(m.group(1))
            if m := _OPENAI.match(raw):
                ok = raw.endswith(b', "error": null}\n') and not raw.startswith(b"null", m.end())
                return ("ok" if ok else "error"), _key(m.group(1))
        except ValueError:  # not UTF-8, a bad escape: the full parse says what it is
            pass
    return parse(raw)


def _key(escaped: bytes) -> str:
    return escaped.decode("utf-8") if b"\\" not in escaped else json.loads(b'"' + escaped + b'"')


def parse(raw: bytes) -> tuple[str, str | None]:
    """One raw line's kind and key, from a full JSON parse."""
    if not raw.strip():
        return "blank", None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "corrupt", None
    key = record_key(obj)
    if key is None:
        return "corrupt", None
    return ("error" if is_error(obj) else "ok"), key
