"""`--order routing`: a window's lines grouped by their routing, so the rows that go through a
layer together want fewer distinct experts (Read-ME's expert-aware batching, for a job known in
advance).

A line's signature is cheap and taken before anything runs: the first MoE layer's router over
its prompt tokens' own embeddings (RMS-normalised by the gate's norm, no attention), as the
share of its tokens' picks each expert takes. It stands in for the routing its prefill will see;
tokens of one topic share words, and words their experts.

Lines are then dealt into groups of n x bs (the rows a step takes through each layer): each
group starts from the longest line left (longest `max_new_tokens`, then prompt), so long lines
still start early, and takes, one at a time, the line whose picks fall most on the experts the
group's lines pick already. Within a group lines keep the length order. The trade-off: a group
holds lines of one routing cluster whatever their lengths, so its batches pad to longer prompts
and its rows end more unevenly than the length order's (continuous batching refills a freed row
from the next group, so the second costs less than the first). The order only changes which
rows share a step: every line's tokens are its own (a row's numbers never depend on its batch),
and records come out one per line as the writer keeps them.
"""
from __future__ import annotations

import torch

from klotski.models import layers as L


SIGNED_TOKENS = 512  # a line's first prompt tokens its signature reads
SLICE_TOKENS = 4096  # tokens' embeddings gathered on the device at once (their bytes reserved)


def signatures(seqs: list, spec, cache, memory=None) -> torch.Tensor:
    """[N, E]: for each line, the share of its first SIGNED_TOKENS prompt tokens' picks at the
    first MoE layer that each expert takes, the router over the tokens' embeddings (read where
    the table lives; on the device a slice at a time within `memory`, the device's account)."""
    layer = spec.shape.first_moe_layer
    gate = {n: cache.store.read_ref(r).float() for n, r in cache.refs_for(("gate", layer)).items()
            if n == "post_norm" or n.startswith("router")}
    prompts = [s.prompt_ids[:SIGNED_TOKENS] for s in seqs]
    x = embedded(cache, torch.tensor([t for p in prompts for t in p], dtype=torch.long), memory)
    x = L.rms_norm(x, gate["post_norm"], spec.rms_norm_eps, spec.norm_offset)
    _, experts = spec.family.route(x, gate, spec)
    E = spec.shape.num_experts
    out = torch.zeros(len(seqs), E)
    line = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(p) for p in prompts]))
    out.index_put_((line[:, None].expand_as(experts), experts), torch.ones(experts.shape), accumulate=True)
    return out / out.sum(1, keepdim=True).clamp(min=1)


def embedded(cache, ids: torch.Tensor, memory=None) -> torch.Tensor:
    """The embeddings of `ids` on the host in fp32. A table on the device is gathered
    SLICE_TOKENS at a time into room reserved in `memory`; where there is none, each distinct
    row comes down through a view (no device allocation)."""
    rows, index = cache.embedding_rows(ids)
    if rows.device.type == "cpu":
        return rows.index_select(0, index).float()
    parts = []
    for a in range(0, len(index), SLICE_TOKENS):
        part = index[a:a + SLICE_TOKENS]
        nbytes = len(part) * (rows.shape[1] * rows.element_size() + 8)  # the rows and their index
        if memory is not None and memory.fits(nbytes):
            memory.reserve(nbytes, "routing signatures")
            try:
                parts.append(rows.index_select(0, part.to(rows.device)).cpu())
            finally:
                memory.free(nbytes)
        else:
            distinct, where = torch.unique(part, return_inverse=True)
            parts.append(torch.stack([rows[t].cpu() for t in distinct.tolist()])[where])
    return torch.cat(parts).float()


def grouped_order(lines: list, sigs: torch.Tensor, size: int, key) -> list:
    """`lines` in groups of `size` of similar routing (`sigs` their signatures), each group
    seeded by the first of what is left by `key` and filled greedily; `key` orders within."""
    left = sorted(range(len(lines)), key=lambda i: key(lines[i]))
    out = []
    while left:
        members = [left.pop(0)]
        used = sigs[members[0]].clone()  # how much of each expert the group's lines pick
        while len(members) < size and left:
            overlap = sigs[left] @ (used / used.sum().clamp(min=1e-12))
            j = int(torch.argmax(overlap))  # ties: the first, the longest
            members.append(left.pop(j))
            used += sigs[members[-1]]
        out += sorted(members, key=lambda i: key(lines[i]))
    return [lines[i] for i in out]
