"""The server's durable state under --data-dir: uploaded files and batches.

    DIR/lock                    flock'ed by the one server using DIR
    DIR/files/<id>.json         a FileObject (openai.types.FileObject), its content beside it
    DIR/files/<id>.jsonl
    DIR/batches/<id>/batch.json a Batch (openai.types.Batch); jobs.jsonl (the input as the run
                                reads it), run.jsonl (the run's records), report.json
    DIR/crashes/<time>-<hex>.txt the traceback of an unexpected failure, named in its one-line log

Every metadata write is a whole new file fsynced and renamed over the old one (and the
directory fsynced), so a crash leaves the old or the new object, never half of one; a reply
that says a batch was accepted comes after its object is on disk. Ids are opaque
(`file-<hex>`, `batch_<hex>`) and checked against their pattern before they are joined to a
path: an id like `../../etc/passwd` is simply unknown.

A write that fails (a full disk, a file-size limit, a read-only mount) never stops the
server: creating an object raises `StoreFailed` (the route answers 507 at once); a batch's
state change is kept in memory and its save retried (`recover`) until the disk takes it, and
meanwhile `trouble` says what is wrong (GET /health: degraded). Every write goes through
`faults.check`, the seam tests fail them through (klotski/serve/faults.py).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
import traceback
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Windows: the lock is a safety net, not a requirement
    fcntl = None

from klotski.errors import UserError
from klotski.serve.faults import Faults
from klotski.serve.worker import log
from klotski.util.writes import fsync_dir, reason, replace_atomically

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# a batch whose server stopped midway resumes in these states on the next start
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
RETRY_S = 1.0  # while the data dir refuses writes, they are tried again this often


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class StoreFailed(Exception):
    """The data dir did not take a write; the message says so to an API user."""

    def __init__(self, message: str, error: OSError):
        super().__init__(message)
        self.errno = error.errno


def write_json(path: Path, obj: dict, faults: Faults) -> None:
    """`obj` as `path`, durably and atomically (util.writes: fsync, rename; then the directory),
    the fault seam consulted first as for a temporary file beside it."""
    data = json.dumps(obj).encode()
    faults.check(path.with_name(path.name + ".tmp"), len(data))
    replace_atomically(path, data)


class Store:
    """Files and batches in memory, each change written through to disk before its caller
    hears it is done. `lock` guards the dicts and is never held across a write to the disk:
    a request that only reads them (DELETE's in-use check, /health) never waits on an fsync."""

    def __init__(self, root: Path, faults: Faults | None = None):
        self.root = Path(root)
        self.files_dir, self.batches_dir = self.root / "files", self.root / "batches"
        self.crashes_dir = self.root / "crashes"
        self.faults = faults or Faults(None)
        self.trouble: str | None = None  # why the data dir is not taking writes, until it does again
        self.unsaved: set[str] = set()   # batches whose latest state is not on disk yet
        self.retry_at = 0.0              # (time.monotonic) a refused write is not tried again before this
        try:
            for d in (self.files_dir, self.batches_dir, self.root / "tmp", self.crashes_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--data-dir {self.root}: cannot create it ({e.strerror}); choose another directory")
        self._lock_fd = self._take_lock()
        self.lock = threading.RLock()  # the HTTP threads and the worker share these dicts
        self.saving = threading.Lock()  # batch states are saved one at a time: the newest is written last
        self.files = {p.stem: json.loads(p.read_text()) for p in self.files_dir.glob("file-*.json")}
        self.batches = {}
        for p in self.batches_dir.glob("batch_*/batch.json"):
            self.batches[p.parent.name] = json.loads(p.read_text())
        for tmp in (self.root / "tmp").iterdir():  # uploads cut short by a crash
            tmp.unlink(missing_ok=True)

    def _take_lock(self) -> int:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise UserError(f"--data-dir {self.root} is in use by another klotski server; stop it or "
                                "choose another --data-dir") from None
        return fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # also releases the lock
            self._lock_fd = None

    # ---- files -------------------------------------------------------------------------
    def tmp_path(self) -> Path:
        return self.root / "tmp" / secrets.token_hex(8)

    def content_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def get_file(self, file_id: str) -> dict | None:
        return self.files.get(file_id) if FILE_ID.fullmatch(file_id or "") else None

    def add_file(self, src: Path, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Take `src` (already fsynced) as a new file's content (under `file_id`, else a new id);
        OSError if its metadata cannot be written (the content goes back to `src`)."""
        fid = file_id or new_id("file-")
        # a move, not a write: `src` is whole and fsynced, the metadata written next is the commit
        os.replace(src, self.content_path(fid))
        meta = {"id": fid, "object": "file", "bytes": self.content_path(fid).stat().st_size,
                "created_at": int(time.time()), "filename": filename, "purpose": purpose, "status": "processed"}
        try:
            write_json(self.files_dir / f"{fid}.json", meta, self.faults)
        except OSError as e:
            os.replace(self.content_path(fid), src)  # (a move back)
            self.fault(e, "a file")
            raise
        with self.lock:
            self.files[fid] = meta
        return meta

    def file_in_use(self, file_id: str) -> str | None:
        """The unfinished batch that reads or writes this file, if any."""
        with self.lock:
            for b in self.batches.values():
                if b["status"] in UNFINISHED and file_id in (b["input_file_id"], b.get("output_file_id"),
                                                             b.get("error_file_id")):
                    return b["id"]
        return None

    def delete_file(self, file_id: str) -> None:
        with self.lock:
            self.files.pop(file_id, None)
        # (the object first: a crash between the two leaves no file without content)
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
        self.content_path(file_id).unlink(missing_ok=True)
        fsync_dir(str(self.files_dir))

    # ---- batches -----------------------------------------------------------------------
    def batch_dir(self, batch_id: str) -> Path:
        return self.batches_dir / batch_id

    def get_batch(self, batch_id: str) -> dict | None:
        return self.batches.get(batch_id) if BATCH_ID.fullmatch(batch_id or "") else None

    def new_batch(self, fields: dict) -> dict:
        """A new batch, on disk before it is returned; StoreFailed if the disk does not take it."""
        bid = new_id("batch_")
        batch = {"id": bid, "object": "batch", "status": "validating", "created_at": int(time.time()),
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, **fields}
        try:
            self.batch_dir(bid).mkdir()
            write_json(self.batch_dir(bid) / "batch.json", batch, self.faults)
        except OSError as e:
            self.fault(e, "a batch")
            raise StoreFailed(f"the server could not store the batch: {reason(e)}; retry later", e) from None
        with self.lock:
            self.batches[bid] = batch
        return batch

    def update(self, batch_id: str, only_if: tuple = (), **fields) -> dict | None:
        """Set fields of a batch (a new dict, so a reader never sees it half-changed) and save it;
        with `only_if`, only while its status is one of those (None if it is not: a cancel and
        the worker's next step can race, and the later must not undo the earlier). A save the
        disk refuses is retried by `recover`, never raised."""
        with self.lock:
            if only_if and self.batches[batch_id]["status"] not in only_if:
                return None
            batch = {**self.batches[batch_id], **fields}
            self.batches[batch_id] = batch
            self.unsaved.add(batch_id)
        self._save_unsaved()
        return batch

    def _save_unsaved(self) -> bool:
        """Write every batch whose state is not on disk, each as it is when written (`lock` taken
        only to read it: never across the write)."""
        with self.saving:
            with self.lock:
                pending = sorted(self.unsaved)
            for bid in pending:
                with self.lock:
                    batch = self.batches[bid]
                try:
                    write_json(self.batch_dir(bid) / "batch.json", batch, self.faults)
                except OSError as e:
                    self.fault(e, f"batch {bid}'s state")
                    return False
                with self.lock:
                    if self.batches[bid] is batch:  # (else changed meanwhile: its saver waits for `saving`)
                        self.unsaved.discard(bid)
        return True

    # ---- faults ------------------------------------------------------------------------
    def fault(self, e: OSError, what: str) -> None:
        """A write under the data dir failed: the server is degraded until `recover` succeeds."""
        first = self.trouble is None
        self.trouble = f"the data dir {self.root} cannot be written ({what}: {reason(e)})"
        self.retry_at = time.monotonic() + RETRY_S
        if first:
            log(f"{self.trouble}; finished work is kept and the server carries on when space returns")

    def recover(self) -> bool:
        """Retry what the disk refused (batch states), then a probe write; True once both take
        (False without trying within RETRY_S of the last refusal)."""
        if time.monotonic() < self.retry_at or not self._save_unsaved():
            return False
        probe = self.root / "tmp" / "probe"
        try:
            write_json(probe, {"at": time.time()}, self.faults)
            probe.unlink()
        except OSError as e:
            self.fault(e, "a probe")
            return False
        if self.trouble is not None:
            self.trouble = None
            log(f"the data dir {self.root} takes writes again")
        return True

    def save_crash(self, e: BaseException) -> str:
        """The traceback of an unexpected failure under DIR/crashes/; where it went, in words."""
        path = self.crashes_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}.txt"
        try:
            path.write_text("".join(traceback.format_exception(e)))
        except OSError as why:  # (the disk that is full)
            return f"the details could not be saved ({why.strerror})"
        return f"details in {path}"

    def unfinished(self) -> list[dict]:
        """Batches accepted and not finished, oldest first: the worker's queue after a restart."""
        with self.lock:
            return sorted((b for b in self.batches.values() if b["status"] in UNFINISHED),
                          key=lambda b: (b["created_at"], b["id"]))
