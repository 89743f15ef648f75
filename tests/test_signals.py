"""util/signals.signals_held: a Ctrl-C or SIGTERM landing inside a held stretch is delivered
after it, even with other threads running (a run always has some: the kernel may hand the signal
to any of them)."""
import os
import signal
import threading
import time

import pytest

from klotski.util.signals import signals_held


@pytest.fixture
def busy_thread():
    stop = threading.Event()
    t = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)], daemon=True)
    t.start()
    yield
    stop.set()
    t.join()


def _stretch(sig, order):
    with signals_held():
        os.kill(os.getpid(), sig)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2:  # the write and its count, long enough for delivery
            pass
        order.append("stretch done")


def test_a_ctrl_c_inside_the_stretch_lands_after_it(busy_thread):
    order = []
    # Python's own Ctrl-C handler, as a run has it (a test worker may have it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _stretch(signal.SIGINT, order)
            order.append("after")
        assert order == ["stretch done"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_sigterm_reaches_the_handler_the_stretch_found_once(busy_thread):
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(("handler", signum)))
    try:
        order = []
        _stretch(signal.SIGTERM, order)
        t0 = time.perf_counter()
        while not got and time.perf_counter() - t0 < 1:
            pass
        assert order == ["stretch done"] and got == [("handler", signal.SIGTERM)]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_nothing_is_swapped():
    seen = []
    t = threading.Thread(target=lambda: seen.append(_swapped()))
    t.start()
    t.join()
    assert seen == [False]


def _swapped():
    before = signal.getsignal(signal.SIGINT)
    with signals_held():
        return signal.getsignal(signal.SIGINT) is not before
