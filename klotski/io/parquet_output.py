"""A Parquet output (``-o OUT.parquet``): the input row's columns beside ``completion``,
``finish_reason``, ``prompt_tokens``, ``completion_tokens`` and ``error``, resumable after a kill;
``token_ids``, ``logprobs`` (a list of {token, logprob, top_logprobs} structs) and, for a line of
n > 1 samples, ``choices`` (a list of per-sample structs; ``completion`` is then null) where asked.

A Parquet file is only readable once its footer is written, so a run killed while writing
``OUT.parquet`` itself would leave nothing a rerun can read. Records are therefore written
as *parts*: every few hundred records (or few seconds) the buffered ones become one small
Parquet file ``OUT.parquet.parts/part-NNNNNN.parquet``, written to a temporary name, fsynced
and renamed, so a part is whole or absent — a SIGKILL loses at most the records still in the
buffer (their jobs run again), never a readable part. When the run ends the parts and any
earlier ``OUT.parquet`` are assembled, one row group per part, into a new ``OUT.parquet``
(again a temporary renamed into place); its metadata names the parts it took in, so parts
left behind by a kill during clean-up are recognised and deleted, never counted twice.

Resume is ``klotski/io/output.py``'s: ids of successful rows are done and skipped; error rows
are not done — the files holding them are rewritten without them and their jobs run again;
an id is never written twice. The finished ids are read back from the ``id`` and ``error``
columns only. The output directory is locked (flock) while a run writes it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

try:
    import fcntl
except ImportError:
    fcntl = None

from klotski.errors import JobFileError, require
from klotski.io.idset import IdSet
from klotski.util.writes import replacing

RESULT = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error")
PARTS_KEY = b"klotski_parts"
ROWS_PER_PART = 512  # records buffered before they become a part (what a SIGKILL can cost)
FLUSH_S = 5.0        # ... or seconds


def is_parquet(path) -> bool:
    return Path(path).suffix.lower() == ".parquet"


class ParquetOutput:
    """OutputWriter's interface (write, ``in``, len, done_ids, retried, close) for Parquet."""

    keeps_input = True

    def __init__(self, path, *, resume: bool = True, rows_per_part: int | None = None, flush_s: float | None = None):
        _need_pyarrow(path)  # fails here, in one line, rather than at the first flush
        self.path = Path(path)
        self.parts = self.path.with_name(self.path.name + ".parts")
        self.rows_per_part = rows_per_part or ROWS_PER_PART
        self.flush_s = FLUSH_S if flush_s is None else flush_s
        self.done_ids, self._written, self.retried, self.duplicates = IdSet(), IdSet(), 0, 0
        self.last_span = None
        self._buffer, self._flushed_at, self._earlier = [], time.monotonic(), 0
        if self.path.is_dir():
            raise JobFileError(f"output {self.path} is a directory; give a file name")
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.parts / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise JobFileError(f"cannot create {self.parts} for the output: {e.strerror}") from None
        if fcntl is not None:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lock)
                raise JobFileError(f"output {self.path} is in use by another klotski run; "
                                   f"wait for it or choose another -o") from None
        for tmp in [*self.parts.glob("*.tmp"), *self.path.parent.glob(f".{self.path.name}.*.tmp")]:
            tmp.unlink()  # a part (or an assembly) a kill cut short: its records run again
        if resume:
            self._recover()
        else:
            self.path.unlink(missing_ok=True)
            for part in self._part_files():
                part.unlink()
        # Names no earlier run used (an assembled file lists the part names it took in) that sort in
        # the order written.
        self._run, self._next = time.time_ns(), 0

    # -- the OutputWriter interface

    def write(self, record: dict) -> bool:
        rid = record["id"]
        if rid in self:
            self.duplicates += 1
            return False
        self._buffer.append(_row(record))
        self._written.add(rid)
        if len(self._buffer) >= self.rows_per_part or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()
        return True

    def __contains__(self, rid: str) -> bool:
        return rid in self._written or rid in self.done_ids

    def __len__(self) -> int:
        return self._earlier + len(self._written)

    def flush(self) -> None:
        """Write the buffered records as one part (whole or not at all)."""
        self._flushed_at = time.monotonic()
        if not self._buffer:
            return
        import pyarrow as pa
        keys = list(dict.fromkeys(k for row in self._buffer for k in row))  # (from_pylist reads the first row's)
        table = pa.Table.from_pydict({k: [row.get(k) for row in self._buffer] for k in keys})
        name = self.parts / f"part-{self._run:020d}-{self._next:06d}.parquet"
        _write_atomically(name, [table], table.schema)
        self._next += 1
        self._buffer = []

    def close(self) -> None:
        """Flush, then assemble everything written so far into OUT.parquet."""
        if self._lock is None:
            return
        try:
            self.flush()
            self._assemble()
        finally:
            os.close(self._lock)
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- resume and assembly

    def _part_files(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.parquet"))

    def _sources(self) -> list[Path]:
        return ([self.path] if self.path.exists() else []) + self._part_files()

    @staticmethod
    def finished(path) -> IdSet:
        """The ids an existing output finished, read without locking or changing anything (what
        the job reader skips, known before the run plans)."""
        _need_pyarrow(path)
        try:
            return _scan(Path(path), Path(path).with_name(Path(path).name + ".parts"), repair=False)[0]
        except JobFileError:
            return IdSet()  # the writer says what is wrong, on opening

    def _recover(self) -> None:
        import pyarrow.parquet as pq
        ok, errors, with_errors = _scan(self.path, self.parts, repair=True)
        for source in with_errors:  # error rows are retried: drop them, keep the rest
            table = pq.read_table(source)
            keep = table.filter(_is_null(table.column("error")))
            _write_atomically(source, [keep], table.schema)
        self.retried = sum(not ok.has_hash(h) for h in errors.hashes())
        self.done_ids, self._earlier = ok, len(ok)

    def _assemble(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        parts = self._part_files()
        if not parts:
            if not self.path.exists():
                shutil.rmtree(self.parts, ignore_errors=True)  # nothing was written: leave nothing behind
            return
        sources = self._sources()
        schema = pa.unify_schemas([pq.read_schema(s) for s in sources], promote_options="permissive")
        # (one source at a time: memory holds a part, or a row group of the earlier output)
        tables = (rg for s in sources for rg in _row_groups(s))
        _write_atomically(self.path, tables, schema, metadata={PARTS_KEY: json.dumps([p.name for p in parts])})
        for part in parts:
            part.unlink()
        if not any(self.parts.glob("part-*")):
            shutil.rmtree(self.parts, ignore_errors=True)


def _scan(path: Path, parts: Path, *, repair: bool):
    """(ok ids, error ids, the files holding error rows) of an output and its parts; with
    `repair`, parts an assembled output already holds are deleted."""
    import pyarrow.parquet as pq
    taken = set()
    if path.exists():
        try:
            meta = pq.read_metadata(path).metadata or {}
        except Exception:
            raise JobFileError(f"output {path} exists but is not a Parquet file; choose another -o, "
                               "or pass --no-resume to overwrite it") from None
        taken = set(json.loads(meta.get(PARTS_KEY, b"[]")))  # assembled already; a kill kept them
    ok, errors, with_errors = IdSet(), IdSet(), []
    for source in ([path] if path.exists() else []) + sorted(parts.glob("part-*.parquet")):
        if source.name in taken:
            if repair:
                source.unlink(missing_ok=True)
            continue
        try:
            table = pq.read_table(source, columns=["id", "error"])
        except Exception:
            if source == path:
                raise JobFileError(f"output {path} has no id and error columns: it is not a Klotski output; "
                                   "choose another -o, or pass --no-resume to overwrite it") from None
            if repair:
                source.unlink()  # (parts are renamed into place whole; only a damaged disk gets here)
            continue
        ids, errs = table.column("id").to_pylist(), table.column("error").to_pylist()
        for rid, err in zip(ids, errs):
            (ok if err is None else errors).add(rid)
        if any(e is not None for e in errs):
            with_errors.append(source)
    return ok, errors, with_errors


def _row(record: dict) -> dict:
    """One output row: the result columns, then the input row's columns (a clash is renamed
    input_<name>)."""
    err = record.get("error")
    row = {"id": record["id"], "completion": record.get("completion"), "finish_reason": record.get("finish_reason"),
           "prompt_tokens": record.get("prompt_tokens"), "completion_tokens": record.get("completion_tokens"),
           "error": err["message"] if err else None}
    for key in ("token_ids", "logprobs", "choices", "choice_logprobs"):  # (a line of n samples: `choices`, its completion null)
        if key in record:
            row[key] = record[key]
    for key, value in (record.get("input") or {}).items():
        row[f"input_{key}" if key in row else key] = value
    return row


def _row_groups(path: Path):
    import pyarrow.parquet as pq
    f = pq.ParquetFile(path)
    for i in range(f.num_row_groups):
        yield f.read_row_group(i)


def _conform(table, schema):
    """`table` with `schema`'s columns, in its order and types (a column it lacks is nulls)."""
    import pyarrow as pa
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _is_null(column):
    import pyarrow.compute as pc
    return pc.is_null(column)


def _write_atomically(path: Path, tables, schema, metadata=None) -> None:
    import pyarrow.parquet as pq
    if metadata:
        schema = schema.with_metadata({**(schema.metadata or {}), **metadata})
    with replacing(path) as tmp, pq.ParquetWriter(tmp, schema) as w:
        for table in tables:
            w.write_table(_conform(table, schema))


def _need_pyarrow(path) -> None:
    require("pyarrow", extra="datasets", needed_by=f"writing the Parquet output {path}")
