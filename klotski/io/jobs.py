"""Job files in, result records out, and resuming an interrupted run.

Input: one JSON object per line, in one of three shapes.

* plain:  {"id": "q1", "prompt": "...", "max_new_tokens": 64, "temperature": 0.7,
           "top_p": 0.9, "stop": ["\\n\\n"], "seed": 1}
* chat:   {"id": "q2", "messages": [{"role": "user", "content": "..."}], ...}
* OpenAI batch: {"custom_id": "q3", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [...], "max_tokens": 64, ...}}

A line without an id gets its 1-based line number as id; numeric ids become
strings. Blank lines are skipped. Unknown keys are ignored so that files can
carry their own metadata; ``null`` for an optional field means "use the run's
default". ``max_tokens`` (and OpenAI's ``max_completion_tokens``) is accepted
as another name for ``max_new_tokens``.

Bad lines never stop the run: each becomes a ``LineError`` (written to the
output as ``{"id", "error": {"line", "message"}}``) and the other lines go on.
Ids in the output are unique: when two lines claim the same id the first (in file
order) keeps it, and the error record of a later one gets the id ``"<id>#line<N>"``.
A line without an id, or whose id cannot be read (bad JSON, not UTF-8), claims its
line number; a later line stating that number as its id is then the duplicate. The
file is read as a stream (``stream_jobs``): what is remembered of earlier lines is
only their ids, hashed (klotski/io/idset.py), so duplicates are found wherever they are
without holding the file.

Output records and resuming are klotski/io/output.py's.

This module only uses the standard library: tokenizing and generating belong to
the engine.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass, field
from typing import Iterator

from klotski.io.idset import IdSet, id_hash

ROLES = ("system", "user", "assistant")
COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
_EXAMPLE = '{"id": "q1", "prompt": "Hello"}'
ROW_KEY = "_klotski_row"  # a dataset row's columns, carried beside its job fields (klotski/io/dataset_files.py)


class JobFileError(Exception):
    """A problem with a whole file (missing, unreadable, locked); one line for the CLI."""


@dataclass(frozen=True)
class Request:
    """One validated job.

    Exactly one of ``prompt`` / ``messages`` is set. ``messages`` is a tuple of
    ``(role, content)`` string pairs, hashable like the rest of the request;
    ``chat_messages()`` gives the list-of-dicts form chat templates expect.
    ``None`` in a limit means "use the run's default".
    """

    id: str
    line: int
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    openai: str | None = None  # the endpoint ("/v1/chat/completions", ...) of an OpenAI Batch line
    row: dict | None = field(default=None, compare=False, hash=False, repr=False)  # a dataset row's columns

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]


@dataclass(frozen=True)
class LineError:
    """A job that cannot be served; ``message`` says what is wrong and how to fix it.
    ``openai`` is the endpoint when the line was recognisably an OpenAI Batch request, and
    ``code`` the error code its OpenAI-form output line carries."""

    id: str
    line: int
    message: str
    openai: str | None = None
    code: str = "invalid_request"
    row: dict | None = field(default=None, compare=False, hash=False, repr=False)  # a dataset row's columns

    def __str__(self) -> str:
        return f"line {self.line} (id {self.id!r}): {self.message}"


def prompt_too_long(request: Request, prompt_tokens: int, context: int,
                    max_new_tokens: int | None = None) -> LineError:
    """The engine's error for a prompt that does not fit the model's context."""
    if max_new_tokens:
        message = (f"prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}, "
                   f"together more than the model's context of {context} tokens; "
                   f"shorten the prompt or lower max_new_tokens")
    else:
        message = (f"prompt has {prompt_tokens} tokens, more than the model's context of "
                   f"{context} tokens; shorten the prompt")
    return LineError(request.id, request.line, message, openai=request.openai, code="context_length_exceeded",
                     row=request.row)


def model_error(seq) -> LineError:
    """The error of a sequence the model could not produce (e.g. non-finite logits)."""
    req = seq.request
    return LineError(req.id, req.line, seq.error, openai=req.openai, code="model_error", row=req.row)


# ---------------------------------------------------------------- reading


class _Invalid(Exception):
    """A user-facing reason why one line is rejected."""


@dataclass
class Start:
    """Where a rerun picks a job file up (klotski/io/progress.py): every line up to `line`
    (ending at byte `offset`) is done, `seen` holds the ids those lines claimed, and
    `replay` lists earlier lines to run again, as (line, start offset, claimed id): those
    whose last record was an error."""
    line: int
    offset: int
    seen: IdSet
    replay: list = field(default_factory=list)


@dataclass
class Cursor:
    """What a reader has consumed, for a progress sidecar to record: the last line read and
    the byte offset after it, and since the last ``take()`` the hashes of the ids claimed
    (in file order) and each item's line start offset (errors name their line)."""
    line: int = 0
    offset: int = 0
    claimed: array = field(default_factory=lambda: array("Q"))
    starts: dict = field(default_factory=dict)

    def take(self) -> "Mark":
        mark = Mark(self.line, self.offset, self.claimed, self.starts)
        self.claimed, self.starts = array("Q"), {}
        return mark


