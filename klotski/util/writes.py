"""Writes that fail -- a full disk, a read-only mount, a permission, an I/O error -- said in
one line: which file, what happened, how much room it needs where that is known, and what
to do. The output's records are whole whatever happens (output.py), caches and copies are
renamed into place only when complete, so the advice is always the same: make room, rerun
the same command, and it resumes."""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

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
    """Write `data` to a temporary sibling and rename it over `path`: a reader, or a run
    killed midway, sees the old file or the new one, never a part. A temporary left by a
    killed run (its pid gone) is removed by the next write of the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = stale.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and not alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
