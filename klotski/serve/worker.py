"""The server's one engine and the thread that drives it.

One engine is built at start and serves everything. Accepted batches run one after another,
each as a `klotski generate` job (klotski/generate.py's Job: windows, OpenAI output records,
resume, the run report) whose engine is `Feed`, a thin front of the real one. Online requests
(/v1/chat/completions, /v1/completions) wait in `Inbox`; every step of a continuous run
(`ServeRun`, klotski/runtime/batching.py's ContinuousRun) first takes those that fit its KV
capacity into the front of its queue, so they join the running group — a batch's window or
other online requests — and are admitted ahead of waiting batch lines. With nothing running,
the requests that arrive within `GATHER_S` start a run together.

Stopping (SIGTERM) ends the run at its next step: the output keeps what finished, and the
batch stays in_progress on disk, to resume on the next start. Cancelling ends the run at its
next step too (what finished is kept, as OpenAI's cancel does), unless online requests ride
on it: then the batch's waiting lines are dropped and its rows in flight finish with them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
import time
from collections import deque

from klotski.runtime import sequences as S
from klotski.runtime.batching import ContinuousRun

GATHER_S = 0.02  # requests arriving this close together start one run (the rest join it step by step)
MAX_WAITING = 1024  # requests the inbox holds (--max-waiting): past it a request is refused (429)


class Halt(KeyboardInterrupt):
    """The server is stopping: the generate Job treats it as Ctrl-C (what is written stays)."""


class Full(Exception):
    """The inbox holds as many requests as it may (--max-waiting): this one is refused."""


class Inbox:
    """Online sequences waiting for the engine, each with the future its HTTP request awaits;
    at most `max_waiting` requests wait (a request's sequences count once)."""

    def __init__(self, max_waiting: int = MAX_WAITING):
        self.cond = threading.Condition()
        self.waiting: deque = deque()
        self.replies: dict[int, concurrent.futures.Future] = {}  # id(seq) -> future, until answered
        self.closed: str | None = None  # why no engine will take requests any more
        self.max_waiting = max_waiting
        self.left = 0  # sequences ended because their client left (a disconnect), on the engine's thread

    def put(self, seqs: list) -> concurrent.futures.Future:
        """One request's sequences (its n samples); the future gets them all, once all are done
        (or, once the inbox is closed, an error at once: nothing would ever answer it). Raises
        Full where `max_waiting` requests wait already."""
        future = concurrent.futures.Future()
        with self.cond:
            if self.closed is not None:
                future.set_exception(RuntimeError(self.closed))
                return future
            if self.requests_waiting() >= self.max_waiting:
                raise Full(f"{self.max_waiting} requests wait already")
            for seq in seqs:
                self.replies[id(seq)] = future
                self.waiting.append(seq)
            self.cond.notify_all()
        return future

    def requests_waiting(self) -> int:
        return len({id(self.replies.get(id(s))) for s in self.waiting})

    def take(self, fits=lambda s: True) -> list:
        """The waiting sequences that `fits` takes; those whose client left end here (abort)."""
        with self.cond:
            gone = [s for s in self.waiting if s.leaving]
            took = [s for s in self.waiting if not s.leaving and fits(s)]
            for s in took + gone:
                self.waiting.remove(s)
        for s in gone:
            leave(s)
            self.left += 1
            self.answer(s)
        return took

    def counts(self) -> dict:
        """Online requests waiting for the engine, and sequences in it (taken, not yet done)."""
        with self.cond:
            return {"waiting": self.requests_waiting(), "in_engine": len(self.replies) - len(self.waiting),
                    "left": self.left}

    def is_online(self, seq) -> bool:
        return id(seq) in self.replies

    def answer(self, seq) -> None:
        future = self.replies.pop(id(seq), None)
        if future is not None and not future.done() and (samples := S.gather(seq)) is not None:
            future.set_result(samples)  # (once its request's other samples are done too)

    def fail(self, seq_id: int, why: str) -> None:
        future = self.replies.pop(seq_id, None)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(why))

    def close(self, message: str) -> None:
        """No more requests are taken: those waiting and any put later fail with `message`."""
        with self.cond:
            self.closed = message
            waiting, self.waiting = list(self.waiting), deque()
        for s in waiting:
            self.fail(id(s), message)

    def wait(self, timeout: float) -> None:
        with self.cond:
            if not self.waiting:
                self.cond.wait(timeout)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


@dataclasses.dataclass
class OnlineStats:
    """What the online requests shared (GET /health): engine runs and steps that ran them, the
    most one step computed, and those that joined a run already going (a batch's or others')."""
    requests: int = 0
    joined: int = 0
    runs: int = 0
    steps: int = 0
    most_in_one_step: int = 0