@dataclass(frozen=True)
class Mark:
    """A Cursor's state at the end of one window: once the window's records are written,
    every line up to `line` (byte `offset`) is done."""
    line: int
    offset: int
    claimed: array
    starts: dict


def stream_jobs(path, done=None, *, start: Start | None = None,
                cursor: Cursor | None = None) -> Iterator[Request | LineError | None]:
    """Every non-blank line of a job file, in file order, validated as it is read: a Request
    or a LineError. Nothing but the ids seen so far (hashed, klotski.io.idset) is kept, so a
    file of any length streams in bounded memory.

    Ids are claimed in file order: the first line that states an id (or, without one, whose
    line number is that id) owns it; a later line claiming it becomes a duplicate-id error
    whose record is named ``"<id>#line<N>"``, so no id is ever answered twice.

    A line that owns an id in `done` (ids finished by an earlier run; anything with ``in``)
    yields None, without validating the rest of it: resuming a long job costs one JSON
    parse per finished line. With `start` the lines it covers are not read at all (only
    its replayed lines are, first); `cursor`, when given, follows what was read."""
    def objects(lines):
        for line, begin, raw in lines:
            try:
                yield line, begin, begin + len(raw), _decode(raw, first=line == 1), None
            except _Invalid as e:
                yield line, begin, begin + len(raw), {}, str(e)
    replay = objects(_lines_at(path, start.replay)) if start else ()
    rest = objects(_numbered_lines(path, *((start.line, start.offset) if start else (0, 0))))
    return claim_items(rest, done, start=start, cursor=cursor, replayed=replay)


def claim_items(objects, done=None, *, start: Start | None = None, cursor: Cursor | None = None,
                replayed=()) -> Iterator[Request | LineError | None]:
    """stream_jobs for any source of rows: `objects` yields (line, start offset, end offset,
    the row as a job line's dict or None for a blank line, a reason it cannot be read or
    None), in
    order; `replayed` the same for earlier rows to run again (``Start.replay``, whose ids
    are already claimed). Every row goes through the JSONL line's checks, so a row's error
    names its field the same way."""
    seen = start.seen if start else IdSet()
    names = {line: name for line, _, name in start.replay} if start else {}
    if cursor is not None and start is not None:
        cursor.line, cursor.offset = start.line, start.offset
    for line, begin, _, obj, error in replayed:
        item = _item(line, obj, error, done, lambda name: (names[line], names[line] == name))
        if cursor is not None:
            cursor.starts[line] = begin
        if item is not _BLANK:
            yield item

    def claim(name):
        fresh = seen.add(name)
        if not fresh:
            name = f"{name}#line{line}"
            while not seen.add(name):
                name += "#"
        if cursor is not None:
            cursor.claimed.append(id_hash(name))
        return name, fresh
    for line, begin, end, obj, error in objects:
        item = _item(line, obj, error, done, claim)
        if cursor is not None:
            cursor.line, cursor.offset = line, end
            if item is not _BLANK and item is not None:  # (only a line that runs can fail)
                cursor.starts[line] = begin
        if item is not _BLANK:
            yield item


_BLANK = object()


