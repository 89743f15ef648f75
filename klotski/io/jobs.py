"""Job files in: a job file read as a stream of checked lines, each answered under a unique id.

What one line may hold, and its checks, are klotski/io/requests.py's.

A line without an id gets its 1-based line number as id; numeric ids become
strings. Blank lines are skipped.

Bad lines never stop the run: each becomes a ``LineError`` (written to the
output as ``{"id", "error": {"line", "message"}}``) and the other lines go on.
Ids in the output are unique: when two lines claim the same id the first (in file
order) keeps it, and the error record of a later one gets the id ``"<id>#line<N>"``.
A line without an id, or whose id cannot be read (bad JSON, not UTF-8), claims its
line number; a later line stating that number as its id is then the duplicate. The
file is read as a stream (``stream_jobs``): what is remembered of earlier lines is
only their ids, hashed (klotski/io/idset.py), so duplicates are found wherever they are
without holding the file.

Output records are klotski/io/records.py's; writing them and resuming, klotski/io/output.py's.

This module only uses the standard library: tokenizing and generating belong to
the engine.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Iterator

from klotski.errors import JobFileError
from klotski.io.idset import IdSet, id_hash
from klotski.io.requests import (CHAT_URL, EXAMPLE_LINE, ROW_KEY, InvalidLine, LineError, Request, explicit_id,
                                 line_fields, openai_endpoint)


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
            except InvalidLine as e:  # (one naming a custom_id was meant as an OpenAI request)
                yield line, begin, begin + len(raw), _MEANT_OPENAI if b'"custom_id"' in raw else {}, str(e)
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
_MEANT_OPENAI = {"custom_id": None}  # an unreadable line that names a custom_id


def _item(line: int, obj, error, done, claim):
    """One row: its Request, LineError, None (done earlier) or _BLANK; `claim(id)` gives the
    id it is answered under and whether it owns its natural id."""
    explicit, openai = None, None
    unreadable = error is not None  # not JSON (or not an object): no field of it can be read
    if unreadable and obj is _MEANT_OPENAI:
        openai = CHAT_URL  # answered in OpenAI's form, as the requests around it are
    if error is None:
        if obj is None:
            return _BLANK
        try:
            openai = openai_endpoint(obj)
            explicit = explicit_id(obj)
        except InvalidLine as e:
            error = str(e)
    natural = explicit if explicit is not None else str(line)
    name, fresh = claim(natural)
    if fresh and done is not None and name in done:
        return None
    if error is None:
        try:
            fields = line_fields(obj)
        except InvalidLine as e:
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
    code = {"code": "invalid_json_line"} if unreadable else {}
    return LineError(name, line, error, openai=openai, row=row, **code)


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
        raise InvalidLine(f"line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                          f"{e.start + 1}); save the job file as UTF-8") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidLine(f"invalid JSON at column {e.colno}: {e.msg}; each line must be one "
                          f"JSON object like {EXAMPLE_LINE}") from None
    if not isinstance(obj, dict):
        raise InvalidLine(f"line is a JSON {_json_type(obj)}, not an object; each line must be "
                          f"one JSON object like {EXAMPLE_LINE}")
    return obj


def _json_type(value) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
