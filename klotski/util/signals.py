"""Stretches of code a Ctrl-C or SIGTERM must not split: a record written and counted, say. The
signals arriving meanwhile are held by the kernel and delivered when the stretch ends, so the
KeyboardInterrupt they raise lands after it (never between the write and its count)."""
from __future__ import annotations

import signal
from contextlib import contextmanager

HELD = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def signals_held():
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
