"""Stretches of code a Ctrl-C or SIGTERM must not split: a record written and counted, say. A
signal arriving meanwhile is noted and delivered again when the stretch ends, so the
KeyboardInterrupt it raises lands after it (never between the write and its count).

Python runs signal handlers on the main thread only, and the kernel may hand a signal to any
thread of the process (a run has channel workers and readers), so masking the signal in the
calling thread would not hold it: the handlers themselves are swapped for the stretch. Off the
main thread (a server's batch) nothing is swapped: signals are the main thread's business."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in HELD}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(arrived):
            signal.raise_signal(sig)  # through the handler the stretch found
