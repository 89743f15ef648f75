"""Output records: their two forms, written and recognised again.

Two record forms (``--output-format``; ``auto`` answers each line in its own form):

* klotski: ``{"id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"}``
  (+ ``token_ids``, + ``logprobs``: ``[{token, logprob, top_logprobs: [{token, logprob}]}]``);
  a line of n > 1 samples (or of a list of prompts: choice p*n + j is prompt p's j-th, as
  OpenAI numbers them): ``{"id", "choices": [{"index", "completion", "finish_reason",
  "completion_tokens", ...}], "prompt_tokens", "completion_tokens"}`` (the line's totals);
  a line that cannot be served: ``{"id", "error": {"line", "message"}}``.
* openai: an OpenAI Batch output line, ``{"id": "batch_req_…", "custom_id", "response":
  {"status_code": 200, "request_id", "body": <chat.completion | text_completion>}, "error":
  null}``; a line that cannot be served: ``"response": null, "error": {"code", "message"}``.

A record's key is its ``custom_id`` in the OpenAI form, its ``id`` otherwise: that is what
resume skips and what is never written twice.

``scan_file`` reads an output back in one pass (what resume and repair need, never the
lines): it keeps keys as 64-bit hashes (klotski/io/idset.py) and error lines as byte spans,
and recognises the records Klotski itself wrote by their opening (``{"id": "…",
"completion":``, or ``"choices":`` for a line of n samples) instead of parsing each in full.

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
from klotski.io.requests import CHAT_URL, COMPLETIONS_URL, model_error


# ---------------------------------------------------------------- writing a record


def record_form(fmt: str, openai_endpoint: str | None) -> str:
    """'klotski' or 'openai' for one line: `fmt` unless it is auto, then the line's own form."""
    if fmt == "auto":
        return "openai" if openai_endpoint else "klotski"
    return fmt


def finished_record(samples: list, *, fmt: str, model: str, include_token_ids: bool = False) -> tuple:
    """THE record of a finished line, from its n samples (all done): (its result record, None),
    or (its error record, the LineError) when a sample failed. Every answer is this: a job's
    output and a Ray worker's shard (klotski.schedule.sequences.line_record, which gathers the
    samples), Ray Data's columns (klotski/ray.py) and klotski serve's online answers."""
    if failed := next((x for x in samples if x.error), None):
        err = model_error(failed)
        return error_record(err, fmt=fmt), err
    return result_record(samples, fmt=fmt, model=model, include_token_ids=include_token_ids), None


def result_record(seq, *, fmt: str, model: str, include_token_ids: bool = False) -> dict:
    """The output line of a finished line: `seq` is its sequence, or the list of its n samples
    (klotski.schedule.sequences.gather), all done. A line of n > 1 is answered in one record:
    OpenAI's ``choices[i]``, klotski's ``choices`` list (`_klotski_record`)."""
    samples = seq if isinstance(seq, list) else [seq]
    req, first = samples[0].request, samples[0]
    asked = getattr(req, "logprobs", None) is not None
    if record_form(fmt, req.openai) == "klotski":
        record = _klotski_record(samples, include_token_ids, asked)
        if (options := option_logprobs(first)) is not None:
            record["choice_logprobs"] = options
        return record
    endpoint = req.openai or (CHAT_URL if req.messages is not None else COMPLETIONS_URL)
    completion, prompt = sum(len(s.out) for s in samples), prompt_tokens(samples)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if endpoint == CHAT_URL:
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "choices": [{"index": i, "message": {"role": "assistant", "content": s.text},
                             "finish_reason": s.finish_reason, "logprobs": _chat_logprobs(s) if asked else None}
                            for i, s in enumerate(samples)]}
    else:
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "choices": [{"index": i, "text": s.text, "finish_reason": s.finish_reason,
                             "logprobs": _completion_logprobs(s) if asked else None}
                            for i, s in enumerate(samples)]}
    body.update(created=int(time.time()), model=model, usage=usage)
    if (options := option_logprobs(first)) is not None:  # klotski's extension field (jobs/README.md)
        body["choice_logprobs"] = options
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def prompt_tokens(samples: list) -> int:
    """A line's prompt tokens: its prompt's, or the sum over a completions list's prompts (each
    counted once, not once per sample: sample p*n + j answers prompt p)."""
    n = getattr(samples[0].request, "n", 1)
    return sum(len(s.prompt_ids) for i, s in enumerate(samples) if i % n == 0)


def option_logprobs(s) -> list[dict] | None:
    """A label's confidence: [{"choice", "logprob"}] over its line's choice options, in their
    order, from the line's scoring rows (klotski/schedule/sequences.py, `_scorers`); None where
    the line asked none. Each is the sum of the option's token log-probabilities (EOS's too
    where the grammar could go on) under the grammar's mask; None for an option the grammar
    would not take as the tokenizer splits it, or that did not fit the context."""
    if not getattr(s, "scorers", None):
        return None
    return [{"choice": r.option, "logprob": sum(lp for _, lp, _ in r.logprobs)
             if r.error is None and r.finish_reason == "stop" else None} for r in s.scorers]


