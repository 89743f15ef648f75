"""The progress sidecar: what lets a rerun of a long job write its next record in seconds.

Without it a rerun reads the whole output (one pass over every finished record) and the
whole job file (one JSON parse per finished line) before it finds the first line left to
do: about 10 µs a line, so over a minute for 5 million lines half done. Beside the output
``OUT`` a run keeps ``OUT.klotski-progress/``:

* ``state.json`` — the commit point, replaced atomically every few seconds (at a window's
  end) and when the run ends: the job file's identity (size, mtime, a hash of its first
  64 KiB), the *watermark* ``line``/``offset`` ("every job line up to ``line``, which ends
  at byte ``offset``, is done or has its record in the output"), the output's length at
  that moment and a hash of its last 4 KiB, how many hashes of each file below are valid,
  and the lines before the watermark whose record is an error (with the record's byte span).
* ``seen`` — the 64-bit hashes (klotski/io/idset.py, stable across processes) of the ids the
  lines up to the watermark claimed, appended window by window: a later duplicate of one of
  them is still found.
* ``done`` — the hashes of the ids finished before this run started, written once: a line
  after the watermark whose id is among them is skipped, as in a full pass.

A rerun that finds a state matching the job file and the output seeks the job file to the
watermark, reads the output only beyond the recorded length, drops the error records the
state lists and runs their lines again (error records are retried, as in a full pass).
Anything that does not match — the job file changed, the output shorter or different at
the recorded end, a torn or missing file — means the full pass of klotski/io/output.py and
klotski/io/jobs.py: never a wrong skip, never an id twice. The state is removed before the
output is modified on opening (klotski/generate.py), so a state never describes bytes that
were rewritten; it is written again at the next window's end.

Every window's end is a consistent moment: the engine finishes a window's sequences before
it starts the next, so all records of lines up to the watermark are in the file and none
of the lines after it has a record before the recorded length except the ones ``done``
holds.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from array import array
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

from klotski.io.idset import IdSet
from klotski.io.jobs import Mark, Start
from klotski.io.records import Scan, scan_file
from klotski.util.writes import fsync_dir, replace_atomically

VERSION = 1
HEAD = 1 << 16   # job file bytes hashed for its identity
TAIL = 4096      # output bytes hashed before the recorded length
INTERVAL_S = 3.0
MAX_ERRORS = 100_000  # more error lines than this before the watermark: the state stops advancing


def sidecar(out_path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".klotski-progress")


def job_identity(path) -> dict:
    """What must not change for a watermark in the job file to stay valid."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        head = blake2b(f.read(HEAD), digest_size=16).hexdigest()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": head}


@dataclass
class Resume:
    """A valid sidecar, read back: where the job file picks up, and the output as the
    writer would have scanned it (only its tail beyond the state was read)."""
    start: Start
    scan: Scan


