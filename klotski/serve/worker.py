"""The server's one engine and the thread that drives it.

One engine is built at start and serves everything. Accepted batches run one after another,
each as a `klotski generate` job (klotski/generate.py's Job: windows, OpenAI output records,
resume, the run report) on that engine. Online requests (/v1/chat/completions,
/v1/completions) are put by `Inbox` into the engine's one waiting queue
(klotski/schedule/scheduler.py) at online priority: every step of the engine's continuous run
takes them in ahead of a batch's waiting lines, so they join the running rows; each answer
goes back through its sequences' listener. With nothing running, the worker thread runs the
engine for them alone (requests arriving within `GATHER_S` start together).

Stopping (SIGTERM) ends the run at its next step: the output keeps what finished, and the
batch stays in_progress on disk, to resume on the next start. Cancelling ends the batch's part
at its next step (what finished is kept, as OpenAI's cancel does): its waiting lines leave the
queue and its rows in flight free; online requests running beside it carry on.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
import time

from klotski.schedule import sequences as S
from klotski.schedule.scheduler import ONLINE

GATHER_S = 0.02  # requests arriving this close together start one run (the rest join it step by step)
MAX_WAITING = 1024  # online requests the queue holds (--max-waiting): past it a request is refused (429)


class Halt(KeyboardInterrupt):
    """The server is stopping: the generate Job treats it as Ctrl-C (what is written stays)."""


class Inbox:
    """Online requests, put into the engine's waiting queue, each with the future its HTTP
    request awaits (answered from the engine's thread once all its samples are done)."""

    def __init__(self, engine, max_waiting: int = MAX_WAITING):
        self.add_request = engine.add_request  # the engine's one way in
        self.waiting = engine.waiting  # (schedule/scheduler.Waiting: counted for /health)
        self.waiting.limit = max_waiting  # (a request's n samples count once)
        self.lock = threading.Lock()
        self.replies: dict[int, concurrent.futures.Future] = {}  # id(seq) -> future, until answered
        self.closed: str | None = None  # why no engine will take requests any more
        self.left = 0  # online sequences ended because their client left


    def put(self, seqs: list) -> concurrent.futures.Future:
        """One request's sequences (its n samples); the future gets them all, once all are done
        (or, once the inbox is closed, an error at once: nothing would ever answer it).
        scheduler.QueueFull if the queue holds its limit."""
        future = concurrent.futures.Future()
        with self.lock:
            if self.closed is not None:
                future.set_exception(RuntimeError(self.closed))
                return future
            for seq in seqs:
                self.replies[id(seq)] = future
                seq.listener = _chain(seq.listener, self._answer)
        try:
            self.add_request(seqs, ONLINE)
        except BaseException:
            with self.lock:
                for seq in seqs:
                    self.replies.pop(id(seq), None)
            raise
        return future

    def _answer(self, seq) -> None:
        if not seq.done:
            return
        with self.lock:
            future = self.replies.pop(id(seq), None)
            self.left += seq.finish_reason == "abort"
        if future is not None and not future.done() and (samples := S.gather(seq)) is not None:
            future.set_result(samples)  # (once its request's other samples are done too)

    def counts(self) -> dict:
        """For /health: online requests waiting, online sequences admitted and not done, and
        those ended because their client left."""
        waiting = self.waiting.online_waiting()
        with self.lock:
            return {"waiting": waiting, "in_engine": len(self.replies) - self.waiting.online_sequences(),
                    "left": self.left}

    def fail(self, seqs: list, message: str) -> None:
        """`seqs` (online sequences) that are not done yet leave the queue and fail with `message`
        (the engine's thread)."""
        left = [s for s in seqs if not s.done]
        self.waiting.withdraw(left)
        for s in left:
            S.fail(s, message)
            S.notify(s)

    def close(self, message: str) -> None:
        """No more requests are taken: those waiting or running and any put later fail with `message`."""
        with self.lock:
            self.closed = message
            futures, self.replies = list(self.replies.values()), {}
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError(message))

    def wait(self, timeout: float) -> None:
        """Until a request arrives (or `notify`), at most `timeout` seconds."""
        self.waiting.arrived.wait(timeout)

    def notify(self) -> None:
        self.waiting.arrived.set()


def _chain(first, then):
    """A listener that calls `first` (a stream's, if any) and then `then`."""
    if first is None:
        return then

    def both(seq):
        first(seq)
        then(seq)
    return both


def config_for_batch(config, report: str, model: str):
    """The generate run of one batch: OpenAI records naming the model as it is served
    (`model`), resumable, its report beside its output (the engine is the server's: the
    checkpoint is not opened again from this config)."""
    return dataclasses.replace(config, model=model, output_format="openai", resume=True, progress=False,
                               report=report, trace=None, ray=None)


def not_served(model, names: tuple[str, ...], field: str = "model") -> str:
    """Why a request naming `model` in `field` is refused: every route and a batch's lines say it so."""
    return f"{field} {model!r} is not served here; this server serves {' or '.join(map(repr, names))}"


def log(message: str) -> None:
    try:
        print(f"klotski serve: {message}", file=sys.stderr, flush=True)
    except OSError:  # a log on the disk that is full: the server carries on without it
        pass


def now() -> int:
    return int(time.time())
