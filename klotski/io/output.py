"""Output records, written durably, and resuming an interrupted run.

Two record forms (``--output-format``; ``auto`` answers each line in its own form):

* klotski: ``{"id", "completion", "finish_reason", "prompt_tokens", "completion_tokens"}``
  (+ ``token_ids``); a line that cannot be served: ``{"id", "error": {"line", "message"}}``.
* openai: an OpenAI Batch output line, ``{"id": "batch_req_…", "custom_id", "response":
  {"status_code": 200, "request_id", "body": <chat.completion | text_completion>}, "error":
  null}``; a line that cannot be served: ``"response": null, "error": {"code", "message"}``.

A record's key is its ``custom_id`` in the OpenAI form, its ``id`` otherwise: that is what
resume skips and what is never written twice.

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
* Resuming a file of millions of records stays cheap: ``read_output`` reads it once,
  keeping keys as 64-bit hashes (klotski/io/idset.py) and error lines as byte spans, and
  recognises the records Klotski itself wrote by their opening (``{"id": "…", "completion":``)
  instead of parsing each in full; the writer reuses that pass when the file has not
  changed since (same inode, size and mtime), else reads it again.

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

try:
    import fcntl
except ImportError:  # not on Windows; the lock is a safety net, not a requirement
    fcntl = None

from klotski.io.idset import IdSet
from klotski.io.jobs import CHAT_URL, COMPLETIONS_URL, JobFileError
from klotski.util.writes import fsync_dir

FORMATS = ("auto", "klotski", "openai")


# ---------------------------------------------------------------- records


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
    """The output line of a job that cannot be served (a klotski.io.jobs.LineError)."""
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


def read_output(path) -> Scan | None:
    """What resuming needs from an existing output, read once without creating, locking or
    repairing it (the writer does that later, reusing this scan if the file has not changed
    since): its finished keys, hashed (8 bytes a record), known before the run plans or loads
    anything. None when there is no readable file."""
    try:
        with open(path, "rb") as f:
            return _scan_file(f)
    except OSError:
        return None


# ---------------------------------------------------------------- writing


class OutputWriter:
    """Appends one JSON record per line, durably, never writing an id twice.

    After opening: ``done_ids`` holds the ids of successful records from earlier
    runs (empty with ``resume=False``), hashed (a klotski.io.idset.IdSet: ``in`` and
    ``len``, 8 bytes an id, so a file of millions of records is cheap to resume); ``retried`` counts error records that
    were removed so their jobs run again; ``corrupt_lines`` counts unreadable
    lines kept in the middle of the file; ``repaired_bytes`` counts bytes cut
    off the end. ``duplicates`` counts ``write`` calls ignored because their id
    was already in the file.
    """

    def __init__(self, path, *, resume: bool = True, known: Scan | None = None):
        self.path = os.fspath(path)
        self.done_ids = IdSet()
        self.retried = 0
        self.corrupt_lines = 0
        self.repaired_bytes = 0
        self.duplicates = 0
        self._written = IdSet()  # keys written by this writer (with done_ids: never written twice)
        self._earlier = 0  # successful records found in the file on opening
        self.last_span = None  # (start, end) byte offsets of the last record written
        if os.path.isdir(self.path):
            raise JobFileError(f"output {self.path} is a directory; give a file name")
        parent = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise JobFileError(f"cannot create directory {parent} for the output: {e.strerror}") from None
        self._created = not os.path.exists(self.path)
        self._fd = self._open_locked()
        try:
            if resume:
                self._recover(known)
            else:
                os.ftruncate(self._fd, 0)
                os.fsync(self._fd)
        except BaseException:
            self.close()
            raise

    # -- public

    def write(self, record: dict) -> bool:
        """Append ``record``; False (and ``duplicates`` += 1) if its id is already in the file."""
        if self._fd is None:
            raise ValueError("OutputWriter is closed")
        rid = record_key(record)
        if rid is None:
            raise ValueError(f"record needs a string id (or custom_id), got {record!r}")
        if rid in self:  # (a hash collision counts too: a rerun writes it)
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
        self._written.add(rid)
        self.last_span = (size, size + len(data))
        return True

    def __contains__(self, rid: str) -> bool:
        return rid in self._written or rid in self.done_ids

    def __len__(self) -> int:
        """Records in the file (successes kept from earlier runs and everything written since)."""
        return self._earlier + len(self._written)

    def close(self) -> None:
        if self._fd is not None:
            if self._created and os.fstat(self._fd).st_size == 0:
                os.unlink(self.path)  # a run that wrote nothing leaves no empty file behind
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

    def _recover(self, known: Scan | None) -> None:
        os.lseek(self._fd, 0, os.SEEK_SET)
        if known is not None and known.identity == _identity(os.fstat(self._fd)):
            scan = known  # read by read_output, and the file has not changed since
        else:
            with open(self._fd, "rb", closefd=False) as f:
                scan = _scan_file(f)
        if not scan.seen_any:
            return
        # A crash leaves at most one unterminated line; whole corrupt lines and
        # no record at all mean this file was never ours.
        if scan.good_end == 0 and scan.foreign:
            raise JobFileError(f"output {self.path} exists but no line in it is a result record; "
                               f"choose another -o, or pass --no-resume to overwrite it")
        self.repaired_bytes = scan.end - scan.good_end
        self.corrupt_lines = scan.corrupt
        self.retried = sum(not scan.ok.has_hash(h) for h in scan.errors.hashes())
        if scan.error_spans:
            self._rewrite(scan.error_spans, scan.good_end)
        elif self.repaired_bytes:
            os.ftruncate(self._fd, scan.good_end)
            os.fsync(self._fd)
        self.done_ids = scan.ok
        self._earlier = len(scan.ok) if scan.ok_records is None else scan.ok_records
        self._terminate_last_line()

    def _rewrite(self, drop, end: int) -> None:
        """Copy the file up to `end` without the byte spans in `drop` (start, end pairs)."""
        tmp = self.path + ".klotski-tmp"
        keep, at = [], 0
        for i in range(0, len(drop), 2):
            keep.append((at, drop[i]))
            at = drop[i + 1]
        keep.append((at, end))
        with open(self._fd, "rb", closefd=False) as src, open(tmp, "wb") as dst:
            for start, stop in keep:
                src.seek(start)
                while start < stop:
                    piece = src.read(min(stop - start, 1 << 20))
                    dst.write(piece)
                    start += len(piece)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp, os.fstat(self._fd).st_mode & 0o7777)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        # Lock the new file before letting go of the old one, so no other run slips in.
        old, self._fd = self._fd, self._open_locked()
        os.close(old)

    def _terminate_last_line(self) -> None:
        # A complete record missing only its newline (hand-edited file): finish the line.
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")
            os.fsync(self._fd)


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


def _identity(st) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _scan_file(f, base: int = 0) -> Scan:
    """The file from byte `base` on (where `f` is), offsets counted from the file's start."""
    identity = _identity(os.fstat(f.fileno()))
    ok, errors, error_spans = IdSet(), IdSet(), array("q")
    good_end = offset = base
    corrupt = corrupt_since = 0
    foreign = seen_any = False
    for raw in f:
        seen_any = True
        start, offset = offset, offset + len(raw)
        kind, rid = _classify(raw)
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


def _classify(raw: bytes) -> tuple[str, str | None]:
    if raw.endswith(b"}\n"):
        try:
            if m := _KLOTSKI.match(raw):
                return ("ok" if m.group(2) == b"completion" else "error"), _key(m.group(1))
            if m := _OPENAI.match(raw):
                ok = raw.endswith(b', "error": null}\n') and not raw.startswith(b"null", m.end())
                return ("ok" if ok else "error"), _key(m.group(1))
        except ValueError:  # not UTF-8, a bad escape: the full parse says what it is
            pass
    return _parse(raw)


def _key(escaped: bytes) -> str:
    return escaped.decode("utf-8") if b"\\" not in escaped else json.loads(b'"' + escaped + b'"')


def _parse(raw: bytes) -> tuple[str, str | None]:
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