def _klotski_record(samples: list, include_token_ids: bool, asked: bool) -> dict:
    """klotski's form: a line of one sample keeps its flat fields; a line of n > 1 has a
    ``choices`` list of those per-sample fields (completion, finish_reason,
    completion_tokens, token_ids, logprobs) and the line's totals beside it."""
    def fields(s) -> dict:
        one = {"completion": s.text, "finish_reason": s.finish_reason, "completion_tokens": len(s.out)}
        if include_token_ids:
            one["token_ids"] = list(s.out)
        if asked:
            one["logprobs"] = [{"token": _text(s, t), "logprob": lp,
                                "top_logprobs": [{"token": _text(s, a), "logprob": alp} for a, alp in alts]}
                               for t, lp, alts in s.logprobs]
        return one
    req, prompt = samples[0].request, prompt_tokens(samples)
    if len(samples) == 1 and getattr(req, "n", 1) == 1:
        one = fields(samples[0])
        return {"id": req.id, "completion": one.pop("completion"), "finish_reason": one.pop("finish_reason"),
                "prompt_tokens": prompt, **one}
    return {"id": req.id, "choices": [{"index": i, **fields(s)} for i, s in enumerate(samples)],
            "prompt_tokens": prompt, "completion_tokens": sum(len(s.out) for s in samples)}


def _text(s, token: int) -> str:
    return token_text(s.pieces, token)


def token_text(pieces: dict | None, token: int) -> str:
    """A token's text as logprobs show it, from its (text, bytes) in `pieces` (its id where unknown)."""
    return pieces[token][0] if pieces and token in pieces else str(token)


def token_bytes(pieces: dict | None, token: int) -> list[int]:
    return pieces[token][1] if pieces and token in pieces else list(token_text(pieces, token).encode("utf-8"))


def _chat_logprobs(s) -> dict:
    return chat_logprobs(s.logprobs, s.pieces)


def _completion_logprobs(s) -> dict:
    return completion_logprobs(s.logprobs, s.pieces)


def chat_logprobs(entries: list, pieces: dict | None) -> dict:
    """OpenAI chat's ``choices[i].logprobs`` of `entries` ((token, logprob, alternatives) of a
    sequence's `logprobs`: all of them, or a streamed chunk's): each token with its bytes and
    alternatives."""
    return {"content": [{"token": token_text(pieces, t), "logprob": lp, "bytes": token_bytes(pieces, t),
                         "top_logprobs": [{"token": token_text(pieces, a), "logprob": alp,
                                           "bytes": token_bytes(pieces, a)} for a, alp in alts]}
                        for t, lp, alts in entries], "refusal": None}


def completion_logprobs(entries: list, pieces: dict | None, offset: int = 0) -> dict:
    """OpenAI completions' ``choices[i].logprobs`` of `entries`: parallel lists, alternatives as
    {text: logprob} and each token's character offset in the answer (`offset`: where the
    first of them starts, for a streamed chunk after others)."""
    tokens = [token_text(pieces, t) for t, _, _ in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(pieces, a): alp for a, alp in alts} for _, _, alts in entries],
            "text_offset": offsets}


def error_record(err, *, fmt: str) -> dict:
    """The output line of a job that cannot be served (a klotski.io.requests.LineError)."""
    if record_form(fmt, err.openai) == "klotski":
        return {"id": err.id, "error": {"line": err.line, "message": err.message}}
    if err.code == "invalid_json_line":  # no custom_id can be read from a line that is not JSON
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None, "response": None,
                "error": {"code": err.code, "message": f"line {err.line}: {err.message}", "line": err.line}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": err.id, "response": None,
            "error": {"code": err.code, "message": f"line {err.line}: {err.message}"}}


def record_key(obj) -> str | None:
    """The id a record answers for: custom_id in the OpenAI form, id otherwise."""
    if not isinstance(obj, dict):
        return None
    key = obj.get("custom_id") if "custom_id" in obj else obj.get("id")
    if key is None and "custom_id" in obj and isinstance(obj.get("error"), dict) and type(
            line := obj["error"].get("line")) is int:
        return f"#line{line}"  # the error record of a line that is not JSON: its number is all it has
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
_KLOTSKI = re.compile(rb'\{"id": "((?:[^"\\]|\\.)*)", "(completion|choices|error)": ')
_OPENAI = re.compile(rb'\{"id": "batch_req_[0-9a-f]+", "custom_id": "((?:[^"\\]|\\.)*)", "response": ')


def classify(raw: bytes) -> tuple[str, str | None]:
    """One raw line's kind ("ok", "error", "blank" or "corrupt") and key: what ``parse`` says,
    found without parsing for the lines Klotski wrote."""
    if raw.endswith(b"}\n"):
        try:
            if m := _KLOTSKI.match(raw):
                return ("ok" if m.group(2) != b"error" else "error"), _key(m.group(1))
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
