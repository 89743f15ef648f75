"""Writes that fail -- a full disk, a read-only mount, a permission, an I/O error -- said in
one line: which file, what happened, how much room it needs where that is known, and what
to do. The output's records are whole whatever happens (output.py), caches and copies are
renamed into place only when complete, so the advice is always the same: make room, rerun
the same command, and it resumes."""
from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from klotski.errors import RunStopped, UserError

_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "an I/O error (the disk may be failing)",
    errno.EFBIG: "the file is too large for the file system",
}


class WriteFailed(RunStopped):
    """A write failed midway; the message says where and how to carry on, `error` what failed."""

    def __init__(self, message: str, error: OSError | None = None):
        super().__init__(message)
        self.error = error


def reason(e: OSError) -> str:
    return _REASONS.get(e.errno, e.strerror or str(e))


def free_bytes(path) -> int | None:
    """Free bytes for writing under `path` (its nearest existing ancestor); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


RERUN = "make room and rerun the same command"


def describe(e: OSError, path, what: str, *, need: int | None = None, then: str | None = RERUN) -> str:
    """'PATH: cannot write WHAT: REASON (needs N, M free); THEN' for a failed write."""
    room = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        parts = ([f"needs about {size_text(need)}"] if need else []) + \
                ([f"{size_text(free)} free"] if free is not None else [])
        room = f" ({', '.join(parts)})" if parts else ""
    return f"{path}: cannot write {what}: {reason(e)}{room}" + (f"; {then}" if then else "")


@contextmanager
def writing(path, what: str, *, need: int | None = None, then: str = RERUN):
    """Turn an OSError raised inside into WriteFailed, worded by `describe`."""
    try:
        yield
    except OSError as e:
        raise WriteFailed(describe(e, path, what, need=need, then=then), e) from None


def require_space(directory, need: int, what: str, fix: str) -> None:
    """Refuse, before a long write of known size starts, when it cannot fit."""
    free = free_bytes(directory)
    if free is not None and free < need:
        raise UserError(f"{directory}: not enough free space for {what}: it needs {size_text(need)}, "
                        f"{size_text(free)} is free; {fix}")


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (so its temporary files are still being written)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def replace_atomically(path: Path, data: bytes) -> None:
    """`data` as the file `path`, through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


@contextmanager
def replacing(path, *, keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """THE atomic write: a temporary sibling of `path` for the block to write (a file, or a
    directory it makes there), renamed over `path` once the block ends: a reader, or a run
    killed midway, sees the old `path` or the new one, never a part. Before the rename the new
    file (a directory: it and every file in it) is fsynced, after it `path`'s directory.

    A directory cannot be renamed over a non-empty one: the one there goes aside first and is
    removed after, unless `keep(path)` says it will do (another process built it meanwhile:
    ours is dropped). The block failing removes the temporary. Temporaries (and set-aside
    directories) of killed runs (their pid gone) are removed here first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(path)
    # the pid says whose it is; the token tells apart two threads of one process
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        _sync_tree(tmp)
        _rename_over(tmp, path, keep)
    finally:
        _remove(tmp)
    fsync_dir(path.parent)


def _remove_abandoned(path: Path) -> None:
    """The temporaries of `path` whose writer's pid is gone (a killed run's: as big as what it wrote)."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*"):
        pid, _, rest = stale.name[len(path.name) + 2:].partition(".")
        if rest.endswith(("tmp", "old")) and pid.isdigit() and not alive(int(pid)):
            _remove(stale)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _sync_tree(p: Path) -> None:
    """fsync a file, or a directory and everything in it (the files first)."""
    if p.is_dir():
        for sub in sorted(p.rglob("*"), key=lambda x: -len(x.parts)):  # (deepest first)
            if sub.is_symlink():
                continue
            if sub.is_dir():
                fsync_dir(sub)
            else:
                _sync_tree(sub)
        fsync_dir(p)
        return
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_over(tmp: Path, path: Path, keep) -> None:
    try:
        os.replace(tmp, path)
        return
    except OSError as e:  # a directory over a non-empty one
        if not tmp.is_dir() or e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
            raise
    if keep is not None and keep(path):
        return  # (the caller's `finally` drops ours)
    old = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.old")
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if keep is None or not keep(path):  # (else another process's, put there in between, will do)
            raise
    finally:
        _remove(old)


def fsync_dir(path) -> None:
    """Make a rename or new file in directory `path` durable; not possible (nor needed) on
    every platform, so failures are ignored."""
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
