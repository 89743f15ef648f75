"""The prompt segments groups of lines share, held for the run (schedule/prefix.py finds them):
which segments a window's lines start from, their caches prefilled once, given back once
nothing reads them. The engine holds one `PrefixCache`; the scheduler asks it where each line
starts (`share` for a source's lines, `join` for an online request) and how many prompt tokens
a line prefills itself (`own_len`)."""
from __future__ import annotations

import torch

from klotski.execute.contract import BatchStep, StepInput
from klotski.schedule import sequences as S
from klotski.schedule.prefix import Segment, cache_chain, find_segments, refusal
from planner.workingset import Step, activation_bytes
from placement.tiers import HOST, OverBudget


class PrefixCache:
    """The segments held (`segments`, by key) and what they saved (the engine's stats)."""

    def __init__(self, engine):
        self.e = engine
        self.segments: dict[tuple, Segment] = {}
        self.off = refusal(engine.spec, engine.config)  # why segments are not shared, or None

    @property
    def longest(self) -> Segment | None:
        """The longest segment held, or None."""
        return max(self.segments.values(), key=lambda p: p.end, default=None)

    @property
    def shared(self) -> int:
        """Keys a step's rows may score beside their own: every segment held (a bound)."""
        return sum(p.length for p in self.segments.values())

    def own_len(self, s: S.Sequence) -> int:
        """Prompt tokens a line prefills itself: those after the segments it starts from."""
        return len(s.prompt_ids) - s.shared

    def share(self, seqs) -> None:
        """Group the window's lines by the prefixes they share and give each line its chain of
        segments: those held already are kept, the others prefilled once each (parents first,
        each attending to its own parent chain). Held segments nothing reads any more go."""
        if self.off or not seqs:
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
            for a in range(0, len(new), self.e.batch_size):
                part = new[a:a + self.e.batch_size]
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

    def join(self, s: S.Sequence) -> None:
        """A sequence that joins the running rows starts from the longest held segment it shares."""
        best = max((p for p in self.segments.values() if p.serves(s)), key=lambda p: p.end, default=None)
        self._start_from(s, best.chain if best else ())

    def _start_from(self, s: S.Sequence, chain: tuple) -> None:
        s.chain, s.shared = chain, chain[-1].end if chain else 0
        if chain:
            for p in chain:
                self._count_prefix(p, lines=1)
            self.e.stats.prefix_lines += 1
            self.e.stats.prefix_tokens = max(self.e.stats.prefix_tokens, s.shared)
            self.e.stats.prefix_tokens_saved += s.shared

    def _segments_fit(self, keys: set, own: int, new: int) -> bool:
        """Whether a one-column step still fits the activations the plan reserved with every
        segment held (those kept and `new` tokens of new ones) side by side in a batch's keys
        beside a line's `own` (a batch attends over all its rows' segments; the plan counted
        whole prompts): else no chunk is small enough once they are held."""
        if self.e.setup.activation_reserve is None:
            return True
        held = sum(p.length for k, p in self.segments.items() if k not in keys)
        step = Step.prefill(self.e.batch_size, self.e.num_batches, 1, own + held + new)
        return activation_bytes(self.e.spec, self.e.dtype.itemsize, step, self.e.attends_on_host()) <= self.e.setup.activation_reserve

    def _segment_headroom(self, own: int) -> int:
        """Device bytes a shared segment's cache must leave free, so that segments take only room
        the plan does not count on (it counted whole prompts in every row; rows that start from
        segments hold `own` slots at most, their own tokens and answers): a step's activations
        and the largest group it fetches, and the rows' caches while none are made (a continuous
        run's, once made, are in use already)."""
        if self.e.placement.kv == HOST:
            return 0
        rows = 0
        if not (self.e.scheduler and any(d.live() for d in self.e.scheduler.decode)):
            rows = self.e.caches.nbytes(self.e.batch_size * self.e.num_batches, own)
        return (self.e.setup.activation_reserve or 0) + self.e.cache.largest_use + rows

    def _prefill_segments(self, keys: list, parents: list, keep_free: int = 0) -> list[Segment] | None:
        """Prefill segments together, once, a row each (left-padded as lines are), each row
        attending to its own parent chain as a line's own tokens would; None (nothing made)
        when their cache does not fit with `keep_free` device bytes still free."""
        starts = [p.end if p else 0 for p in parents]
        lengths = [len(k[1]) - a for k, a in zip(keys, starts)]
        width, rows = max(lengths), len(keys)
        caches = self.e.caches
        group = caches.open_group()
        try:
            cache = caches.allocate(group, rows, width, keep_free=keep_free,
                                    chains=[cache_chain(p.chain) if p else () for p in parents])
        except OverBudget:
            caches.close_group(group)
            return None
        try:
            ids = torch.full((rows, width), self.e.pad_id, dtype=torch.long)
            valid = torch.zeros((rows, width), dtype=torch.bool)
            positions = torch.zeros((rows, width), dtype=torch.long)
            for r, (k, a, n) in enumerate(zip(keys, starts, lengths)):
                ids[r, width - n:], valid[r, width - n:] = torch.tensor(k[1][a:]), True
                positions[r, width - n:] = torch.arange(a, a + n)
            chunk = self.e.chunk_within(rows, 1, self.e.prefill_chunk or width, max(starts) + width)
            for part in S.chunks(StepInput(ids, valid, positions), chunk):
                self.e.step([BatchStep(cache, part)], prompt=True, decode=None)
        except BaseException:
            caches.close_group(group)
            raise
        handles = caches.share_rows(cache, lengths)
        made = [Segment(k, p, h) for h, k, p in zip(handles, keys, parents)]
        for segment in made:
            self.segments[segment.key] = segment
            self._count_prefix(segment, prefills=1)
            self.e.stats.prefix_prefills += 1
            self.e.stats.prefix_tokens_saved -= segment.length
        return made

    def _count_prefix(self, p: Segment, lines: int = 0, prefills: int = 0) -> None:
        counts = self.e.stats.prefixes.setdefault(p.key, [p.start, p.length, 0, 0])
        counts[2] += lines
        counts[3] += prefills

    def _drop_unused(self, keep: set) -> None:
        """Give back the held segments that neither `keep`, nor a sequence running or waiting,
        nor a segment kept (a child attends to its parents) reads."""
        readers = [*(self.e.scheduler.holding() if self.e.scheduler else ()), *self.e.waiting.everything()]
        held = [self.segments[k] for k in keep if k in self.segments] + [p for s in readers for p in s.chain]
        read = {id(p) for q in held for p in q.chain}
        for key in [k for k, p in self.segments.items() if id(p) not in read]:
            self.e.caches.release_segment(self.segments.pop(key).cache)

    def drop(self) -> None:
        for p in self.segments.values():
            self.e.caches.release_segment(p.cache)
        self.segments.clear()

