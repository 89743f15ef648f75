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
Ids in the output are unique: when two lines claim the same id the first keeps
it, and the error record of a later one gets the id ``"<id>#line<N>"``. A line
whose id cannot be read (bad JSON, not UTF-8) is named by its line number, but
never takes an id that another line states explicitly.

Output and resume semantics (``OutputWriter``):

* Each record is one JSON line written with a single ``write`` call, then
  flushed and fsync'ed, so a crash loses at most the record being written.
* Successful records are *done*: a rerun skips their ids.
* Error records are *not* done. On resume they are removed from the file and
  their jobs are tried again, because the usual fix for an error is to edit the
  job file (or raise a limit) and rerun; an unfixed job simply gets the same
  error record again, at the end of the file. Removing them keeps every id
  unique once the retried job succeeds. If an id somehow has both kinds of
  record, the success wins.
* A last line cut short by a crash (or anything after the last valid record)
  is cut off. In-place truncation is enough for that: it only removes bytes
  that are garbage anyway, so a crash during repair leaves a file that the
  next repair handles the same way. Dropping error records from the middle
  needs a rewrite, done into a temporary file that atomically replaces the
  output, so a crash leaves either the old or the new file, never a mix.
* A corrupt line followed by valid ones is kept verbatim (it might be
  something a user wants to inspect) but its id, if any, is not done.
* An existing file with lines but no valid record is refused rather than
  truncated: it is probably not a Klotski output (a typo in ``-o``).
* The output is locked (flock) while a writer is open, so two runs writing the
  same file fail fast instead of duplicating ids.
* ``resume=False`` (``--no-resume``) truncates an existing output.

This module only uses the standard library: tokenizing and generating belong to
the engine.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

try:
    import fcntl
except ImportError:  # not on Windows; the lock is a safety net, not a requirement
    fcntl = None

ROLES = ("system", "user", "assistant")
COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
_EXAMPLE = '{"id": "q1", "prompt": "Hello"}'


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

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]


@dataclass(frozen=True)
class LineError:
    """A job that cannot be served; ``message`` says what is wrong and how to fix it."""

    id: str
    line: int
    message: str

    def record(self) -> dict:
        return {"id": self.id, "error": {"line": self.line, "message": self.message}}

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
    return LineError(request.id, request.line, message)


# ---------------------------------------------------------------- reading


class _Invalid(Exception):
    """A user-facing reason why one line is rejected."""


def read_jobs(path) -> tuple[list[Request], list[LineError]]:
    """Validate every line of a job file; returns requests and errors, each in file order."""
    parsed = []  # [line, explicit id or None, request fields or None, error or None]
    for line, raw in _numbered_lines(path):
        explicit, fields, error = None, None, None
        try:
            obj = _decode(raw, first=line == 1)
            if obj is None:
                continue
            explicit = _explicit_id(obj)
            fields = _fields(obj)
        except _Invalid as e:
            error = str(e)
        parsed.append([line, explicit, fields, error])

    names, owner = _assign_ids(parsed)
    requests, errors = [], []
    for line, explicit, fields, error in parsed:
        if error is None:
            requests.append(Request(id=names[line], line=line, **fields))
            continue
        name = names.get(line)
        if name is None:  # its id belongs to another line: name the error record apart
            name = f"{explicit if explicit is not None else line}#line{line}"
            while name in owner:
                name += "#"
            owner[name] = line
        errors.append(LineError(name, line, error))
    return requests, errors


def _assign_ids(parsed: list[list]) -> tuple[dict[int, str], dict[str, int]]:
    """Give each line its id (line -> id) unless another line owns it (id -> line).

    Lines that state an id claim first, in file order, so a line without one
    (or one too broken to read) never takes a user's id. Valid lines that lose
    their id get a duplicate-id error here.
    """
    names: dict[int, str] = {}
    owner: dict[str, int] = {}
    for entry in parsed:
        line, explicit, _, error = entry
        if explicit is None:
            continue
        if explicit in owner:
            entry[3] = error or (f"duplicate id {explicit!r}: line {owner[explicit]} already "
                                 f"uses it; give each job a unique id")
        else:
            owner[explicit], names[line] = line, explicit
    for entry in parsed:
        line, explicit, _, error = entry
        if explicit is not None:
            continue
        default = str(line)
        if default not in owner:
            owner[default], names[line] = line, default
        elif error is None:
            entry[3] = (f"this line has no id and its default id {default!r} (the line number) "
                        f"is already used by line {owner[default]}; give this line an id")
    return names, owner


def _numbered_lines(path) -> Iterator[tuple[int, bytes]]:
    # Bytes, split on b"\n" only: each line is decoded on its own so one bad
    # byte spoils one line, and U+2028 inside a JSON string is not a break.
    if os.path.isdir(path):
        raise JobFileError(f"job file {path} is a directory; give a .jsonl file")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise JobFileError(f"job file {path} does not exist") from None
    except OSError as e:
        raise JobFileError(f"cannot read job file {path}: {e.strerror}") from None
    with f:
        try:
            yield from enumerate(f, start=1)
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


# ---------------------------------------------------------------- batching


def sort_for_batching(requests: Iterable[Request], lengths: dict[str, int]) -> list[Request]:
    """Longest prompt first (stable), so batches hold prompts of similar length."""
    return sorted(requests, key=lambda r: -lengths[r.id])


