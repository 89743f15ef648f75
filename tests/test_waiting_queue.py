"""The engine's one waiting queue (klotski/schedule/scheduler.py) under threads: eight threads put
online requests, count them (the waiting limit, /health) and withdraw some while the engine's
thread collects, admits and drops leavers; every sequence is taken out exactly once or still
waits, and nothing raises. Then the same through a real engine that steps while eight threads
add requests: every request is answered with transformers' greedy tokens."""
import sys
import threading
from dataclasses import dataclass

from conftest import reference_tokens
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.requests import Request
from klotski.schedule.scheduler import BATCH, ONLINE, QueueFull, Waiting
from klotski.schedule.sequences import prepare

THREADS = 8
ROUNDS = 1000


@dataclass(eq=False)
class Seq:
    """What the queue reads of a sequence."""
    n: int
    sample: int = 0
    priority: int = BATCH
    leaving: bool = False
    prompt_ids: tuple = ()
    max_new_tokens: int = 1


def test_eight_threads_put_count_and_withdraw_while_the_engine_thread_takes():
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter allows: races show
    try:
        _hammer()
    finally:
        sys.setswitchinterval(switch)


def _hammer():
    waiting = Waiting(limit=1024)  # klotski serve's: counting it walks a long lane
    made, refused, withdrawn, errors = [], [], [], []
    lock = threading.Lock()
    start = threading.Barrier(THREADS + 1)

    def source(t):
        try:
            start.wait()
            for r in range(ROUNDS):
                seqs = [Seq(n=t * ROUNDS + r, sample=i) for i in range(1 + r % 3)]  # a request of n samples
                seqs[0].leaving = r % 7 == 0  # its client left before it was admitted
                try:
                    waiting.put(seqs, ONLINE)
                except QueueFull:
                    with lock:
                        refused.extend(seqs)
                    continue
                with lock:
                    made.extend(seqs)
                assert waiting.online_waiting() >= 0 and waiting.online_sequences() >= 0
                waiting.online_now()
                if r % 11 == 0:
                    waiting.withdraw(seqs)
                    with lock:
                        withdrawn.extend(seqs)
        except BaseException as e:  # pragma: no cover - what the test reports
            errors.append(e)

    threads = [threading.Thread(target=source, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    taken, gone = [], []
    start.wait()
    try:
        while any(t.is_alive() for t in threads):
            waiting.collect(lambda s: 0)
            gone += waiting.leaving()
            taken += waiting.pop(2)
            waiting.everything()
            len(waiting)
    except BaseException as e:
        errors.append(e)
    for t in threads:
        t.join()
    waiting.collect(lambda s: 0)
    rest = waiting.everything()
    assert not errors, errors[0]
    out = taken + gone + rest
    assert len({id(s) for s in out}) == len(out)  # nothing taken out twice
    kept = {id(s) for s in made} - {id(s) for s in withdrawn}
    assert {id(s) for s in out} - {id(s) for s in made} == set()  # nothing appeared from nowhere
    assert kept <= {id(s) for s in out}  # every sequence not withdrawn was taken out or still waits
    assert not {id(s) for s in refused} & {id(s) for s in out}  # a refused request never waits
    assert waiting.online_stats().requests == len({(s.n) for s in made})


PROMPTS = ["The capital of France is", "Once upon a time there", "Numbers: one two three", "Hello, my name"]


def test_a_running_engine_answers_requests_that_eight_threads_add(checkpoints):
    model = checkpoints["gqa"]
    expected = reference_tokens(model, PROMPTS, max_new_tokens=3)
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=2, num_batches=2)
    window = [Request(id=f"w{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=6)
              for i, p in enumerate(PROMPTS * 2)]
    engine, seqs, errors = open_engine(cfg, window)
    assert not errors
    requests = []
    for t in range(THREADS):
        reqs = [Request(id=f"t{t}-{i}", line=i + 1, prompt=PROMPTS[(t + i) % len(PROMPTS)], messages=None,
                        max_new_tokens=3) for i in range(3)]
        prepared, errors = prepare(reqs, engine.tokenizer, engine.spec, engine.config)
        assert not errors
        requests.append(prepared)
    answered = []
    start = threading.Barrier(THREADS)

    def source(prepared):
        start.wait()
        for s in prepared:
            engine.add_request([s], ONLINE, listener=lambda s: s.done and answered.append(s))

    threads = [threading.Thread(target=source, args=(p,)) for p in requests]
    for t in threads:
        t.start()
    window_out = {s.request.id: list(s.out) for s in engine.run(seqs)}
    for t in threads:
        t.join()
    list(engine.run([]))  # those that arrived as the window ended
    engine.close()
    assert len(window_out) == len(window)
    assert len(answered) == THREADS * 3 and len({id(s) for s in answered}) == THREADS * 3
    for s in answered:
        assert s.out == expected[PROMPTS.index(s.request.prompt)], s.request.id
