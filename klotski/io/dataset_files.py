"""Dataset files as job files: Parquet, CSV, JSON, Arrow and ``save_to_disk`` directories,
read through the `datasets` library, streamed.

A file is read with ``datasets.load_dataset(<builder>, data_files=..., streaming=True)`` (an
IterableDataset: rows come as the file is read, never the whole file in memory); a
``save_to_disk`` directory with ``datasets.load_from_disk``, which memory-maps its Arrow
files. ``.jsonl`` stays with Klotski's own reader (klotski/io/jobs.py): it knows the OpenAI
Batch form and says which line is broken.

Each row becomes the dict a JSONL line would be — ``--prompt-field``, ``--messages-field``
and ``--id-field`` name the columns (defaults ``prompt``, ``messages``, ``id``; a missing id
is the 1-based row number) and columns named like a line's options (``max_new_tokens``,
``temperature``, ...) are passed on — and goes through ``klotski.io.jobs.claim_items``, the
JSONL lines' checks (klotski/io/requests.py): a bad row is an error record naming its row
(as ``line``) and field, ids are claimed in row order exactly as lines are. The row's columns ride along on the
Request (``Request.row``) so a Parquet output can keep them beside the completion.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from klotski.errors import UserError, require
from klotski.io.requests import OPTIONS
from klotski.io.requests import ROW_KEY as ROW  # a row's columns travel under it (the line checks ignore it)

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow", ".tsv": "csv"}


def is_dataset(path) -> bool:
    """Whether `path` is read through `datasets` (by extension, or a directory) rather than
    as a JSONL job file."""
    path = Path(path)
    return path.is_dir() or path.suffix.lower() in BUILDERS


def open_rows(path):
    """The rows of a dataset file or directory, as an iterable of dicts, lazily."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never wait on the network
    path = Path(path)
    if not path.exists():
        raise UserError(f"job file {path} does not exist")
    datasets = require("datasets", extra="datasets", needed_by=f"reading the dataset file {path}")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            return _directory(path, datasets)
        builder = BUILDERS[path.suffix.lower()]
        kw = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **kw)
    except UserError:
        raise
    except Exception as e:  # the library's own words say what is wrong with the file
        raise UserError(f"{path}: cannot read it as a {path.suffix or 'dataset'} dataset: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _directory(path: Path, datasets):
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        if len(splits) != 1 and "train" not in splits:
            raise UserError(f"{path} holds splits {', '.join(splits)}; give one split's directory, "
                            f"e.g. {path / splits[0]}")
        path = path / ("train" if "train" in splits else splits[0])
    if (path / "state.json").exists() or (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path))  # memory-mapped Arrow: rows are read as iterated
    files = {}
    for f in sorted(path.rglob("*")):
        if f.suffix.lower() in BUILDERS and f.is_file():
            files.setdefault(BUILDERS[f.suffix.lower()], []).append(str(f))
    if len(files) != 1:
        raise UserError(f"{path}: a directory of jobs must be a save_to_disk dataset or hold data files of "
                        f"one kind (.parquet, .csv, .json, .arrow); found "
                        f"{', '.join(sorted(files)) or 'none'}")
    (builder, names), = files.items()
    return datasets.load_dataset(builder, data_files=names, split="train", streaming=True)


def check_columns(rows, path, fields) -> None:
    """Refuse up front a file that has none of the prompt/messages columns (every row would fail)."""
    names = getattr(rows, "column_names", None) or (list(rows.features) if getattr(rows, "features", None) else None)
    prompt, messages, _ = fields
    if names and prompt not in names and messages not in names:
        raise UserError(f"{path}: no column {prompt!r} (--prompt-field) nor {messages!r} (--messages-field); "
                        f"its columns are {', '.join(map(repr, names))}; name the prompt column with --prompt-field")


def row_objects(rows, fields, start_row: int = 0):
    """(row number, row index, next index, the row as a job line's dict, None) for each row
    from `start_row`: the shape klotski.io.jobs.claim_items reads."""
    prompt, messages, id_field = fields
    for i, row in enumerate(rows):
        if i < start_row:
            continue
        obj = {"prompt": row.get(prompt), "messages": _messages(row.get(messages)), ROW: row}
        rid = _id(row.get(id_field))
        if rid is not None:
            obj["id"] = rid
        for key in OPTIONS:
            if row.get(key) is not None and not _missing(row[key]):
                obj[key] = _number(row[key])
        yield i + 1, i, i + 1, obj, None


def _id(value):
    if value is None or _missing(value):
        return None
    return _number(value)


def _number(value):
    # CSV columns with a gap are read as floats: 3.0 is the id (or limit) 3
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _missing(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _messages(value):
    # In a CSV the conversation is JSON text in its cell
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value  # the line checks say what is wrong with it
    return value


def job_rows(path, fields, done, cursor):
    """klotski.io.jobs.stream_jobs for a dataset: Requests and LineErrors in row order."""
    import dataclasses

    from klotski.io.jobs import claim_items
    from klotski.io.requests import LineError
    rows = open_rows(path)
    check_columns(rows, path, fields)
    renamed = [f"{key} is column {col!r}" for key, col in zip(("prompt", "messages", "id"), fields) if key != col]
    for item in claim_items(row_objects(rows, fields), done, cursor=cursor):
        if renamed and isinstance(item, LineError):  # the checks name a line's keys; say which columns they are
            item = dataclasses.replace(item, message=f"{item.message} (row {item.line}; {', '.join(renamed)})")
        yield item


def count_rows(path) -> int | None:
    """Rows, cheaply where the format says (Parquet metadata, a save_to_disk directory's
    Arrow files), else None (the progress bar counts without a total)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_metadata(path).num_rows
    if path.suffix.lower() in (".csv", ".tsv"):
        from klotski.io.jobs import count_lines
        return max(0, count_lines(path) - 1)  # (the header; a cell with a newline counts twice)
    if path.is_dir() and (path / "state.json").exists():
        import pyarrow as pa
        total = 0
        for f in sorted(path.glob("*.arrow")):
            with pa.memory_map(str(f)) as source:
                total += pa.ipc.open_stream(source).read_all().num_rows
        return total
    return None
