"""Continuous batching: waiting sequences (schedule/scheduler.py) flow through the rows of n
decode batches. Static batching keeps a batch's rows until its longest sequence ends; here a
row whose sequence has finished takes the next waiting prompt:

- The waiting prompts are taken longest-decode first (`max_new_tokens`, then prompt length),
  so the long ones start early and the short ones fill the gaps behind them; a newcomer
  batch takes the longest prompts of the next few batches' worth, so it pads little.
- Newcomers are prefilled ahead, up to bs at a time as an extra batch (up to n such batches
  in flight) that rides along the group's decode steps (chunked like any prefill, the step
  never bigger than the first prefill step the static schedule would run), in a KV cache of
  their own: when a row frees, a newcomer is usually ready for it at once.
- A ready newcomer's keys and values are copied into a free row of a decode batch
  (`Adopt`) so that its newest slot lines up with the batch's, and it decodes with the rest
  from the next step on. A batch's slot range is shifted back to the slots its live rows
  still use when it runs out of room (`Realign`), so the cache stays the size static
  batching would give the window's longest request.
- A batch keeps its live rows in front (a finished row's place goes to the batch's last live
  row) and a step computes only those (its input has those rows): a row whose sequence has
  finished is never computed, whether a newcomer is still prefilling for it or none is left.
- With nothing left to admit, the sparsest batch's rows move into other batches' free rows,
  so the tail runs as few batches as its sequences fill.
- A cache's budget account is given back only once its tensors are dropped, and a realign's
  scratch block is reserved while it lives: what is alive never exceeds what is accounted.
  On the host a newcomer cache whose prompts all have rows is kept for the next newcomers
  (its pages stay locked: a CUDA host cache is registered once, not per newcomer batch).

The scheduler holds no cache: it names them by handle and changes them through the operations
of execute/contract.py, which the executor's `CacheManager` (engine.caches) carries out.

Every sequence sees exactly its own tokens at the positions it would have alone: the output
is the static schedule's, token for token (tests/test_batching.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from klotski.schedule import sequences as S
from klotski.execute.contract import Adopt, BatchStep, Free, Realign, Reset, Scrub, StepInput
from klotski.schedule.sampling import next_tokens
from klotski.schedule.prefix import cache_chain
from klotski.schedule.routing_order import grouped_order, signatures
from klotski.schedule.scheduler import ONLINE
from klotski.schedule.stats import DecodeRows
from placement.tiers import OverBudget
from planner.workingset import continuous_step_limit, newcomer_chunks


LOOKAHEAD = 4  # batches' worth of waiting prompts a newcomer batch is chosen from, by length


@dataclass
class _Decode:
    """One decode batch: its cache (a handle), its rows (None = free), their next input token
    and position."""
    cache: int
    rows: list
    tokens: list[int]
    positions: torch.Tensor
    broken: torch.Tensor
    prompt: list = field(default_factory=list)  # chunks still to prefill in place (the first fill)
    online: bool = False  # online requests decoding in their own cache, beside the n batches

    def live(self) -> bool:
        return bool(self.prompt) or any(s is not None and not s.done for s in self.rows)

    def free_rows(self) -> list[int]:
        return [] if self.prompt or self.online else [i for i, s in enumerate(self.rows) if s is None]

    def computed(self) -> int:
        """Rows a step computes: the live ones, kept in front (all of them while prefilling)."""
        return len(self.rows) if self.prompt else sum(s is not None for s in self.rows)

    def occupied(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is not None]


@dataclass
class _Newcomers:
    """Prompts prefilled in a cache of their own, `done` columns of `whole` so far, each
    step's chunk chosen then (`_newcomer_inputs`); once sampled, those not yet adopted wait
    in `ready` (their row in this cache, first token) for free rows."""
    seqs: list
    cache: int
    whole: StepInput
    broken: torch.Tensor
    done: int = 0
    ready: list = field(default_factory=list)
    online: bool = False  # online requests: once prefilled they decode in this cache (never wait for rows)

    @property
    def left(self) -> int:
        """Prompt columns still to prefill."""
        return self.whole.ids.shape[1] - self.done

    def take(self, width: int) -> StepInput:
        a, self.done = self.done, self.done + width
        return StepInput(self.whole.ids[:, a:self.done], self.whole.valid[:, a:self.done],
                         self.whole.positions[:, a:self.done])


class Scheduler:
    """The engine's one step loop: rows of n decode batches that sequences from the waiting
    queue (schedule/scheduler.py) flow through. `step()` is one engine step — schedule (what
    arrived joins, leavers go, waiting prompts are admitted), execute (the pipeline's forward),
    update (sample, finish, move rows) — and returns the sequences it finished, whatever their
    source; the run lives as long as rows are live or sequences wait, and `close()` gives its
    caches back.

    Two policies decide what it admits when. `continuous` (the default) refills a row as soon
    as its sequence ends. `static` (--batching static, the ablation) admits a group of n
    batches of bs, longest prompts first, only once every row is idle; each batch's cache is
    sized for its own longest request, and a finished row keeps its place and is computed,
    unread, until its batch ends."""

    def __init__(self, engine, waiting, floor: int = 0, static: bool = False):
        self.e, self.spec, self.waiting = engine, engine.spec, waiting
        self.static = static
        self.floor = floor  # KV slots every row gets at least (klotski serve: what the plan allows)
        self.caches = engine.caches  # the executor's: the scheduler names caches by handle
        self.group = self.caches.open_group()  # this run's caches, charged to the KV tier's budget
        self.decode: list[_Decode] = []
        self.newcomers: list[_Newcomers] = []  # oldest first
        self.spare: list[int] = []  # host newcomer caches done with, for the next newcomers
        self.capacity = self.longest_prompt = 0
        self.online = 0  # online sequences this run took in (for OnlineStats)
        self._ran_online = False
        self.ran = False  # whether the last step computed anything
        # --order routing: batch lines wait in groups of similar routing (schedule/routing_order.py)
        self.routing = engine.config.order == "routing"
        self.rank: dict[int, int] = {}       # id(line) -> its place in the routing order
        self.signature: dict[int, tuple] = {}  # id(line) -> (line, its routing signature)

    def order(self, s: S.Sequence):
        """Batch lines wait longest `max_new_tokens` first, then longest prompt (static: longest
        prompt first, so each batch pads little); under --order routing, in their routing
        groups first (`_by_routing`)."""
        if not self.routing:
            return self._length(s)
        return (self.rank.get(id(s), len(self.rank)), *self._length(s))

    def _length(self, s: S.Sequence) -> tuple:
        return (-len(s.prompt_ids),) if self.static else (-s.max_new_tokens, -len(s.prompt_ids))

    def _by_routing(self, lines: list) -> list:
        """The batch lane in groups of n x bs lines of similar routing (routing_order.py); each
        line's signature taken once, when it first waits."""
        new = [s for s in lines if id(s) not in self.signature]
        if new:
            for s, sig in zip(new, signatures(new, self.spec, self.e.cache, self.e.memory)):
                self.signature[id(s)] = (s, sig)
        self.signature = {id(s): self.signature[id(s)] for s in lines}  # (the admitted go)
        sigs = torch.stack([self.signature[id(s)][1] for s in lines])
        out = grouped_order(lines, sigs, self.e.batch_size * self.e.num_batches, self._length)
        self.rank = {id(s): i for i, s in enumerate(out)}
        return out

    def _size(self, waiting: list) -> None:
        """Rows with room for the longest request of `waiting` (what static batching gives its
        batch; a cache holds a line's own tokens: a shared prefix's are the engine's, once), and
        at least `floor` slots; what follows from that: the chunk and the step limits."""
        own, e = self.e.prefixes.own_len, self.e
        self.capacity = max([self.floor] + [own(s) + s.max_new_tokens for s in waiting])
        self.longest_prompt = max([1] + [own(s) for s in waiting])  # a host newcomer cache's slots
        self.host_attention = e.attends_on_host()
        self.chunk = e.chunk_within(e.batch_size, e.num_batches, e.prefill_chunk or self.longest_prompt,
                                    self.capacity + e.prefixes.shared, self.host_attention)
        # rows also attend over the shared segments (at most every one held): their keys count,
        # in the limit as held now and in each newcomer's chunk as held then (windows add some)
        args = (self.spec, e.dtype.itemsize, e.batch_size, e.num_batches, self.chunk, self.capacity)
        self.step_limit = continuous_step_limit(*args[:-1], self.capacity + e.prefixes.shared, self.host_attention)
        # a newcomer batch's chunk, as the planner replays it
        self.widest = newcomer_chunks(*args, self.host_attention, e.prefixes.shared)
        # a newcomer's cache beyond the planned ones is taken only if a step can still run
        # beside it: its activations at their limit and the largest group it fetches
        self.headroom = self.step_limit + e.cache.largest_use

    def live(self) -> bool:
        """Rows or newcomers still computing."""
        return bool(self.newcomers) or any(d.live() for d in self.decode)

    def fits(self, s: S.Sequence) -> bool:
        """Whether `s` fits the rows as they are sized (else it waits for them to drain)."""
        return self.e.prefixes.own_len(s) + s.max_new_tokens <= self.capacity

    def step(self) -> list:
        """One engine step: schedule, execute, update. The sequences it finished ([] when
        nothing ran: the run is idle)."""
        finished, work = self.schedule()
        self.ran = bool(work)
        if work:
            outs = self.execute(work)
            finished += self.update(work, outs)
        return finished

    def schedule(self) -> tuple[list, list]:
        """What arrived joins the queue, leavers go, waiting prompts are admitted: the sequences
        that ended so (their source left) and this step's work, (batch, input, prefill?) each."""
        self._arrive()
        finished = self._leave()
        while True:
            if not self.static:
                self._admit()
                self._consolidate()
            work = [(d, *self._input(d)) for d in self.decode if d.live()]
            work += self._newcomer_inputs(sum(inp.ids.shape[0] for _, inp, _ in work))
            if work or not len(self.waiting):
                return finished, work
            # every row idle and no newcomer fits beside the caches (or the next request needs
            # longer rows; static: the group ended): start afresh, sized for what waits
            self.caches.apply(*(Free(c) for c in [d.cache for d in self.decode] + self.spare))
            self.spare = []
            if self.static:  # the next group, each batch sized for its own
                group = self.waiting.pop(self.e.batch_size * self.e.num_batches, key=self.order)
                self._size(group)
            else:
                self._size(self.waiting.everything())
                group = self.waiting.pop(self.e.batch_size * self.e.num_batches)
            self.decode = self._fill(group)

    def _arrive(self) -> None:
        """What sources added since the last step joins the lanes, grouped by the prompt
        segments they share (prefilled now, once): a batch's lines together, the online
        requests that arrived since the last step together; an online request that shares none
        with them starts from the longest segment held that it shares."""
        # work already here when a request arrives: rows computing or sequences waiting for them
        busy = self.live() or len(self.waiting) > 0
        arrivals = self.waiting.collect(self.order)
        if self.routing and any(a.priority != ONLINE for a in arrivals):
            self.waiting.reorder(self._by_routing)
        online = [s for a in arrivals if a.priority == ONLINE for s in a.seqs]
        staying = lambda seqs: [s for s in seqs if not s.leaving]  # (those leaving go at `_leave`)
        for a in arrivals:
            if a.priority != ONLINE:
                self.e.prefixes.share(staying(a.seqs))
        if online:  # the requests that came together share segments as a window's lines do
            self.e.prefixes.share(staying(online))
            for s in staying(online):
                if not s.chain:  # else the longest segment held that it shares
                    self.e.prefixes.join(s)
            self.online += len(online)
            self.waiting.count_online(joined=busy * len(online))
        for s in (s for a in arrivals for s in a.seqs):
            self.longest_prompt = max(self.longest_prompt, self.e.prefixes.own_len(s))

    def close(self, why: str | None = None) -> list:
        """Give every cache back; the sequences still in it (`why`: they fail with that)."""
        held = [s for d in self.decode for s in d.rows if s is not None and not s.done]
        held += [s for nc in self.newcomers for s in nc.seqs if not s.done]
        self.caches.close_group(self.group)
        self.decode, self.newcomers, self.spare = [], [], []
        if why is not None:
            for s in held:
                S.fail(s, why)
                S.notify(s)
        return held

    def holding(self) -> list:
        """The sequences in its rows, its newcomer batches and the queue."""
        return [*(s for d in self.decode for s in d.rows if s is not None),
                *(s for nc in self.newcomers for s in nc.seqs), *self.waiting.everything()]

    def _leave(self) -> list:
        """Sequences whose source left end now: waiting ones leave the queue, running ones
        free their rows (a batch still in its first prefill lets them go once it samples)."""
        gone = self.waiting.leaving()
        for d in self.decode:
            if d.prompt:
                continue
            for i, s in enumerate(d.rows):
                if s is not None and s.leaving and not s.done:
                    gone.append(s)
                    if not self.static:  # (static: the row computes on, unread, until its batch ends)
                        d.rows[i] = None
            if not self.static:
                self._close_ranks(d)
        for nc in list(self.newcomers):
            for j, t in [r for r in nc.ready if nc.seqs[r[0]].leaving]:
                gone.append(nc.seqs[j])
                nc.ready.remove((j, t))
            if not nc.left and not nc.ready:  # every prompt of it left: its cache goes
                self.newcomers.remove(nc)
                self._retire(nc.cache)
        for s in gone:
            S.abandon(s)
        return gone

    def _fill(self, seqs) -> list[_Decode]:
        seqs = sorted(seqs, key=lambda s: -len(s.prompt_ids))
        bs = self.e.batch_size
        return [self._first_fill(seqs[i:i + bs]) for i in range(0, len(seqs), bs)]

    # ---- the first fill: prefilled in place, as static batching does ----------------------
    def _first_fill(self, batch) -> _Decode:
        longest = max(map(self.e.prefixes.own_len, batch))
        # static: a batch's cache holds its own longest request; continuous: the run's
        capacity = longest + max(s.max_new_tokens for s in batch) if self.static else self.capacity
        cache = self.caches.allocate(self.group, len(batch), capacity, chains=[cache_chain(s.chain) for s in batch])
        whole = S.prefill_input(batch, longest, self.e.pad_id)
        self.e.stats.record_prompts(batch)
        return _Decode(cache, list(batch), [0] * len(batch), whole.positions[:, -1] + 1,
                       torch.full((len(batch),), -1), S.chunks(whole, self.chunk))

    def _input(self, d: _Decode) -> tuple[StepInput, bool]:
        """The batch's input this step and whether it is a prefill."""
        if d.prompt:
            return d.prompt.pop(0), True
        view = self.caches.view(d.cache)
        if view.filled + 1 > view.capacity:  # out of room: keep only the slots live rows read
            self._realign(d, view.span(d.occupied()))
        m = d.computed()
        ids = torch.tensor(d.tokens[:m], dtype=torch.long)[:, None]
        return StepInput(ids, torch.ones_like(ids, dtype=torch.bool), d.positions[:m, None].clone()), False

    # ---- one step -----------------------------------------------------------------------
    def execute(self, work) -> list:
        """The step's forward through every layer: one output per batch of `work`."""
        e = self.e
        decoding = [(w, inp) for w, inp, prefill in work if not prefill]
        if self.static and len(decoding) < len(work):
            decoding = []  # static: a group's step counts as prefill while any batch of it prefills
        # a step that decodes counts as decode time; newcomers' prefill rides along
        slots = sum(len(d.rows) for d in self.decode) if self.static else e.batch_size * e.num_batches
        rows = [(d, inp.ids.shape[0]) for d, inp in decoding]
        decode = DecodeRows(computed=sum(m for _, m in rows),
                            useful=sum(s is not None and not s.done for d, m in rows for s in d.rows[:m]),
                            slots=slots,
                            prompt_tokens=sum(int(inp.valid.sum()) for _, inp, prefill in work if prefill)
                            ) if decoding else None
        online = sum(s is not None and s.priority == 0 for w, _, _ in work
                     for s in (w.rows if isinstance(w, _Decode) else w.seqs))
        if online:
            self.waiting.count_online(new_run=not self._ran_online, in_step=online)
            self._ran_online = True
        return e.step([BatchStep(w.cache, inp) for w, inp, _ in work], prompt=len(decoding) < len(work),
                      decode=decode)

    def update(self, work, outs) -> list:
        """Sample what the step computed; rows finish, free and take ready newcomers."""
        finished = list(self._updated(work, outs))
        self._adopt_ready()
        return finished

    def _updated(self, work, outs):
        for (w, _, prefill), out in zip(work, outs):
            m = len(out.broken_at)  # the rows computed
            w.broken[:m] = torch.where(w.broken[:m] < 0, out.broken_at, w.broken[:m])
            if isinstance(w, _Newcomers):
                yield from self._prefilled(w, out)
            elif not w.prompt:  # a prefill's logits mean something after its last chunk only
                yield from self._decoded(w, out, m, fed=not prefill)

    def _decoded(self, d: _Decode, out, m: int, fed: bool):
        """Sample the batch's `m` computed rows; `fed`: this step fed each row the token at its
        position. Finished rows free up, and the live ones close ranks in front."""
        tokens, finished = next_tokens(self.e, d.rows[:m], out.logits, d.broken[:m])
        yield from finished
        if self.static:  # every row computes on until its batch ends (done ones unread)
            d.tokens[:m] = tokens
            d.positions[:m] += fed
            return
        for i, s in enumerate(d.rows[:m]):
            if s is not None and s.done:
                d.rows[i] = None  # free for the next prompt
                if d.broken[i] >= 0:  # its slots may hold non-finite values a newcomer must not see
                    self.caches.apply(Scrub(d.cache, i))
            elif s is not None:
                d.tokens[i] = tokens[i]
                d.positions[i] += fed
        self._close_ranks(d)

    def _close_ranks(self, d: _Decode) -> None:
        """Each free row before the last live one takes that row (its slots and state)."""
        while True:
            live = [i for i, s in enumerate(d.rows) if s is not None]
            holes = [i for i, s in enumerate(d.rows) if s is None and live and i < live[-1]]
            if not holes:
                return
            i, j = holes[0], live[-1]
            self.caches.apply(Adopt(d.cache, i, d.cache, j, self.caches.view(d.cache).span([j])))
            self._take(d, i, d, j)
            self.e.stats.rows_moved += 1

    def _take(self, d: _Decode, i: int, src, j: int) -> None:
        """Row `i` of `d` takes the sequence state of row `j` of batch `src`; that row frees."""
        d.rows[i], d.tokens[i], d.positions[i], d.broken[i] = src.rows[j], src.tokens[j], src.positions[j], src.broken[j]
        src.rows[j] = None
        if src.broken[j] >= 0:  # non-finite values it leaves behind (its padding) go with it
            self.caches.apply(Scrub(src.cache, j))

    def _prefilled(self, nc: _Newcomers, out):
        if nc.left:  # more of their prompts to prefill
            return
        tokens, finished = next_tokens(self.e, nc.seqs, out.logits, nc.broken)
        yield from finished
        nc.ready = [(j, t) for j, (s, t) in enumerate(zip(nc.seqs, tokens)) if not s.done]
        if nc.online:  # they decode on in this cache, beside the n batches
            self.newcomers.remove(nc)
            d = _Decode(nc.cache, [None if s.done else s for s in nc.seqs], tokens,
                        torch.tensor([len(s.prompt_ids) for s in nc.seqs]), nc.broken, online=True)
            self.decode.append(d)
            self._close_ranks(d)

    def _adopt_ready(self) -> None:
        """Ready newcomers take free rows, oldest first; a newcomer cache goes once every one
        of its prompts has a row; an online batch's once its rows are done."""
        for d in [d for d in self.decode if d.online and not d.live()]:
            self.decode.remove(d)
            self._retire(d.cache)
        for nc in list(self.newcomers):
            if nc.left:
                continue
            free = [(d, i) for d in self.decode for i in d.free_rows()]
            for (d, i), (j, token) in zip(free, list(nc.ready)):
                s = nc.seqs[j]  # its own slots move; its next position counts the shared prefix too
                self._move(nc.cache, j, d, i, self.e.prefixes.own_len(s))
                d.rows[i], d.tokens[i], d.positions[i], d.broken[i] = s, token, len(s.prompt_ids), nc.broken[j]
                nc.ready.remove((j, token))
                self.e.stats.refills += 1
            if not nc.ready:
                self.newcomers.remove(nc)
                self._retire(nc.cache)

    def _retire(self, cache: int) -> None:
        """A newcomer cache every prompt of which has a row: on the host it waits for the next
        newcomers (kept to the most that can be alive at once, 2n); on the device its room
        goes back to the steps."""
        if not self.caches.on_host:
            self.caches.apply(Free(cache))
            return
        self.spare.append(cache)
        if len(self.spare) > 2 * self.e.num_batches:
            smallest = min(self.spare, key=lambda c: (lambda v: v.batch * v.capacity)(self.caches.view(c)))
            self.spare.remove(smallest)
            self.caches.apply(Free(smallest))

    def _newcomer_cache(self, take: int, longest: int, chains: list) -> int | None:
        """A cache for a newcomer batch of `take` prompts padded to `longest`, or None if none
        fits the budget. On the host a spare one of `take` rows and enough slots is used again
        (a prefill writes every slot before a step reads it); a new one there gets the
        window's longest prompt's slots, so that it serves every later batch of its rows."""
        allocate = lambda capacity, keep_free=0: self.caches.allocate(self.group, take, capacity, keep_free, chains)
        if not self.caches.on_host:
            try:
                return allocate(longest, self.headroom)
            except OverBudget:
                return None
        views = [self.caches.view(c) for c in self.spare]
        fits = [v for v in views if v.batch == take and v.capacity >= longest]
        if fits:
            cache = min(fits, key=lambda v: v.capacity).cache
            self.spare.remove(cache)
            self.caches.apply(Reset(cache, take, tuple(chains)))
            return cache
        for capacity in dict.fromkeys((max(self.longest_prompt, longest), longest)):
            try:
                return allocate(capacity)
            except OverBudget:
                pass
        if not self.spare:
            return None
        self.caches.apply(*(Free(c) for c in self.spare))  # the spares' room, for this batch
        self.spare = []
        try:
            return allocate(longest)
        except OverBudget:
            return None

    def _move(self, src: int, j: int, d: _Decode, i: int, length: int) -> None:
        """Row `i` of batch `d` takes the newest `length` slots of row `j` of cache `src`."""
        view = self.caches.view(d.cache)
        if view.filled < length or view.filled + 1 > view.capacity:
            self._realign(d, max(view.span(d.occupied()), length))
        self.caches.apply(Adopt(d.cache, i, src, j, length))

    def _realign(self, d: _Decode, keep: int) -> None:
        self.caches.apply(Realign(d.cache, keep))
        self.e.stats.kv_realigns += 1

    # ---- the tail: nothing left to admit --------------------------------------------------
    def _consolidate(self) -> None:
        """The sparsest batch's live rows move into other batches' free rows, so it stops
        computing rows nobody uses."""
        if len(self.waiting) or self.newcomers:
            return
        live = [d for d in self.decode if d.live() and not d.prompt]
        if len(live) < 2:
            return
        src = min(live, key=lambda d: sum(s is not None for s in d.rows))
        moving = [i for i, s in enumerate(src.rows) if s is not None]
        free = [(d, i) for d in live if d is not src for i in d.free_rows()]
        if len(moving) > len(free):
            return
        for i, (d, j) in zip(moving, free):
            self._move(src.cache, i, d, j, self.caches.view(src.cache).span([i]))
            self._take(d, j, src, i)
        self.e.stats.rows_moved += len(moving)

    # ---- admitting waiting prompts --------------------------------------------------------
    def _admit(self) -> None:
        """Prefill waiting prompts ahead of the rows that will take them, once the first fill
        is prefilled: a newcomer batch of at most bs prompts, no more than n such batches
        prefilling and 2n in all, each no bigger than the step limit and the KV budget allow."""
        n = self.e.num_batches
        online = self.waiting.online_first()  # online requests first, whatever their length
        if not self.decode or not len(self.waiting) or any(d.prompt for d in self.decode):
            return
        # Up to n batches prefilling and n more prefilled, waiting for rows: prefill is what
        # a job's short requests wait on, and a step's prompt tokens share its weights. Online
        # requests pass those caps: they decode in their own cache, never waiting for a row.
        if not online and (sum(bool(nc.left) for nc in self.newcomers) >= n or len(self.newcomers) >= 2 * n):
            return
        # A batch pads to its longest prompt: of the next few bs waiting, the longest go
        # together (the order by max_new_tokens holds at that grain)
        head, _ = self.waiting.front(LOOKAHEAD * self.e.batch_size, key=lambda s: -len(s.prompt_ids))
        # a request longer than the rows waits, and nothing passes it, until they drain
        fitting = next((j for j, s in enumerate(head) if not self.fits(s)), len(head))
        for take in range(min(fitting, self.e.batch_size), 0, -1):
            longest = max(self.e.prefixes.own_len(head[j]) for j in range(take))
            # one token a row beside everyone else's at their least, decode rows at their most
            # (ready newcomers join them while this batch prefills): then every step has room;
            # online batches decoding in their own caches count as others at one token a row
            others = [(len(nc.seqs), 1, nc.done) for nc in self.newcomers if nc.left]
            others += [(d.computed(), 1, self.caches.view(d.cache).filled) for d in self.decode if d.online and d.live()]
            live = sum(d.computed() for d in self.decode if d.live() and not d.online)
            ready = sum(len(nc.seqs) for nc in self.newcomers if not nc.left)
            decode_rows = min(self.e.batch_size * n - sum(r for r, _, _ in others), live + ready)
            if not self.widest((take, 0, 1), decode_rows, others, self.e.prefixes.shared):
                continue
            room = longest + max(head[j].max_new_tokens for j in range(take)) if online else longest
            cache = self._newcomer_cache(take, room, [cache_chain(s.chain) for s in head[:take]])
            if cache is not None:
                break
        else:
            return  # nothing fits this step: the prompts wait for room
        seqs = self.waiting.pop(take)
        self.e.stats.record_prompts(seqs)
        whole = S.prefill_input(seqs, longest, self.e.pad_id)
        self.newcomers.append(_Newcomers(seqs, cache, whole, torch.full((take,), -1), online=online))

    def _newcomer_inputs(self, decode_rows: int) -> list:
        """This step's chunk of each newcomer batch still prefilling, oldest first, each the
        longest that keeps the step within the limit beside the decode rows and the others'
        chunks (those not yet given one count one token a row)."""
        prefilling = [nc for nc in self.newcomers if nc.left]
        widths = [1] * len(prefilling)
        for i, nc in enumerate(prefilling):
            others = [(len(o.seqs), w, o.done) for j, (o, w) in enumerate(zip(prefilling, widths)) if j != i and w]
            widths[i] = self.widest((len(nc.seqs), nc.done, nc.left), decode_rows, others, self.e.prefixes.shared)
        return [(nc, nc.take(w), True) for nc, w in zip(prefilling, widths) if w]

