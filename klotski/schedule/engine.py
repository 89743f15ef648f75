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
from klotski.execute.kvcache import BatchKV
from klotski.execute.pipeline import StepInput
from klotski.schedule.prefix import Segment, SegmentCache, find_segments, refusal
from klotski.schedule.scheduler import BATCH, Waiting
from klotski.schedule.stats import DecodeRows, Stats
from planner.workingset import Step, activation_bytes, chunk_within
from placement import pinned
from placement.cache import DISK_TO_HOST
from placement.pinned import PinnedBlocks
from placement.tiers import HOST, OverBudget


class Engine:
    def __init__(self, config, ckpt, setup, *, pipeline, cache, predictor, channels, memory, host_memory,
                 trace, device, dtype, threads=None):
        self.config, self.ckpt, self.setup = config, ckpt, setup
        self.threads = threads  # a ThreadGovernor (CPU compute), or None
        self.pipeline, self.cache, self.predictor, self.channels = pipeline, cache, predictor, channels
        self.memory, self.host_memory, self.trace = memory, host_memory, trace
        self.device, self.dtype = device, dtype
        self.eos = ckpt.eos_ids()
        self.stats = Stats()
        self.segments: dict[tuple, Segment] = {}  # prompt segments groups of lines share (schedule/prefix.py)
        self.waiting = Waiting()  # the one queue every source feeds (schedule/scheduler.py)
        self.scheduler: Scheduler | None = None  # the rows running, while any are live or wait
        self._in_group = 0  # sequences finished since the predictor's last group ended
        self.prefix_off = refusal(ckpt.spec, config)

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
        self.predictor.end_group()
        self.predictor.persist()  # what this group taught the predictor survives a crash

    # ---- prompt segments groups of lines share (schedule/prefix.py) ------------------------
    @property
    def prefix(self) -> Segment | None:
        """The longest segment held, or None."""
        return max(self.segments.values(), key=lambda p: p.end, default=None)

    @property
    def shared(self) -> int:
        """Keys a step's rows may score beside their own: every segment held (a bound)."""
        return sum(p.length for p in self.segments.values())

    def own_len(self, s: S.Sequence) -> int:
        """Prompt tokens a line prefills itself: those after the segments it starts from."""
        return len(s.prompt_ids) - s.shared

    def share_prefix(self, seqs) -> None:
        """Group the window's lines by the prefixes they share and give each line its chain of
        segments: those held already are kept, the others prefilled once each (parents first,
        each attending to its own parent chain). Held segments nothing reads any more go."""
        if self.prefix_off or not seqs:
            return
        found = find_segments([s.prompt_ids for s in seqs])
        bounds, owner = [[] for _ in seqs], [None] * len(seqs)  # each line's chain so far: its splits, last node
        keys, parents = [], []
        for i, (start, end, members) in enumerate(found):
            keys.append(Segment.key(seqs[members[0]].prompt_ids[:end], bounds[members[0]] + [end]))
            parents.append(owner[members[0]])
            for m in members:
                bounds[m], owner[m] = bounds[m] + [end], i
        self._drop_unused(set(keys))  # room first, for the segments still to prefill
        own = [len(s.prompt_ids) + s.max_new_tokens for s in seqs]  # each line's keys beside its segments
        for _, end, members in found:
            for m in members:
                own[m] = min(own[m], len(seqs[m].prompt_ids) - end + seqs[m].max_new_tokens)
        if not self._segments_fit(set(keys), max(own), sum(end - start for start, end, _ in found)):
            return  # a step over them would pass the activations the plan reserved: lines prefill whole
        made: dict[int, Segment] = {}
        keep_free = self._segment_headroom(max(own))
        room = True
        while room and len(made) < len(found):  # a level at a time: parents first, in passes of bs
            ready = [i for i in range(len(found)) if i not in made and (parents[i] is None or parents[i] in made)]
            made.update((i, self.segments[keys[i]]) for i in ready if keys[i] in self.segments)
            new = [i for i in ready if i not in made]
            for a in range(0, len(new), self.batch_size):
                part = new[a:a + self.batch_size]
                segments = self._prefill_segments([keys[i] for i in part],
                                                  [made[parents[i]] if parents[i] is not None else None for i in part],
                                                  keep_free)
                if segments is None:  # no room beside the plan: these lines prefill their own tokens
                    room = False
                    break
                made.update(zip(part, segments))
        chains = [() for _ in seqs]
        for i, (_, _, members) in enumerate(found):  # parents before children: each line's deepest made
            for m in members:
                if i in made:
                    chains[m] = made[i].chain
        for s, chain in zip(seqs, chains):
            self._start_from(s, chain)

    def join_prefix(self, s: S.Sequence) -> None:
        """A sequence that joins the running rows starts from the longest held segment it shares."""
        best = max((p for p in self.segments.values() if p.serves(s)), key=lambda p: p.end, default=None)
        self._start_from(s, best.chain if best else ())

    def _start_from(self, s: S.Sequence, chain: tuple) -> None:
        s.chain, s.shared = chain, chain[-1].end if chain else 0
        if chain:
            for p in chain:
                self._count_prefix(p, lines=1)
            self.stats.prefix_lines += 1
            self.stats.prefix_tokens = max(self.stats.prefix_tokens, s.shared)
            self.stats.prefix_tokens_saved += s.shared

    def _segments_fit(self, keys: set, own: int, new: int) -> bool:
        """Whether a one-column step still fits the activations the plan reserved with every
        segment held (those kept and `new` tokens of new ones) side by side in a batch's keys
        beside a line's `own` (a batch attends over all its rows' segments; the plan counted
        whole prompts): else no chunk is small enough once they are held."""
        if self.setup.activation_reserve is None:
            return True
        held = sum(p.length for k, p in self.segments.items() if k not in keys)
        step = Step.prefill(self.batch_size, self.num_batches, 1, own + held + new)
        return activation_bytes(self.spec, self.dtype.itemsize, step, self.attends_on_host()) <= self.setup.activation_reserve

    def _segment_headroom(self, own: int) -> int:
        """Device bytes a shared segment's cache must leave free, so that segments take only room
        the plan does not count on (it counted whole prompts in every row; rows that start from
        segments hold `own` slots at most, their own tokens and answers): a step's activations
        and the largest group it fetches, and the rows' caches while none are made (a continuous
        run's, once made, are in use already)."""
        if self.placement.kv == HOST:
            return 0
        rows = 0
        if not (self.scheduler and any(d.live() for d in self.scheduler.decode)):
            heads, key_dim, value_dim = self.spec.shape.kv_cache_dims
            rows = BatchKV.nbytes_for(self.spec.shape.num_layers, self.batch_size * self.num_batches, heads, key_dim,
                                      own, self.dtype, value_dim)
        return (self.setup.activation_reserve or 0) + self.cache.largest_use + rows

    def _prefill_segments(self, keys: list, parents: list, keep_free: int = 0) -> list[Segment] | None:
        """Prefill segments together, once, a row each (left-padded as lines are), each row
        attending to its own parent chain as a line's own tokens would; None (nothing made)
        when their cache does not fit with `keep_free` device bytes still free."""
        starts = [p.end if p else 0 for p in parents]
        lengths = [len(k[1]) - a for k, a in zip(keys, starts)]
        width, rows = max(lengths), len(keys)
        space, kv = self.kv_space(), None
        try:
            kv, _ = space.allocate(rows, width, keep_free=keep_free)
        except OverBudget:
            space.close()
            return None
        try:
            kv.chains[:rows] = [p.chain if p else () for p in parents]
            ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
            valid = torch.zeros((rows, width), dtype=torch.bool)
            positions = torch.zeros((rows, width), dtype=torch.long)
            for r, (k, a, n) in enumerate(zip(keys, starts, lengths)):
                ids[r, width - n:], valid[r, width - n:] = torch.tensor(k[1][a:]), True
                positions[r, width - n:] = torch.arange(a, a + n)
            chunk = self.chunk_within(rows, 1, self.prefill_chunk or width, max(starts) + width)
            for part in S.chunks(StepInput(ids, valid, positions), chunk):
                self.step([kv], [part], prompt=True, decode=None)
            kv.settle()  # its stores have landed: loads read it from now on with no wait
        except BaseException:
            if kv is not None:
                kv.release()  # the tensors before their account
            space.close()
            raise
        cache = SegmentCache(kv, space, rows)
        made = [Segment(k, p, cache, r) for r, (k, p) in enumerate(zip(keys, parents))]
        for segment in made:
            self.segments[segment.key] = segment
            self._count_prefix(segment, prefills=1)
            self.stats.prefix_prefills += 1
            self.stats.prefix_tokens_saved -= segment.length
        return made

    def _count_prefix(self, p: Segment, lines: int = 0, prefills: int = 0) -> None:
        counts = self.stats.prefixes.setdefault(p.key, [p.start, p.length, 0, 0])
        counts[2] += lines
        counts[3] += prefills

    def _drop_unused(self, keep: set) -> None:
        """Give back the held segments that neither `keep`, nor a sequence running or waiting,
        nor a segment kept (a child attends to its parents) reads."""
        readers = [*(self.scheduler.holding() if self.scheduler else ()), *self.waiting.everything()]
        held = [self.segments[k] for k in keep if k in self.segments] + [p for s in readers for p in s.chain]
        read = {id(p) for q in held for p in q.chain}
        for key in [k for k, p in self.segments.items() if id(p) not in read]:
            self.segments.pop(key).release()

    def drop_prefix(self) -> None:
        for p in self.segments.values():
            p.release()
        self.segments.clear()

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

    def kv_space(self) -> "KVSpace":
        return KVSpace(self)

    def step(self, kvs, inputs, *, prompt: bool, decode: DecodeRows | None):
        """One forward step through the pipeline, timed until its logits reach the host (its
        compute is then done) and counted into `stats` (Stats.record_step)."""
        if self.threads is not None:
            self.threads.check()
        t0, disk0, kv0 = time.perf_counter(), self.trace.bytes[DISK_TO_HOST], self.pipeline.kv_bytes_loaded
        self.trace.phase = "prefill" if decode is None else "decode"
        outs = self.pipeline.forward(kvs, inputs)
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
        self.drop_prefix()
        for channel in self.channels.values():
            channel.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing still reads the host blocks
        self.cache.close()
        self.ckpt.close()
        if self.threads is not None:
            self.threads.restore()


