"""A step's logits become what each row picks from: one vectorised pass over the batch's rows.

The fields apply in vLLM's order (transformers' differs only in placing min-p last, after
top-k and top-p; where they differ we follow vLLM, whose `run-batch` the job files are written for):

  1. `logit_bias` (added), `min_tokens` (EOS and `stop_token_ids` at -inf until the row has
     made that many tokens; with `ignore_eos` EOS is no stop, so it is not held back)
  2. `repetition_penalty` over the prompt's and the answer's tokens (transformers' and vLLM's:
     a seen token's logit divided by it, multiplied where negative)
  3. `frequency_penalty` x count and `presence_penalty` x (count > 0) subtracted, counting the
     answer's tokens only (OpenAI's published formula, vLLM's)
     -- a greedy row takes the argmax here --
  4. temperature, 5. `min_p` (relative to the top token's probability), 6. `top_k`,
  7. `top_p` (transformers' and vLLM's rule: drop the tokens whose ascending cumulative
     probability is <= 1 - top_p; the top token always stays)
     -- then each sampled row draws at one uniform number from its own torch.Generator (inverse
     CDF), so a row's answer is the same whatever else shares its batch.

Every step is a fixed number of tensor ops over the rows that ask for it (their parameters
gathered into small tensors), never a loop over rows or tokens in tensor code: the op count
of a step does not grow with the batch (tests/test_sampling_fields.py counts it). The draw's
only per-row op is that one number from the row's own stream. Steps 1-3 touch only the (row,
token) pairs concerned (one copy of the logits, then sparse writes); where every sampled row
sets top_k, 6-7 and the draw work on its top max-k tokens, not the whole vocabulary. Log-probabilities are taken
before all of this (klotski/schedule/logprobs.py): the model's distribution, as vLLM's
default "raw" logprobs and OpenAI's report.
"""
from __future__ import annotations

import math

import torch

NEG_INF = -math.inf


def pick_tokens(batch: list, logits: torch.Tensor, eos: set[int]) -> list[int]:
    """Each row's next token: the argmax of its shaped logits (steps 1-3), or a draw from its
    warped distribution (4-7) where it samples. `logits` is left as it is."""
    shaped = shape(batch, logits, eos)
    tokens = shaped.argmax(dim=-1).tolist()
    sampled = [i for i, s in enumerate(batch) if s.generator is not None and not s.done and s.forced is None]
    # A pass per width of candidates: rows that rank their tokens draw in rank order over their
    # own top_k (or the whole vocabulary, for top_p alone), the others in token order over the
    # whole vocabulary. A row's group depends on its own fields only, so every sum it takes has
    # the same terms in the same places whatever shares its batch: its draw does not depend on
    # its neighbours, to the bit (a pass over a wider neighbour's candidates would round its
    # top_p mass otherwise).
    vocab, groups = logits.shape[-1], {}
    for i in sampled:
        s = batch[i]
        groups.setdefault(min(s.top_k, vocab) if s.top_k else vocab if s.top_p < 1.0 else 0, []).append(i)
    for rows in groups.values():
        sub = shaped if len(rows) == len(batch) else shaped[torch.tensor(rows)]
        values, ids = candidates([batch[i] for i in rows], sub)
        for i, t in zip(rows, draw(values, ids, [batch[i].generator for i in rows])):
            tokens[i] = t
    return tokens


