"""The job file as a stream of windows, each read, validated and tokenized only when the one
before it has been handed over, so memory holds a window whatever the file's length.

`job_windows` is the stream; `read_ahead` reads up to the first window with prompts (the
planner sizes the run from them) and `drain` hands those over before the rest; `Background`
reads and tokenizes the next window in a thread while the current one runs; `LineCount`
counts the file's lines for the progress bar without making the first window wait.
"""
from __future__ import annotations

import copy
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from klotski.io.dataset_files import count_rows, is_dataset, job_rows
from klotski.io.jobs import Cursor, count_lines, stream_jobs, windows
from klotski.io.requests import LineError
from klotski.schedule import sequences


@dataclass
class Window:
    """One window of the job file, ready to run: its sequences (tokenized, not yet done),
    its lines that cannot be served, how many of its lines an earlier run finished, and
    where the reader stood after its last line (for the progress sidecar)."""
    seqs: list
    errors: list
    skipped: int
    mark: object = None  # klotski.io.jobs.Mark


def job_windows(jobs: Path, config, ckpt, done, start=None) -> Iterator[Window]:
    """The job file as a stream of windows of `config.window` lines, each read, validated and
    tokenized only when the one before it has been handed over: memory holds a window (and
    the hashed ids seen so far), never the file. Lines whose id is in `done` are skipped
    without tokenizing them; `start` (klotski.io.jobs.Start) skips the lines a sidecar vouches
    for without reading them."""
    cursor = Cursor()
    tokenizer = ckpt.tokenizer
    if is_dataset(jobs):  # the same checks, ids and windows, over a dataset's rows
        items = job_rows(jobs, (config.prompt_field, config.messages_field, config.id_field), done, cursor)
    else:
        items = stream_jobs(jobs, done, start=start, cursor=cursor)
    for items in windows(items, config.window):
        mark = cursor.take()
        errors = [x for x in items if isinstance(x, LineError)]
        todo = [x for x in items if x is not None and not isinstance(x, LineError)]
        seqs, too_long = sequences.prepare(todo, tokenizer, ckpt.spec, config)
        yield Window(seqs, errors + too_long, len(items) - len(errors) - len(todo), mark)
        if seqs and tokenizer is ckpt.tokenizer:
            # Later windows are tokenized in the read-ahead thread while the engine decodes
            # with the original: a copy of its own, so the two never share a Rust tokenizer.
            tokenizer = copy.deepcopy(tokenizer)


def read_ahead(stream: Iterator[Window]) -> deque[Window]:
    """Windows up to the first with something to generate (the planner sizes the run from its
    prompts): those before it have only errors and finished lines."""
    ahead = deque()
    for window in stream:
        ahead.append(window)
        if window.seqs:
            break
    return ahead


def drain(ahead: deque[Window], stream) -> Iterator[Window]:
    """The windows read ahead, then the rest; each is let go of once handed over."""
    while ahead:
        yield ahead.popleft()
    yield from stream


class Background:
    """Iterates `stream` in a thread, at most one item ahead of the caller: the next window
    is read and tokenized while the current one runs, and memory holds two windows at most.
    Order is the stream's; an exception in the thread is raised in the caller."""

    _END = object()

    def __init__(self, stream: Iterator):
        self._stream = stream
        self._box = queue.Queue()  # never holds more than one: the semaphore paces the thread
        self._go = threading.Semaphore(1)  # released when the caller takes an item
        self._stop = False
        threading.Thread(target=self._run, daemon=True, name="klotski-read-ahead").start()

    def _run(self) -> None:
        try:
            while True:
                self._go.acquire()
                if self._stop:
                    self._stream.close()
                    return
                try:
                    item = next(self._stream)
                except StopIteration:
                    self._box.put((self._END, None))
                    return
                self._box.put((item, None))
        except BaseException as e:  # handed to the caller, which says it in one line
            self._box.put((self._END, e))

    def __iter__(self):
        while True:
            item, error = self._box.get()
            if error is not None:
                raise error
            if item is self._END:
                return
            self._go.release()
            yield item

    def close(self) -> None:
        """Stop reading ahead (the run ended early); the thread finishes its window and exits."""
        self._stop = True
        self._go.release()


class LineCount:
    """The job file's line count, for the progress bar's total and ETA, counted in a thread
    (newline bytes only) so the first window never waits for it."""

    def __init__(self, path: Path):
        self.total = None
        threading.Thread(target=self._count, args=(path,), daemon=True, name="klotski-count-lines").start()

    def _count(self, path: Path) -> None:
        try:
            self.total = count_rows(path) if is_dataset(path) else count_lines(path)
        except Exception:
            pass  # the bar counts without a total
