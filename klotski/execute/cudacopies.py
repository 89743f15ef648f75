"""How a CUDA channel's copies differ from the plain path (issued on the channel's worker thread
at the link's own speed) in the two runs that need them to:

* `--emulate-link GBPS` on a GPU: a copy is issued at once, but its ticket completes only when
  the emulated link (channels.EmulatedLink, one per direction, first come first served) would
  have finished it: the worker sleeps until then before handing the result over, so
  `Ticket.done()` and `Ticket.wait()` see the link's bandwidth, as on CPU. No device or bus
  setting is touched. What differs from a slow physical link: the compute thread blocks in
  `wait` until the booked time instead of queueing its next kernels behind a stream wait, so
  each such wait costs the GPU one kernel launch (microseconds) after the data "arrives". The
  booking starts when the copy is issued: a copy that first waits on the device for compute
  (a KV store) is booked from its issue, and arrives at the later of the booking and its event.
  A prefetch is booked a chunk at a time, as on CPU (channels.EmulatedLink: a demand load arriving
  meanwhile is booked at the next chunk boundary).
* The CUDA sanitizer (`TORCH_CUDA_SANITIZER=1`) records the tensors a kernel reads and writes
  through a dispatch mode of the thread it was enabled on; a copy issued by a channel's worker
  thread is invisible to it, so a copy-versus-compute race could not be found. While the
  sanitizer is on, CUDA channels issue their copies on the calling thread (still on the
  channel's own stream, with the same events), where it sees them.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future


def sanitizer_on() -> bool:
    """The CUDA sanitizer is checking this process (torch exposes no public query). Only asked of
    a module torch already imported: importing `torch.cuda._sanitizer` builds its dispatch mode,
    which switches on torch's GPU trace hooks for every event and allocation, enabled or not."""
    module = sys.modules.get("torch.cuda._sanitizer")
    return module is not None and bool(module.cuda_sanitizer.enabled)


def run_here(work) -> Future:
    """`work()` run now on this thread, as a completed future (its exception kept for `result`)."""
    done = Future()
    try:
        done.set_result(work())
    except Exception as e:  # raised where the ticket is waited for, as on a worker
        done.set_exception(e)
    return done


def hold(link, nbytes: int, start: float, carry=None) -> float | None:
    """Book `nbytes` on the emulated `link` (None: the real link, nothing held) from `start`, at
    `carry`'s priority (channels.Carry: a prefetch is booked a chunk at a time, yielding to demand
    loads; None: a demand load), and sleep until the booking ends; returns when it ends
    (perf_counter seconds; with `carry`, when the sleep ended)."""
    if link is None:
        return None
    if carry is not None:
        link.carry(nbytes, start, carry)
        return time.perf_counter()
    done_at = link.occupy(nbytes, start)
    ahead = done_at - time.perf_counter()
    if ahead > 0:
        time.sleep(ahead)
    return done_at
