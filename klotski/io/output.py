"""An output file: records written durably, and resuming an interrupted run.

The records themselves (two forms, keyed by ``custom_id`` or ``id``) are klotski/io/records.py's.

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
* Resuming a file of millions of records stays cheap: ``read_output`` reads it once
  (``scan_file``, klotski/io/records.py: hashed keys and error spans, never the lines); the
  writer reuses that pass when the file has not changed since (same inode, size and
  mtime), else reads it again.

This module only uses the standard library.
"""
from __future__ import annotations

import json
import os

try:
    import fcntl
except ImportError:  # not on Windows; the lock is a safety net, not a requirement
    fcntl = None

from klotski.errors import JobFileError
from klotski.io.idset import IdSet
from klotski.io.records import Scan, file_identity, record_key, scan_file
from klotski.util.writes import replacing


# ---------------------------------------------------------------- reading


def read_output(path) -> Scan | None:
    """What resuming needs from an existing output, read once without creating, locking or
    repairing it (the writer does that later, reusing this scan if the file has not changed
    since): its finished keys, hashed (8 bytes a record), known before the run plans or loads
    anything. None when there is no readable file."""
    try:
        with open(path, "rb") as f:
            return scan_file(f)
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
        if known is not None and known.identity == file_identity(os.fstat(self._fd)):
            scan = known  # read by read_output, and the file has not changed since
        else:
            with open(self._fd, "rb", closefd=False) as f:
                scan = scan_file(f)
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
        keep, at = [], 0
        for i in range(0, len(drop), 2):
            keep.append((at, drop[i]))
            at = drop[i + 1]
        keep.append((at, end))
        with replacing(self.path) as tmp, open(self._fd, "rb", closefd=False) as src, open(tmp, "wb") as dst:
            os.fchmod(dst.fileno(), os.fstat(self._fd).st_mode & 0o7777)
            for start, stop in keep:
                src.seek(start)
                while start < stop:
                    piece = src.read(min(stop - start, 1 << 20))
                    dst.write(piece)
                    start += len(piece)
        # Lock the new file before letting go of the old one, so no other run slips in.
        old, self._fd = self._fd, self._open_locked()
        os.close(old)

    def _terminate_last_line(self) -> None:
        # A complete record missing only its newline (hand-edited file): finish the line.
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")
            os.fsync(self._fd)
