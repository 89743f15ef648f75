"""Two priorities on the host->device link (issue 64, ProMoE): a speculative prefetch on the link
yields to a demand load at its next chunk boundary and resumes behind it (execute/channels.py).
Judged on the link's own booking (its schedule and counters) and on the order transfers finish,
not on wall-time thresholds. fp32 tokens with prefetches in small chunks: tests/test_expert_split.py
(test_divided_placement_is_exact_and_within_budget)."""
import threading
import time

import torch

from klotski.execute.channels import (SLEEP_GRAIN, Carry, EmulatedLink, LinkGate, copy_in_chunks, link_report,
                                      make_channels)
from klotski.execute.trace import Trace

GBPS = 1.0        # 1 GB/s: a byte a nanosecond
PREFETCH = 150e6  # 150 ms of the link
DEMAND = 1e6


def _prefetch_then_demand(chunk_ms):
    """A large speculative transfer on `weights` and, while it is on the link, a small demand
    load on `experts` (the prefetch's copy, run once its first booking is made, returns only once
    the demand load is booked: however late a busy machine runs the test's threads, the demand
    arrives mid-prefetch): (link, prefetch ticket, demand ticket)."""
    channels = make_channels(torch.device("cpu"), Trace(False), GBPS, chunk_ms)
    link = channels["weights"].links["host_to_device"]
    try:
        started = threading.Event()

        def copy():
            started.set()
            deadline = time.perf_counter() + 30
            while link.demand_count < 1 and time.perf_counter() < deadline:
                time.sleep(1e-4)
        spec = channels["weights"].submit(copy, name="prefetch", nbytes=int(PREFETCH), speculative=True)
        started.wait()
        demand = channels["experts"].submit(lambda: None, name="demand", nbytes=int(DEMAND))
        demand.wait()
        spec.wait()
        return link, spec, demand
    finally:
        for c in channels.values():
            c.close()


def test_demand_load_waits_at_most_a_chunk_behind_a_prefetch():
    chunk_ms = 1.0
    link, spec, demand = _prefetch_then_demand(chunk_ms)
    assert link.chunk == int(GBPS * 1e9 * chunk_ms / 1e3)
    assert link.demand_count == 1
    # booked within one chunk (and the half grain a prefetch books ahead) of its arrival
    assert link.demand_waits[0] <= chunk_ms / 1e3 + SLEEP_GRAIN
    assert demand.carry.done_at < spec.carry.done_at  # the link delivers it before the prefetch ...
    assert link.yields == 1                           # ... which resumed behind it
    assert link.chunks >= PREFETCH / link.chunk       # in chunks


def test_whole_transfers_hold_the_link():
    """The ablation (and the engine before issue 64): a prefetch booked whole holds the link, and
    the demand load is delivered after it."""
    link, spec, demand = _prefetch_then_demand(0.0)
    assert demand.carry.done_at >= spec.carry.done_at + DEMAND / (GBPS * 1e9) - 1e-9
    assert link.yields == 0 and link.chunks == 1


def test_promoted_prefetch_books_the_rest_at_once():
    link = EmulatedLink(GBPS, chunk_ms=1.0)
    carry = Carry(speculative=True)
    booked = []

    def copy():  # promoted while its first chunk is on the link
        carry.speculative = False
        booked.append(link.chunks)
    link.carry(int(20e6), time.perf_counter(), carry, copy)
    assert booked == [1] and link.chunks == 1  # one chunk speculative, the rest one demand booking
    assert link.demand_count == 1


def test_link_report_counts_demand_waits():
    link = EmulatedLink(GBPS, chunk_ms=0.5)
    for wait in (0.001, 0.002, 0.003):
        link.record_wait(wait)
    report = link.report()
    assert report["demand_loads"] == 3 and report["demand_wait_p50_ms"] == 2.0
    assert report["demand_wait_s"] == 0.006 and report["chunk_bytes"] == 500_000
    channels = make_channels(torch.device("cpu"), Trace(False), None)
    assert link_report(channels) is None  # no emulated link: nothing to say
    for c in channels.values():
        c.close()


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream=None):
        self.log.append("record")

    def synchronize(self):
        self.log.append("sync")

    def query(self):
        return False


def test_cuda_chunks_wait_for_demand_copies_first():
    """The CUDA path's bookkeeping (stub events, plain copies): each chunk is issued after the
    demand copies issued before it, at most two of the prefetch's own chunks queued, and a
    promotion sends the rest in one copy; every byte arrives."""
    log = []
    gate = LinkGate(chunk=1000)
    src, dst = torch.arange(1250, dtype=torch.float32), torch.zeros(1250)  # 5000 bytes: 5 chunks
    carry = Carry(speculative=True)
    gate.issued(_Event(log))  # a demand copy in flight

    def copy(d, s):
        log.append(f"copy {len(s)}")
        d.copy_(s)
        if len([x for x in log if x.startswith("copy")]) == 3:
            carry.speculative = False  # compute came to wait for it
    copy_in_chunks(dst, src, gate, carry, lambda: _Event(log), copy)
    assert torch.equal(dst, src)
    assert log[:2] == ["sync", "copy 1000"]  # the demand copy first
    assert [x for x in log if x.startswith("copy")] == ["copy 1000"] * 3 + ["copy 2000"]
    assert log.count("sync") == 2  # the demand once, then the first chunk before the third
