"""Engine: runs batch groups through the pipeline step by step, samples, stops, and hands
finished sequences back. It is built by klotski.assemble (the composition root), which has
planned the run and filled the tiers before the engine exists:

    engine, seqs, errors = assemble.open_engine(RunConfig(model="tiny-mixtral"), requests)
    for seq in engine.run(seqs):
        print(seq.request.id, seq.text)
    engine.close()

A prompt longer than the planned prefill chunk is prefilled in chunks: each chunk is one
forward step through every layer, appending its keys and values to the cache, and only the
last chunk's logits are sampled. The numbers are those of one long step, chunk by chunk.
"""
from __future__ import annotations

import time

import torch

from klotski.schedule import sequences as S
from klotski.schedule.batching import Scheduler
from klotski.execute.contract import BatchStep
from klotski.schedule.prefix_cache import PrefixCache
from klotski.schedule.scheduler import BATCH, Waiting
from klotski.schedule.stats import DecodeRows, Stats
from planner.workingset import chunk_within
from placement.cache import DISK_TO_HOST
from placement.tiers import HOST


class Engine:
    def __init__(self, config, ckpt, setup, *, pipeline, caches, cache, predictor, channels, memory, host_memory,
                 trace, device, dtype, threads=None):
        self.config, self.ckpt, self.setup = config, ckpt, setup
        self.threads = threads  # a ThreadGovernor (CPU compute), or None
        self.pipeline, self.cache, self.predictor, self.channels = pipeline, cache, predictor, channels
        self.caches = caches  # the executor's KV caches (execute/caches.CacheManager): by handle
        self.memory, self.host_memory, self.trace = memory, host_memory, trace
        self.device, self.dtype = device, dtype
        self.eos = ckpt.eos_ids()
        self.stats = Stats()
        self.waiting = Waiting()  # the one queue every source feeds (schedule/scheduler.py)
        self.scheduler: Scheduler | None = None  # the rows running, while any are live or wait
        self._in_group = 0  # sequences finished since the predictor's last group ended
        self.prefixes = PrefixCache(self)  # prompt segments groups of lines share (schedule/prefix_cache.py)

    # the pieces a caller (report, tests) looks at
    spec = property(lambda self: self.ckpt.spec)
    tokenizer = property(lambda self: self.ckpt.tokenizer)
    store = property(lambda self: self.ckpt.store)
    model_dir = property(lambda self: self.ckpt.directory)
    plan = property(lambda self: self.setup.plan)
    placement = property(lambda self: self.setup.placement)
    budgets = property(lambda self: self.setup.budgets)
    batch_size = property(lambda self: self.setup.batch_size)
    num_batches = property(lambda self: self.setup.num_batches)
    prefill_chunk = property(lambda self: self.setup.prefill_chunk)

    # ---- generation ---------------------------------------------------------------------
    def add_request(self, seqs: list[S.Sequence], priority: int = BATCH, listener=None) -> None:
        """The one way any source hands work to the engine (any thread): a window's, a shard's
        or a batch's lines at BATCH priority, an online request's samples at ONLINE. Each
        finished sequence goes to its `listener` (if given, it replaces theirs) on the engine's
        thread. scheduler.QueueFull past the waiting limit of online requests."""
        if listener is not None:
            for s in seqs:
                s.listener = listener
        self.waiting.put(seqs, priority)

    def run(self, seqs: list[S.Sequence], check=None):
        """Generate for `seqs` (a window, a shard, a batch's lines); yield each as soon as it
        finishes. They wait in the engine's one queue (schedule/scheduler.py) beside whatever
        other sources put there (online requests), which run in the same steps and go to their
        listeners; with `seqs` empty, run until nothing waits or runs. `check()` is called
        before every step: what it raises ends this call, and this call's sequences not yet
        finished are withdrawn (those running leave at the next step), others carry on at the
        next call."""
        self.add_request(seqs, BATCH)
        mine = {id(s) for s in seqs}
        if self.scheduler is None:
            self.scheduler = Scheduler(self, self.waiting, floor=self.setup.row_slots,
                                       static=self.config.batching == "static")
        run, left = self.scheduler, len(seqs)
        try:
            while left or (not seqs and (self.waiting.pending() or run.live())):
                if check is not None:
                    check()
                finished = run.step()
                if not run.ran and not finished:
                    if run.live() or left:  # (never: a row or newcomer that nothing will compute)
                        raise RuntimeError("the engine's run holds sequences it cannot compute")
                    break
                for s in finished:
                    self._count_group()
                    if id(s) in mine:
                        left -= 1
                        yield s
        except BaseException as e:
            self.waiting.withdraw(seqs)
            for s in seqs:
                s.leaving = True
            if not isinstance(e, (KeyboardInterrupt, GeneratorExit)):  # a failure: nothing in the run can go on
                self._close_run(f"the engine run stopped ({type(e).__name__})")
            raise
        finally:
            if self.scheduler is not None and not self.scheduler.live() and not self.waiting.pending():
                self._close_run()

    def has_work(self) -> bool:
        """Sequences wait, or the run holds rows: `run([])` would compute."""
        return self.waiting.pending() or self.scheduler is not None

    def idle(self) -> bool:
        """No run is going: the next `run` starts one afresh."""
        return self.scheduler is None

    def _close_run(self, why: str | None = None) -> None:
        run, self.scheduler = self.scheduler, None
        if run is not None:
            run.close(why)
        if self._in_group:
            self.end_group()
        self.trace.resolve(everything=True)

    def _count_group(self) -> None:
        """A "group" for the predictor is a group's worth of finished sequences (n x bs)."""
        self._in_group += 1
        if self._in_group == self.batch_size * self.num_batches:
            self.end_group()

    def end_group(self) -> None:
        self._in_group = 0
        self.pipeline.learn()  # what the steps held back taught, before the group is scored and saved
        self.predictor.end_group()
        self.predictor.persist()  # what this group taught the predictor survives a crash

    def attends_on_host(self) -> bool:
        """Every step's attention runs beside the host KV cache: the plan reserved no keys or scores."""
        return self.placement.kv == HOST and self.pipeline.always_host_attention()

    def chunk_within(self, bs: int, n: int, chunk: int, context: int, host_attention: bool = False) -> int:
        """The longest prefill chunk up to `chunk` for n batches of bs rows over `context` keys
        within the activations the plan left room for (RunSetup.activation_reserve)."""
        if self.setup.activation_reserve is None:
            return chunk
        return chunk_within(self.spec, self.dtype.itemsize, self.setup.activation_reserve, bs, n, chunk, context,
                            host_attention)

    def step(self, batches: list[BatchStep], *, prompt: bool, decode: DecodeRows | None):
        """One forward step of `batches` (each a cache by handle and its rows' new tokens) through
        the pipeline, timed until its logits reach the host (its compute is then done) and
        counted into `stats` (Stats.record_step)."""
        if self.threads is not None:
            self.threads.check()
        t0, disk0, kv0 = time.perf_counter(), self.trace.bytes[DISK_TO_HOST], self.pipeline.kv_bytes_loaded
        self.trace.phase = "prefill" if decode is None else "decode"
        inputs = [b.input for b in batches]
        outs = self.pipeline.forward(self.caches.batches(batches), inputs)
        elapsed = time.perf_counter() - t0
        tokens = sum(int(i.valid.sum()) for i in inputs) if decode is None else 0  # host tensors: no sync
        self.stats.record_step(elapsed, self.trace.bytes[DISK_TO_HOST] - disk0, prompt=prompt, decode=decode,
                               tokens=tokens, kv_bytes=self.pipeline.kv_bytes_loaded - kv0)
        return outs

    @property
    def pad_id(self) -> int:
        """The token a batch's shorter prompts are left-padded with (masked out: any id works)."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else next(iter(self.eos), 0)

    def close(self) -> None:
        self._close_run("the engine closed")
        self.prefixes.drop()
        self.caches.close()
        for channel in self.channels.values():
            channel.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing still reads the host blocks
        self.cache.close()
        self.ckpt.close()
        if self.threads is not None:
            self.threads.restore()