class ServeRun(ContinuousRun):
    """A continuous run that takes online requests in at every step (see the module doc)."""

    def __init__(self, engine, seqs, feed):
        super().__init__(engine, seqs)
        self.feed = feed
        self.online = {id(s) for s in seqs if feed.inbox.is_online(s)}
        self.front = set(self.online)  # online requests not yet admitted: they go first, whatever their length
        self._online_first()

    def _online_first(self) -> None:
        """Reorder the queue: waiting online requests, then the batch's lines in their order."""
        front = [s for s in self.queue if id(s) in self.front]
        if front:
            self.queue = deque(front + [s for s in self.queue if id(s) not in self.front])

    def _admit(self) -> None:
        if self.feed.stopping:
            raise Halt()
        if self.feed.cancelled():
            if not any(sid in self.feed.inbox.replies for sid in self.online):
                raise Halt()  # nothing online rides on this run: the batch's rows in flight go too
            self.queue = deque(s for s in self.queue if id(s) in self.online)  # its waiting lines go
        # an online request that fits this run's KV rows joins it, ahead of the batch's lines
        joined = self.feed.inbox.take(lambda s: len(s.prompt_ids) + s.max_new_tokens <= self.capacity)
        self.feed.online_stats.requests += len(joined)
        self.feed.online_stats.joined += len(joined)
        for s in joined:
            self.online.add(id(s))
            self.front.add(id(s))
            self.queue.appendleft(s)
            self.longest_prompt = max(self.longest_prompt, len(s.prompt_ids))
        if not self.front:
            return super()._admit()
        # ContinuousRun admits the longest of the next few prompts first: shown only the
        # online ones, it admits those (the scan runs only while one waits)
        rest = deque(s for s in self.queue if id(s) not in self.front)
        self.queue = deque(s for s in self.queue if id(s) in self.front)
        try:
            super()._admit()
        finally:
            self.front = {id(s) for s in self.queue}
            self.queue.extend(rest)

    def _step(self, work):
        yield from self._leave()
        rows = [s for w, _, _ in work for s in getattr(w, "rows", getattr(w, "seqs", ()))
                if s is not None and id(s) in self.online and not s.done]
        if rows:
            stats = self.feed.online_stats
            stats.steps += 1
            stats.most_in_one_step = max(stats.most_in_one_step, len(rows))
        yield from super()._step(work)

    # ---- those whose client left end at this step: the engine side of `Sequence.leaving`,
    # ---- kept here, apart, until the one scheduler (issue 48 part 1) takes it over
    def _leave(self) -> list:
        held = [s for d in self.decode for s in d.rows if s is not None]
        held += [s for nc in self.newcomers for s in nc.seqs] + list(self.queue)
        gone = [s for s in held if s.leaving and not s.done]
        for s in gone:
            leave(s)
            self.feed.inbox.left += 1
        if gone:  # a decode row that ended frees after this step's sampling skips it
            self.queue = deque(s for s in self.queue if not s.done)
            for nc in self.newcomers:
                nc.ready = [(j, t) for j, t in nc.ready if not nc.seqs[j].done]
        return gone


def leave(seq) -> None:
    """End a sequence whose client left, and tell its listener."""
    S.abandon(seq)
    if seq.listener is not None:
        seq.listener(seq)


class Feed:
    """The engine as a generate Job sees it: `run(seqs)` also runs the waiting online requests
    and answers them; everything else is the real engine's."""

    def __init__(self, engine, inbox: Inbox):
        self.engine, self.inbox = engine, inbox
        self.stopping = False
        self.cancelled = lambda: False  # set per batch by the worker
        self.online_stats = OnlineStats()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, seqs):
        e = self.engine
        if self.stopping or (seqs and self.cancelled()):
            raise Halt()
        mine = self.inbox.take()  # a run that starts now is sized for everyone in it
        seqs = mine + list(seqs)
        if not seqs:
            return
        self.online_stats.requests += len(mine)
        self.online_stats.runs += 1
        group, finished = e.batch_size * e.num_batches, 0
        run = None
        if e.config.batching == "continuous":
            # requests join this run whatever their prompt starts with: no window-wide shared
            # prefix (klotski/runtime/prefix.py) is held under them
            if getattr(e, "prefix", None) is not None:
                e.drop_prefix()
            run = ServeRun(e, seqs, self)
        try:
            for seq in run.run() if run else e.run(seqs):
                if self.inbox.is_online(seq):
                    self.inbox.answer(seq)
                else:
                    yield seq
                finished += 1
                if run and finished % group == 0:
                    e.end_group()
        except BaseException:  # (a stop, a cancel, the engine's failure): its online requests cannot finish in it
            why = "the server is stopping" if self.stopping else "the engine run stopped"
            for sid in run.online if run else [id(s) for s in mine]:
                self.inbox.fail(sid, why)
            raise
        if run:
            if finished % group:
                e.end_group()
            e.trace.resolve(everything=True)


def config_for_batch(config, report: str, model: str):
    """The generate run of one batch: OpenAI records naming the model as it is served
    (`model`), resumable, its report beside its output (the engine is the server's: the
    checkpoint is not opened again from this config)."""
    return dataclasses.replace(config, model=model, output_format="openai", resume=True, progress=False,
                               report=report, trace=None, ray=None)


def log(message: str) -> None:
    try:
        print(f"klotski serve: {message}", file=sys.stderr, flush=True)
    except OSError:  # a log on the disk that is full: the server carries on without it
        pass


def now() -> int:
    return int(time.time())