def shape(batch: list, logits: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """Steps 1-3 (what changes a greedy pick): the batch's logits, or a copy changed where a row
    asks for a bias, held stops or a penalty. Each touches only the (row, token) pairs concerned:
    one copy of the logits, then sparse writes."""
    live = [i for i, s in enumerate(batch) if not s.done]
    bias = [(i, t, b) for i in live for t, b in batch[i].logit_bias]
    held = [(i, t) for i in live if len(batch[i].out) < batch[i].min_tokens for t in stops(batch[i], eos)]
    repeat = [i for i in live if batch[i].repetition_penalty != 1.0]
    counted = [i for i in live if batch[i].frequency_penalty or batch[i].presence_penalty]
    if not (bias or held or repeat or counted):
        return logits
    x = logits.clone()
    if bias:
        rows, ids, values = zip(*bias)
        x.index_put_((torch.tensor(rows), torch.tensor(ids)), torch.tensor(values, dtype=x.dtype), accumulate=True)
    if held:
        rows, ids = zip(*held)
        x.index_put_((torch.tensor(rows), torch.tensor(ids)), torch.tensor(NEG_INF, dtype=x.dtype))
        if dead := [i for i in set(rows) if batch[i].grammar is not None]:
            # a row its grammar left only a stop to pick from picks from its logits as they were
            at = torch.tensor(sorted(dead))
            gone = (x[at].amax(dim=-1) == NEG_INF)[:, None]
            x[at] = torch.where(gone, logits[at], x[at])
    if repeat:
        repetition(x, [batch[i] for i in repeat], torch.tensor(repeat))
    if counted:
        frequency_presence(x, [batch[i] for i in counted], torch.tensor(counted))
    return x


def stops(s, eos: set[int]) -> list[int]:
    """The tokens that would end `s`: its stop_token_ids, and EOS unless it ignores EOS."""
    return [*s.stop_token_ids, *(() if s.ignore_eos else sorted(eos))]


def repetition(x: torch.Tensor, rows: list, at: torch.Tensor) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor (vLLM's the same), in place, for the rows
    `at` of `x` at once: each token of a row's prompt or answer has its logit divided by the
    penalty (multiplied where negative). A token seen twice is written twice, the same value."""
    ids, owners = _tokens_of(rows, with_prompt=True)
    penalty = torch.tensor([s.repetition_penalty for s in rows], dtype=x.dtype)[owners]
    where = (at[owners], ids)
    seen = x[where]
    x[where] = torch.where(seen < 0, seen * penalty, seen / penalty)


def frequency_presence(x: torch.Tensor, rows: list, at: torch.Tensor) -> None:
    """OpenAI's formula, in place, for the rows `at` of `x` at once: logit - count x
    frequency_penalty - (count > 0) x presence_penalty, counting the answer's tokens so far."""
    ids, owners = _tokens_of(rows, with_prompt=False)
    if not len(ids):
        return
    pairs, counts = torch.unique(owners * x.shape[-1] + ids, return_counts=True)
    owner, token = pairs // x.shape[-1], pairs % x.shape[-1]
    frequency = torch.tensor([s.frequency_penalty for s in rows], dtype=x.dtype)[owner]
    presence = torch.tensor([s.presence_penalty for s in rows], dtype=x.dtype)[owner]
    where = (at[owner], token)
    x[where] = x[where] - frequency * counts.to(x.dtype) - presence


def warp(rows: list, x: torch.Tensor) -> torch.Tensor:
    """Steps 4-7 over the sampled rows' shaped logits (one row of `x` per sequence of `rows`), as
    a full-width tensor: a dropped token's logit is -inf (what transformers' warpers give)."""
    values, ids = candidates(rows, x)
    return values if ids is None else torch.full_like(x, NEG_INF).scatter(1, ids, values)


def candidates(rows: list, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 4-7: temperature, min_p, top_k, top_p, as (logits, token ids): every token in token
    order (ids None) where no row ranks, else each row's tokens ranked, best first (only the
    top max-k where every row sets top_k: the rest are cut anyway), a dropped one at -inf.
    Thresholds are taken in Python's double, then rounded once, as transformers' warpers do."""
    x = x / torch.tensor([s.temperature for s in rows], dtype=x.dtype)[:, None]
    if any(s.min_p for s in rows):
        probs = torch.softmax(x, dim=-1)
        floor = torch.tensor([s.min_p for s in rows], dtype=x.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, NEG_INF)
    cut_k, cut_p = any(s.top_k for s in rows), any(s.top_p < 1.0 for s in rows)
    if not (cut_k or cut_p):
        return x, None
    width = x.shape[-1]
    if all(s.top_k for s in rows):
        ranked, order = x.topk(min(max(s.top_k for s in rows), width), dim=-1)
    else:
        ranked, order = x.sort(dim=-1, descending=True)
    if cut_k:  # the k-th largest logit of each row (k = every candidate where top_k is off)
        k = torch.tensor([min(s.top_k or width, ranked.shape[-1]) for s in rows])[:, None]
        ranked = ranked.masked_fill(ranked < ranked.gather(1, k - 1), NEG_INF)
    if cut_p:  # `ranked` reversed is the ascending sort transformers' TopP takes: the same sums
        mass = ranked.flip(-1).softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= torch.tensor([1 - s.top_p if s.top_p < 1.0 else -1.0 for s in rows], dtype=x.dtype)[:, None]
        drop[:, -1] = False
        ranked = ranked.masked_fill(drop.flip(-1), NEG_INF)
    return ranked, order


def draw(values: torch.Tensor, ids: torch.Tensor | None, generators: list) -> list[int]:
    """One token per row, at one uniform number from that row's own generator: the first
    candidate whose cumulative weight passes it (never one of weight 0). Weights are exp(logit -
    the row's best), summed in order without normalising: a row's sums do not depend on how many
    candidates its neighbours made it carry (a trailing -inf adds exactly 0)."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    cdf = (values - values.amax(dim=-1, keepdim=True)).exp().double().cumsum(dim=-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=values.shape[-1] - 1)
    return (at if ids is None else ids.gather(1, at))[:, 0].tolist()


def _tokens_of(rows: list, with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, their row) of every row's answer so far, and its prompt's distinct tokens
    (cached on the sequence) where asked, as two flat tensors."""
    answer = [t for s in rows for t in s.out]
    parts = [*(s.prompt_seen for s in rows)] if with_prompt else []
    ids = torch.cat([*parts, torch.tensor(answer, dtype=torch.long)])
    lengths = [*(len(p) for p in parts), *(len(s.out) for s in rows)]
    owners = torch.arange(len(rows)).repeat(2 if with_prompt else 1)
    return ids, owners.repeat_interleave(torch.tensor(lengths))
