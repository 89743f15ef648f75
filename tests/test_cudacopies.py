"""The two ways CUDA channels issue copies differently (klotski/execute/cudacopies.py), checked
where they can be without a GPU: an emulated link holds a copy until its booking ends, bookings
queue on one link, work run on the caller keeps its exception for `result`, and the sanitizer
query answers from torch's own sanitizer object. The CUDA side is tests/gpu/test_gpu_sanitizer.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from klotski.execute import cudacopies
from klotski.execute.channels import EmulatedLink, make_channels
from klotski.execute.trace import Trace


def test_hold_waits_for_the_links_booking_and_bookings_queue():
    link = EmulatedLink(1.0)  # 1 GB/s: 20 MB is 20 ms
    t0 = time.perf_counter()
    first = cudacopies.hold(link, 20_000_000, t0)
    second = cudacopies.hold(link, 20_000_000, t0)  # issued at the same moment: behind the first
    elapsed = time.perf_counter() - t0
    assert first == pytest.approx(t0 + 0.020) and second == pytest.approx(t0 + 0.040)
    assert elapsed >= 0.040


def test_hold_without_a_link_holds_nothing():
    t0 = time.perf_counter()
    assert cudacopies.hold(None, 10 ** 12, t0) is None
    assert time.perf_counter() - t0 < 0.05


def test_run_here_keeps_the_result_or_the_exception():
    assert cudacopies.run_here(lambda: 7).result() == 7

    def boom():
        raise ValueError("copy failed")
    done = cudacopies.run_here(boom)
    assert done.done()
    with pytest.raises(ValueError, match="copy failed"):
        done.result()


def test_sanitizer_query_follows_torchs_sanitizer(monkeypatch):
    from torch.cuda import _sanitizer
    monkeypatch.setattr(_sanitizer.cuda_sanitizer, "enabled", False)
    assert not cudacopies.sanitizer_on()
    monkeypatch.setattr(_sanitizer.cuda_sanitizer, "enabled", True)
    assert cudacopies.sanitizer_on()


def test_cpu_channels_never_take_the_sanitizer_path(monkeypatch):
    from torch.cuda import _sanitizer
    monkeypatch.setattr(_sanitizer.cuda_sanitizer, "enabled", True)
    channels = make_channels(torch.device("cpu"), Trace(False), None)
    try:
        assert not any(c.on_caller for c in channels.values())
    finally:
        for c in channels.values():
            c.close()


def test_a_ticket_makes_each_stream_wait_once(monkeypatch):
    """The members of a run moved in one submission each wait for its one ticket: the compute
    stream waits on the copy's event once, not once per member; another stream waits again.
    (Stub streams and event, a fresh stream object per query as torch gives: on a CPU only the
    bookkeeping is checked.)"""
    from concurrent.futures import Future

    import torch

    from klotski.execute.channels import Ticket

    waits = {"compute": [], "side": []}

    class Stream:
        def __init__(self, name):
            self.name = name

        def __eq__(self, other):
            return isinstance(other, Stream) and other.name == self.name

        def wait_event(self, event):
            waits[self.name].append(event)

    current = ["compute"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(current[0]))
    done = Future()
    done.set_result(None)
    ticket = Ticket(done, event="copied")
    for _ in range(8):
        ticket.wait()
    assert waits == {"compute": ["copied"], "side": []}
    current[0] = "side"
    ticket.wait()
    assert waits == {"compute": ["copied"], "side": ["copied"]}


def test_asking_never_switches_torchs_gpu_trace_on():
    """Importing torch.cuda._sanitizer builds its dispatch mode, which activates torch's GPU trace
    hooks (a Python call per event and allocation; on an H200 a run died in one). Asking whether
    the sanitizer is on, and opening channels, must leave that module unimported."""
    probe = ("import sys, torch\n"
             "from klotski.execute import cudacopies\n"
             "from klotski.execute.channels import make_channels\n"
             "from klotski.execute.trace import Trace\n"
             "assert not cudacopies.sanitizer_on()\n"
             "for c in make_channels(torch.device('cpu'), Trace(False), None).values(): c.close()\n"
             "print('torch.cuda._sanitizer' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False", out.stderr
