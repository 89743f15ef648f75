"""The seam where tests make the data dir's writes fail, as a full disk, a file-size limit
or a read-only mount would, without filling a real disk.

`klotski serve --fault-file FILE` (a hidden flag, for tests) turns it on: while FILE exists and holds
`{"errno": "ENOSPC", "after_bytes": N, "names": ["run.jsonl", "*.tmp"]}`, the store's writes
to files whose name matches one of `names` (fnmatch; all files when absent) take N more bytes
from when the rule appeared, then each fails with that errno. Deleting FILE is space coming
back. `{"engine_error": MESSAGE}` instead makes every engine step raise (`engine_step`, called
before each) until FILE goes: an engine that fails at every step, writes untouched. Without the
flag (every real server), both are no-ops.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import os
from pathlib import Path


class Faults:
    def __init__(self, control: str | None):
        self.control = Path(control) if control else None
        self.rule, self.stamp, self.used = None, None, 0

    def check(self, path, nbytes: int) -> None:
        """Raise the rule's OSError if writing `nbytes` more to `path` is past its allowance."""
        if self.control is None:
            return
        rule = self._current()
        if rule is None or "errno" not in rule and "engine_error" in rule:
            return
        name = Path(path).name
        if not any(fnmatch.fnmatch(name, pattern) for pattern in rule.get("names", ["*"])):
            return
        self.used += nbytes
        if self.used > rule.get("after_bytes", 0):
            code = getattr(errno, rule.get("errno", "ENOSPC"))
            raise OSError(code, os.strerror(code), str(path))

    def engine_step(self) -> None:
        """Raise the rule's engine failure, if it names one (before every engine step)."""
        if self.control is not None and "engine_error" in (rule := self._current() or {}):
            raise RuntimeError(rule["engine_error"])

    def _current(self) -> dict | None:
        try:
            stat = self.control.stat()
        except FileNotFoundError:
            self.rule, self.stamp, self.used = None, None, 0
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self.stamp:  # a new rule: its allowance starts now
            try:
                self.rule = json.loads(self.control.read_text())
            except (OSError, ValueError):
                return self.rule
            self.stamp, self.used = stamp, 0
        return self.rule