def load(out_path, jobs_path) -> Resume | None:
    """The sidecar beside `out_path` if it matches the job file and the output, else None
    (the caller does the full pass)."""
    d = sidecar(out_path)
    try:
        state = json.loads((d / "state.json").read_bytes())
        if state.get("version") != VERSION or state["job"] != job_identity(jobs_path):
            return None
        size = state["output"]["size"]
        with open(out_path, "rb") as f:
            if os.fstat(f.fileno()).st_size < size or _tail_hash(f, size) != state["output"]["tail"]:
                return None
            f.seek(size)
            tail = scan_file(f, base=size)
        seen, done = _read_hashes(d / "seen", state["seen"]), _read_hashes(d / "done", state["done"])
        entries = [(int(line), int(begin), str(name), int(a), int(b)) for line, begin, name, a, b in state["errors"]]
        line, offset, records = int(state["line"]), int(state["offset"]), int(state["records"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if seen is None or done is None:
        return None
    ok = IdSet.from_hashes(done)
    for h in tail.ok.hashes():
        ok.add_hash(h)
    errors, spans = IdSet(), array("q")
    for _, _, name, a, b in sorted(entries, key=lambda e: e[3]):
        errors.add(name)
        spans.extend((a, b))
    for h in tail.errors.hashes():
        errors.add_hash(h)
    spans.extend(tail.error_spans)
    scan = Scan(ok, errors, spans, tail.good_end, tail.end, tail.corrupt, tail.foreign and size == 0,
                size > 0 or tail.seen_any, tail.identity, ok_records=records - len(entries) + len(tail.ok))
    replay = [(line_, begin, name) for line_, begin, name, _, _ in sorted(entries) if name not in ok]
    return Resume(Start(line, offset, IdSet.from_hashes(seen), replay), scan)


def invalidate(out_path) -> None:
    """Remove the state before the output is modified (repaired, rewritten, truncated): a
    crash from here until the next state is written means a full pass, never a wrong skip."""
    try:
        os.unlink(sidecar(out_path) / "state.json")
    except FileNotFoundError:
        return
    fsync_dir(sidecar(out_path))


class Tracker:
    """Keeps the sidecar of one run: `window_done` after each window's last record,
    `error` after each error record written, `close` at the end (whatever the reason)."""

    def __init__(self, out_path, jobs_path, writer, resume: Resume | None):
        self.out_path, self.dir = Path(out_path), sidecar(out_path)
        self.writer = writer
        self.job = job_identity(jobs_path)
        self.dir.mkdir(exist_ok=True)
        start = resume.start if resume else None
        self.line, self.offset = (start.line, start.offset) if start else (0, 0)
        self.seen_count = len(start.seen) if start else 0
        self.done_count = len(writer.done_ids)
        hashes = array("Q", writer.done_ids.hashes())
        with open(self.dir / "done", "wb") as f:
            f.write(hashes.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.seen = open(self.dir / "seen", "r+b" if start and (self.dir / "seen").exists() else "w+b")
        self.seen.truncate(self.seen_count * 8)
        self.seen.seek(0, os.SEEK_END)
        self.entries: list = []   # error lines before the watermark: [line, start, id, span start, span end]
        self.pending: list = []   # error records of the window in progress: (line, id, span)
        self.size = self.records = None  # the output at the watermark
        self.committed_at = time.monotonic()
        self.frozen = False
        if start and not start.replay and not writer.retried and not writer.repaired_bytes:
            # Nothing was rewritten and nothing waits to be replayed: the loaded watermark holds
            # for the output as it is now (its tail's finished ids are in `done`), so a kill before
            # this run's first window ends still leaves a sidecar.
            self.size, self.records = os.path.getsize(self.out_path), len(writer)
            self.commit()

    def error(self, line: int, rid: str, span) -> None:
        self.pending.append((line, rid, span))

    def window_done(self, mark: Mark) -> None:
        if self.frozen:
            return
        self.seen.write(mark.claimed.tobytes())
        self.seen_count += len(mark.claimed)
        self.entries.extend([line, mark.starts[line], rid, a, b] for line, rid, (a, b) in self.pending)
        self.pending = []
        self.line, self.offset = mark.line, mark.offset
        self.size, self.records = os.path.getsize(self.out_path), len(self.writer)
        if len(self.entries) > MAX_ERRORS:
            self.frozen = True  # the last state written stays: reruns past it take the full pass
            return
        if time.monotonic() - self.committed_at >= INTERVAL_S:
            self.commit()

    def commit(self) -> None:
        if self.size is None:
            return
        self.seen.flush()
        os.fsync(self.seen.fileno())
        with open(self.out_path, "rb") as f:
            tail = _tail_hash(f, self.size)
        state = {"version": VERSION, "job": self.job, "line": self.line, "offset": self.offset,
                 "output": {"size": self.size, "tail": tail}, "records": self.records,
                 "seen": self.seen_count, "done": self.done_count, "errors": self.entries}
        replace_atomically(self.dir / "state.json", json.dumps(state).encode())
        self.committed_at = time.monotonic()

    def close(self) -> None:
        """Write the last state (the last whole window's); a run that left no output leaves
        no sidecar either."""
        try:
            if os.path.exists(self.out_path):
                if not self.frozen:
                    self.commit()
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            self.seen.close()


def _tail_hash(f, size: int) -> str:
    at = max(0, size - TAIL)
    f.seek(at)
    data = f.read(size - at)
    if len(data) != size - at:
        raise ValueError("output shorter than recorded")
    return blake2b(data, digest_size=16).hexdigest()


def _read_hashes(path: Path, count: int) -> array | None:
    data = array("Q")
    with open(path, "rb") as f:
        raw = f.read(count * 8)
    if len(raw) != count * 8:
        return None  # torn: fewer hashes than the state promised
    data.frombytes(raw)
    return data