class KVSpace:
    """KV caches of one group on the run's KV tier, each charged to that tier's budget when it
    is made (on the device, room is made first, so the allocator never holds more than the
    accounts) and given back by `free` or, for whatever is left, by `close`."""

    def __init__(self, engine: Engine):
        self.e = engine
        self.on_host = engine.placement.kv == HOST
        self.account = engine.host_memory if self.on_host else engine.memory
        self.held: dict[int, tuple[int, PinnedBlocks | None, BatchKV]] = {}  # id(kv) -> (bytes charged, blocks, kv)

    def allocate(self, rows: int, capacity: int, keep_free: int = 0) -> tuple[BatchKV, int]:
        """A cache for `rows` sequences of `capacity` slots; raises OverBudget if it does not
        fit with `keep_free` device bytes still free beside it (what the steps need)."""
        e, spec = self.e, self.e.spec
        heads, key_dim, value_dim = spec.shape.kv_cache_dims  # MLA: its latent and rotary key
        shape = (spec.shape.num_layers, rows, heads, key_dim, capacity)
        nbytes = BatchKV.nbytes_for(*shape, e.dtype, value_dim)
        blocks = PinnedBlocks(pinned=True) if self.on_host and e.device.type == "cuda" else None
        if blocks:  # one locked block per layer's keys and one per its values, each charged what it takes
            nbytes = spec.shape.num_layers * sum(map(pinned.charge, BatchKV.tensor_nbytes(*shape[1:], e.dtype, value_dim)))
        if not self.on_host:
            e.pipeline.make_room(nbytes + keep_free, "KV cache")
        self.account.reserve(nbytes, "KV cache")
        kv = BatchKV(*shape, e.dtype, device=e.device, on_host=self.on_host,
                     host_zeros=blocks.zeros if blocks else None, value_dim=value_dim)
        self.held[id(kv)] = (nbytes, blocks, kv)
        return kv, nbytes

    def free(self, kv: BatchKV) -> None:
        nbytes, blocks, _ = self.held.pop(id(kv))
        if blocks:
            # its own last stores have landed (its loads finished before the compute those
            # stores wait for): no device-wide synchronize
            kv.settle()
            blocks.close()
        self.account.free(nbytes)

    def close(self) -> None:
        if any(blocks for _, blocks, _ in self.held.values()):
            # a step that failed may have left loads issued ahead reading the locked blocks
            self.e.channels["kv_load"].drain()
        for nbytes, blocks, kv in self.held.values():
            if blocks:
                kv.settle()
                blocks.close()
            self.account.free(nbytes)
        self.held.clear()