def batches(items: Sequence, batch_size: int) -> Iterator[list]:
    """Consecutive chunks of ``batch_size`` items; the last one may be shorter."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    items = list(items)
    for start in range(0, len(items), batch_size):
        yield items[start:start + batch_size]


# ---------------------------------------------------------------- writing


class OutputWriter:
    """Appends one JSON record per line, durably, never writing an id twice.

    After opening: ``done_ids`` holds the ids of successful records from earlier
    runs (empty with ``resume=False``); ``retried`` counts error records that
    were removed so their jobs run again; ``corrupt_lines`` counts unreadable
    lines kept in the middle of the file; ``repaired_bytes`` counts bytes cut
    off the end. ``duplicates`` counts ``write`` calls ignored because their id
    was already in the file.
    """

    def __init__(self, path, *, resume: bool = True):
        self.path = os.fspath(path)
        self.done_ids: set[str] = set()
        self.retried = 0
        self.corrupt_lines = 0
        self.repaired_bytes = 0
        self.duplicates = 0
        self._present: set[str] = set()
        if os.path.isdir(self.path):
            raise JobFileError(f"output {self.path} is a directory; give a file name")
        parent = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise JobFileError(f"cannot create directory {parent} for the output: {e.strerror}") from None
        self._fd = self._open_locked()
        try:
            if resume:
                self._recover()
            else:
                os.ftruncate(self._fd, 0)
                os.fsync(self._fd)
            self._present |= self.done_ids
        except BaseException:
            self.close()
            raise

    # -- public

    def write(self, record: dict) -> bool:
        """Append ``record``; False (and ``duplicates`` += 1) if its id is already in the file."""
        if self._fd is None:
            raise ValueError("OutputWriter is closed")
        rid = record.get("id")
        if not isinstance(rid, str):
            raise ValueError(f"record needs a string id, got {rid!r}")
        if rid in self._present:
            self.duplicates += 1
            return False
        # allow_nan=False: NaN is not JSON, and the file must stay readable by any parser.
        text = json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from a tokenizer: escape them
            data = (json.dumps(record, allow_nan=False) + "\n").encode("ascii")
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            # Cut a half-written line (disk full...) so later records stay on their own lines.
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise
        self._present.add(rid)
        return True

    def __contains__(self, rid: str) -> bool:
        return rid in self._present

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the lock
            self._fd = None

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- opening and repair

    def _open_locked(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise JobFileError(f"cannot open output {self.path}: {e.strerror}") from None
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A run that replaced the file while we waited leaves us holding a dead inode.
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                raise BlockingIOError
        except OSError:
            os.close(fd)
            raise JobFileError(f"output {self.path} is in use by another klotski run; "
                               f"wait for it or choose another -o") from None
        return fd

    def _scan(self):
        """Classify every line: returns (entries, end of the last valid record).

        entries: (start, end, kind, id) with kind "ok", "error", "blank" or
        "corrupt"; ``foreign`` is True when a complete line is corrupt.
        """
        entries, good_end, offset, foreign = [], 0, 0, False
        os.lseek(self._fd, 0, os.SEEK_SET)
        with open(self._fd, "rb", closefd=False) as f:
            for raw in f:
                start, offset = offset, offset + len(raw)
                kind, rid = _classify(raw)
                entries.append((start, offset, kind, rid))
                if kind in ("ok", "error"):
                    good_end = offset
                foreign |= kind == "corrupt" and raw.endswith(b"\n")
        return entries, good_end, foreign

    def _recover(self) -> None:
        entries, good_end, foreign = self._scan()
        if not entries:
            return
        # A crash leaves at most one unterminated line; whole corrupt lines and
        # no record at all mean this file was never ours.
        if good_end == 0 and foreign:
            raise JobFileError(f"output {self.path} exists but no line in it is a result record; "
                               f"choose another -o, or pass --no-resume to overwrite it")
        kept = [e for e in entries if e[1] <= good_end]
        self.repaired_bytes = entries[-1][1] - good_end
        ok_ids = {rid for _, _, kind, rid in kept if kind == "ok"}
        self.corrupt_lines = sum(kind == "corrupt" for _, _, kind, _ in kept)
        self.retried = len({rid for _, _, kind, rid in kept if kind == "error"} - ok_ids)
        if any(kind == "error" for _, _, kind, _ in kept):
            self._rewrite([e for e in kept if e[2] != "error"])
        elif self.repaired_bytes:
            os.ftruncate(self._fd, good_end)
            os.fsync(self._fd)
        self.done_ids = ok_ids
        self._terminate_last_line()

    def _rewrite(self, keep) -> None:
        tmp = self.path + ".klotski-tmp"
        with open(self._fd, "rb", closefd=False) as src, open(tmp, "wb") as dst:
            for start, end, _, _ in keep:
                src.seek(start)
                dst.write(src.read(end - start))
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp, os.fstat(self._fd).st_mode & 0o7777)
        os.replace(tmp, self.path)
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        # Lock the new file before letting go of the old one, so no other run slips in.
        old, self._fd = self._fd, self._open_locked()
        os.close(old)

    def _terminate_last_line(self) -> None:
        # A complete record missing only its newline (hand-edited file): finish the line.
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")
            os.fsync(self._fd)


def _classify(raw: bytes) -> tuple[str, str | None]:
    if not raw.strip():
        return "blank", None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "corrupt", None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return "corrupt", None
    return ("error" if "error" in obj else "ok"), obj["id"]


def _fsync_dir(path: str) -> None:
    # Makes the rename itself durable; not possible (nor needed) on every platform.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