def _item(line: int, obj, error, done, claim):
    """One row: its Request, LineError, None (done earlier) or _BLANK; `claim(id)` gives the
    id it is answered under and whether it owns its natural id."""
    explicit, openai = None, None
    if error is None:
        if obj is None:
            return _BLANK
        try:
            openai = _endpoint(obj)
            explicit = _explicit_id(obj)
        except _Invalid as e:
            error = str(e)
    natural = explicit if explicit is not None else str(line)
    name, fresh = claim(natural)
    if fresh and done is not None and name in done:
        return None
    if error is None:
        try:
            fields = _fields(obj)
        except _Invalid as e:
            error = str(e)
    if not fresh:  # an earlier line owns this id: name this line's error record apart
        if error is None and explicit is not None:
            error = f"duplicate id {explicit!r}: an earlier line already uses it; give each job a unique id"
        elif error is None:
            error = (f"this line has no id and its default id {natural!r} (the line number) is already "
                     f"used by an earlier line; give this line an id")
    row = obj.get(ROW_KEY) if obj else None
    if error is None:
        return Request(id=name, line=line, openai=openai, row=row, **fields)
    return LineError(name, line, error, openai=openai, row=row)


def read_jobs(path) -> tuple[list[Request], list[LineError]]:
    """The whole job file at once (small files, tests, the API): requests and errors, each in
    file order, with stream_jobs' ids."""
    requests, errors = [], []
    for item in stream_jobs(path):
        (errors if isinstance(item, LineError) else requests).append(item)
    return requests, errors


def windows(items, size: int) -> Iterator[list]:
    """`items` in consecutive lists of `size` (the last may be shorter), read lazily."""
    window = []
    for item in items:
        window.append(item)
        if len(window) >= size:
            yield window
            window = []
    if window:
        yield window


def count_lines(path, block: int = 1 << 20) -> int:
    """Lines in a file, by counting newline bytes (a last line without one counts too):
    what the progress bar measures against, without parsing anything."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(block):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _numbered_lines(path, line: int = 0, offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number, start offset, raw line) from the line after `line`, which ends at byte
    `offset`."""
    # Bytes, split on b"\n" only: each line is decoded on its own so one bad
    # byte spoils one line, and U+2028 inside a JSON string is not a break.
    with _open_job(path) as f:
        try:
            f.seek(offset)
            for line, raw in enumerate(f, start=line + 1):
                yield line, offset, raw
                offset += len(raw)
        except OSError as e:
            raise JobFileError(f"cannot read job file {path}: {e.strerror}") from None


def _lines_at(path, where) -> Iterator[tuple[int, int, bytes]]:
    """The lines at (line, start offset, ...) places, read one by one."""
    if not where:
        return
    with _open_job(path) as f:
        try:
            for line, begin, *_ in where:
                f.seek(begin)
                yield line, begin, f.readline()
        except OSError as e:
            raise JobFileError(f"cannot read job file {path}: {e.strerror}") from None


def _open_job(path):
    if os.path.isdir(path):
        raise JobFileError(f"job file {path} is a directory; give a .jsonl file")
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise JobFileError(f"job file {path} does not exist") from None
    except OSError as e:
        raise JobFileError(f"cannot read job file {path}: {e.strerror}") from None


def _decode(raw: bytes, first: bool) -> dict | None:
    if first and raw.startswith(b"\xef\xbb\xbf"):  # BOM left by some Windows editors
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(f"line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                       f"{e.start + 1}); save the job file as UTF-8") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Invalid(f"invalid JSON at column {e.colno}: {e.msg}; each line must be one "
                       f"JSON object like {_EXAMPLE}") from None
    if not isinstance(obj, dict):
        raise _Invalid(f"line is a JSON {_json_type(obj)}, not an object; each line must be "
                       f"one JSON object like {_EXAMPLE}")
    return obj


def _is_openai(obj: dict) -> bool:
    return "body" in obj or "custom_id" in obj


def _endpoint(obj: dict) -> str | None:
    """The OpenAI endpoint a Batch line asks for (its url, else what its body implies)."""
    if not _is_openai(obj):
        return None
    url, body = obj.get("url"), obj.get("body")
    if url in (COMPLETIONS_URL, CHAT_URL):
        return url
    return COMPLETIONS_URL if isinstance(body, dict) and body.get("prompt") is not None else CHAT_URL


def _explicit_id(obj: dict) -> str | None:
    key = "custom_id" if _is_openai(obj) else "id"
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Invalid(f"{key} must be a string or a number, got {_show(value)}")
    if value == "":
        raise _Invalid(f"{key} is empty; give a non-empty id or leave it out to use the line number")
    return str(value)


