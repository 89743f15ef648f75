"""Prompt prefixes groups of lines share: segments prefilled once and read once per layer per step.

Labelling files and evaluation sweeps interleave a few long instructions (a rubric, then one of
several few-shot blocks) before short items. At the start of each window the engine groups its
lines by the token prefixes they share (`find_segments`: the window's prompts sorted, the
longest common prefix of neighbours, split where it drops: the trie of the prompts without
building one), keeping a *segment* wherever at least two lines share `MIN_TOKENS` more tokens
than their parent segment. Each segment is prefilled once, as a one-row cache on the run's KV
tier charged to that tier's budget, attending to its parent chain the way a line does; every
line then starts from its own chain of segments (`Sequence.chain`) and prefills only the rest,
its positions counted after them. Attention reads the keys of the segments a step's rows need
once per layer (`layers.attend_shared`: one copy broadcast over the rows' queries, each row's
own chain unmasked); with the KV on the host a step loads each once per layer for the group.
A segment is at most each line's length less one: every line prefills at least its last token,
whose logits give its first new token. Held segments that a new window also finds are kept;
others go once no sequence reads them, so a short prefix held from an earlier window never
stands in for a longer one. A rerun (resume) computes them again.
"""
from __future__ import annotations

MIN_TOKENS = 16  # a shorter shared prefix saves less than its own prefill pass costs
# Each segment is a prefill pass of its own (under offloading, one more stream of the weights):
# a window keeps the ones saving the most prompt tokens, never a child without its parent.
MAX_SEGMENTS = 16


def refusal(spec, config) -> str | None:
    """Why prefixes are not shared in this run, or None when they are."""
    if not config.prefix_cache:
        return "off: --no-prefix-cache"
    if not spec.family.SHARED_PREFIX:
        return (f"off: {spec.shape.model_type} attention is not plain attention over cached keys (MLA's latent "
                "cache, gpt-oss's sinks): a shared prefix cannot be read once for every row")
    if any(spec.window(j) is not None for j in range(spec.shape.num_layers)):
        return "off: sliding-window layers would see a different part of the prefix from each line"
    if config.attention != "full":
        return "off: --attention sink/window keeps each line's own first tokens, which the prefix holds"
    return None


def _common(a, b) -> int:
    """Tokens `a` and `b` share, leaving each at least one of its own."""
    limit, n = min(len(a), len(b)) - 1, 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def find_segments(prompts: list) -> list[tuple[int, int, list[int]]]:
    """The segments a window's prompts share, parents before children: (start, end, indices
    of the prompts that start with tokens [0, end)), each at least MIN_TOKENS tokens beyond its
    parent's end (`start`) and shared by at least two prompts. Sorted, the prompts sharing a
    prefix are neighbours, and a run of neighbours shares the least of their pairwise common
    lengths; each run splits where that least is reached into the runs sharing more."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    near = [_common(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    found, todo = [], [(0, len(order) - 1, 0)] if len(order) > 1 else []
    while todo:  # (first, last) sorted positions of a run of >= 2 prompts, its parent's end
        lo, hi, start = todo.pop()
        depth = min(near[lo:hi])
        if depth - start >= MIN_TOKENS:
            found.append((start, depth, [order[k] for k in range(lo, hi + 1)]))
            start = depth
        k = lo
        while k < hi:
            if near[k] > depth:  # a run of neighbours sharing more than this one
                j = k
                while j < hi and near[j] > depth:
                    j += 1
                todo.append((k, j, start))
                k = j
            else:
                k += 1
    return _worth_a_pass(found)


def _worth_a_pass(found: list) -> list:
    """At most MAX_SEGMENTS of `found`, those saving the most tokens (length x (lines - 1)),
    each with its parent; parents before children."""
    parent = {}
    for i, (start, _, members) in enumerate(found):  # the enclosing segment ending where it starts
        parent[i] = next((j for j, (_, end, outer) in enumerate(found) if end == start and members[0] in outer),
                         None) if start else None
    kept = set()
    for i in sorted(range(len(found)), key=lambda i: -(found[i][1] - found[i][0]) * (len(found[i][2]) - 1)):
        if len(kept) < MAX_SEGMENTS and (parent[i] is None or parent[i] in kept):
            kept.add(i)
    return sorted((found[i] for i in kept), key=lambda f: f[0])


class Segment:
    """A shared prompt segment: tokens [start, end) of the prompts that start with `ids` (all
    `end` of them), after its parent chain; its keys and values are the executor's, named by
    the handle `cache` (execute/caches.CacheManager.share_rows). `chain` is the parents and itself: what a line starting from
    it attends."""

    def __init__(self, key: tuple, parent: "Segment | None", cache):
        self.key, self.ids, self.parent, self.cache = key, list(key[1]), parent, cache
        self.start = parent.end if parent else 0
        self.end = len(self.ids)
        self.length = self.end - self.start
        self.chain = (parent.chain if parent else ()) + (self,)

    @staticmethod
    def key(ids, bounds) -> tuple:
        """Its identity: the tokens and where its chain splits them (the KV depends on both)."""
        return tuple(bounds), tuple(ids)

    def serves(self, s) -> bool:
        """`s` starts with this segment's tokens and has one beyond them."""
        return len(s.prompt_ids) > self.end and s.prompt_ids[:self.end] == self.ids



def cache_chain(chain: tuple) -> tuple:
    """A chain of segments as the executor reads it: their handles, outermost first."""
    return tuple(p.cache for p in chain)


def report(engine) -> dict:
    """The run report's `prefix_cache`: whether prefixes were shared (and why not), each
    segment's length, lines and the prefill it saved, the totals, and the prefill seconds they
    saved, estimated at the run's measured prefill seconds per prompt token."""
    s = engine.stats
    per_token = s.prefill_s / s.prefill_tokens if s.prefill_tokens else None
    prefixes = [{"start": start, "tokens": tokens, "lines": lines, "prefills": prefills,
                 "prefill_tokens_saved": tokens * (lines - prefills)}
                for start, tokens, lines, prefills in s.prefixes.values()]
    return {"enabled": engine.config.prefix_cache,
            "status": engine.prefixes.off or ("shared" if s.prefix_lines else "on: no window's lines shared "
                                            f"a prefix of {MIN_TOKENS} tokens or more"),
            "prefix_tokens": s.prefix_tokens, "prefix_prefills": s.prefix_prefills, "lines": s.prefix_lines,
            "prefill_tokens_saved": s.prefix_tokens_saved,
            "prefill_s_saved_estimate": round(per_token * s.prefix_tokens_saved, 4) if per_token else None,
            "estimate": "prefill tokens saved x this run's prefill seconds per prefilled prompt token",
            "prefixes": prefixes,
            "decode_kv_bytes_loaded": s.decode_kv_bytes,
            "decode_kv_bytes_per_step": s.decode_kv_bytes // s.decode_steps if s.decode_steps else None}
