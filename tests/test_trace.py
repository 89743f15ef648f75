"""Span timing is sampled (execute/trace.py): one step in `every` of a phase is timed, the others
make no CUDA event and resolve nothing, and the busy seconds and bubble are estimated from the
timed steps. The CUDA path's bookkeeping is checked with events on a fake clock."""
from conftest import engine_tokens
from klotski.execute.trace import Trace

CLOCK = [0.0]  # milliseconds


class FakeEvent:
    """A timing CUDA event on a clock the test moves."""
    made = 0

    def __init__(self):
        FakeEvent.made += 1
        self.at = None

    def record(self):
        self.at = CLOCK[0]

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.at - self.at


def test_untimed_steps_make_no_cuda_event_and_the_estimates_cover_every_step():
    trace = Trace(cuda=True, every=4, event=FakeEvent)
    made = FakeEvent.made
    trace.phase = "decode"
    for _ in range(10):  # steps 0, 4 and 8 timed
        trace.begin_step()
        with trace.span("compute", "attn"):
            CLOCK[0] += 1.0
        CLOCK[0] += 0.5  # the compute stream idles: bubble
        with trace.gpu_span("experts", "e", nbytes=100, link="host_to_device"):
            pass
        with trace.span("compute", "experts"):
            CLOCK[0] += 2.0
    trace.resolve(everything=True)
    assert trace.steps["decode"] == 10 and trace.timed_steps["decode"] == 3
    assert FakeEvent.made - made == 3 * 3 * 2  # two events per span, timed steps only
    assert trace.bytes["host_to_device"] == 1000  # bytes on every step
    busy = trace.decode_busy
    assert abs(busy["compute"] - 10 * 3e-3) < 1e-9 and abs(busy["wait"] - 10 * 0.5e-3) < 1e-9
    assert abs(trace.bubble_share(decode_only=True) - 0.5 / 3.5) < 1e-9


def test_a_trace_times_every_step_and_the_host_clock_path_samples_too(checkpoints):
    """On a CPU the same sampling: the report's figures stay meaningful (compute seconds for every
    step estimated, a bubble share in [0, 1)), and --trace (keep_events) times every step."""
    _, sampled = engine_tokens(checkpoints["gqa"], max_new_tokens=6, batch_size=3, num_batches=2,
                               emulate_link_gbps=2.0, time_every=4)
    t = sampled.trace
    assert t.steps["decode"] >= 5 and t.timed_steps["decode"] == -(-t.steps["decode"] // 4)
    assert t.timed_steps["prefill"] >= 1
    assert 0 < t.decode_busy["compute"] < t.busy["compute"] and 0 <= t.bubble_share(decode_only=True) < 1
    full = Trace(keep_events=True, every=4)
    assert full.every == 1