def _fields(obj: dict) -> dict:
    """The Request fields of one line, apart from id and line."""
    prefix, src = "", obj
    if _is_openai(obj):
        src, prefix = obj.get("body"), "body."
        if not isinstance(src, dict):
            raise _Invalid('an OpenAI batch line needs a "body" object holding "prompt" or "messages"')
        _check_openai_envelope(obj, src)
    has_prompt = src.get("prompt") is not None
    has_messages = src.get("messages") is not None
    if has_prompt and has_messages:
        raise _Invalid(f'give either {prefix}prompt or {prefix}messages, not both')
    if not has_prompt and not has_messages:
        raise _Invalid(f'missing "{prefix}prompt" (or "{prefix}messages" for chat); '
                       f"e.g. {_EXAMPLE}")
    prompt = _prompt(src["prompt"], prefix) if has_prompt else None
    messages = _messages(src["messages"], prefix) if has_messages else None
    return dict(
        prompt=prompt,
        messages=messages,
        max_new_tokens=_max_new_tokens(src, prefix),
        temperature=_number(src, "temperature", prefix, low=0.0, high=None, open_low=False),
        top_p=_number(src, "top_p", prefix, low=0.0, high=1.0, open_low=True),
        stop=_stop(src.get("stop"), prefix),
        seed=_seed(src.get("seed"), prefix),
    )


def _check_openai_envelope(obj: dict, body: dict) -> None:
    method = obj.get("method")
    if method is not None and method != "POST":
        raise _Invalid(f'method must be "POST", got {_show(method)}')
    n = body.get("n")
    if n is not None and n != 1:
        raise _Invalid(f"body.n is {_show(n)} but only one completion per job is supported; "
                       f"drop n or repeat the job with other ids")
    url = obj.get("url")
    if url is None:
        return
    if url not in (COMPLETIONS_URL, CHAT_URL):
        raise _Invalid(f'url must be "{COMPLETIONS_URL}" or "{CHAT_URL}", got {_show(url)}')
    if url == COMPLETIONS_URL and body.get("messages") is not None:
        raise _Invalid(f'url is {COMPLETIONS_URL} but body has "messages"; '
                       f"use {CHAT_URL} or give body.prompt")
    if url == CHAT_URL and body.get("prompt") is not None:
        raise _Invalid(f'url is {CHAT_URL} but body has "prompt"; '
                       f"use {COMPLETIONS_URL} or give body.messages")


def _prompt(value, prefix: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{prefix}prompt must be a string, got {_show(value)}")
    if not value:
        raise _Invalid(f"{prefix}prompt is empty; give the text to continue")
    return value


def _messages(value, prefix: str) -> tuple[tuple[str, str], ...]:
    name = f"{prefix}messages"
    if not isinstance(value, list) or not value:
        raise _Invalid(f'{name} must be a non-empty list like [{{"role": "user", "content": "Hi"}}], '
                       f"got {_show(value)}")
    pairs = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _Invalid(f'{name}[{i}] must be an object with "role" and "content", '
                           f"got {_show(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise _Invalid(f"{name}[{i}].role must be one of "
                           f"{', '.join(repr(r) for r in ROLES)}, got {_show(role)}")
        if not isinstance(content, str):
            raise _Invalid(f"{name}[{i}].content must be a string, got {_show(content)}")
        pairs.append((role, content))
    return tuple(pairs)


def _max_new_tokens(src: dict, prefix: str) -> int | None:
    given = [k for k in ("max_new_tokens", "max_tokens", "max_completion_tokens")
             if src.get(k) is not None]
    if len(given) > 1:
        raise _Invalid(f"give only one of {', '.join(prefix + k for k in given)}")
    if not given:
        return None
    key, value = prefix + given[0], src[given[0]]
    if not _is_int(value) or value < 1:
        raise _Invalid(f"{key} must be an integer >= 1, got {_show(value)}")
    return value


def _number(src: dict, key: str, prefix: str, low: float, high: float | None,
            open_low: bool) -> float | None:
    value = src.get(key)
    if value is None:
        return None
    if high is None:
        wanted = f"a number >= {low:g}"
    else:
        wanted = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > low if open_low else value >= low)
          and (high is None or value <= high))
    if not ok:
        raise _Invalid(f"{prefix}{key} must be {wanted}, got {_show(value)}")
    return float(value)


def _stop(value, prefix: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _Invalid(f'{prefix}stop must be a non-empty string or a list of them, like ["\\n\\n"], '
                       f"got {_show(value)}")
    return tuple(items)


def _seed(value, prefix: str) -> int | None:
    # Non-negative and 64-bit: what torch and numpy generators both accept.
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < 2**64:
        raise _Invalid(f"{prefix}seed must be an integer in [0, 2**64), got {_show(value)}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
