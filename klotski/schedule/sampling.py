"""The update's first half: a step's logits become each row's next token.

`next_tokens` takes the logits of a batch's computed rows: a row whose numbers went
non-finite fails alone, a constrained row's forbidden tokens go to -inf, each live row gets
its token (`pick`: its line's biases, penalties and warpers applied to every row at once,
then greedy, or drawn from its own random stream: klotski/schedule/logits_processing.py; a
scoring row's forced token), which `sequences.append` adds before deciding whether the
sequence is done.
"""
from __future__ import annotations

import torch

from klotski.schedule import constrain, logits_processing, logprobs
from klotski.schedule import sequences as S


def next_tokens(engine, rows: list, logits: torch.Tensor, broken: torch.Tensor) -> tuple[list[int], list]:
    """Next token of every row (None = an empty row) and the sequences this finished: a
    sequence whose numbers went non-finite fails alone; the batch carries on."""
    finished = []
    num_layers = engine.spec.shape.num_layers
    for s, finite, layer in zip(rows, torch.isfinite(logits).all(dim=-1).tolist(), broken.tolist()):
        if s is not None and not finite and not s.done:
            S.fail(s, non_finite(layer, num_layers))
            finished.append(s)
            S.notify(s)
        elif s is not None and s.leaving and not s.done:  # (a row still prefilling when its source left)
            S.abandon(s)
            finished.append(s)
    live = [s for s in rows if s is not None]
    # a constrained row's forbidden tokens go to -inf first (no op at all when none is)
    picked = iter(pick(live, constrain.mask(live, logits[[i for i, s in enumerate(rows) if s is not None]]), engine.eos))
    tokens = [next(picked) if s is not None else 0 for s in rows]
    for s, t in zip(rows, tokens):
        if s is not None and not s.done:
            engine.stats.generated_tokens += 1
            S.append(s, t, engine.tokenizer, engine.eos)
            if s.done:
                finished.append(s)
            S.notify(s)
    constrain.start(live)  # the next masks, computed while the next step's forward runs
    return tokens, finished


def pick(batch: list, logits: torch.Tensor, eos: set[int]) -> list[int]:
    """Next token of every sequence of a batch: greedy, or sampled with its own generator, after
    its line's sampling fields (logits_processing.py); a scoring row's forced token."""
    tokens = logits_processing.pick_tokens(batch, logits.float(), eos)
    tokens = [s.forced[len(s.out)] if s.forced is not None and not s.done else t for s, t in zip(batch, tokens)]
    # the rows whose line asked, from the logits before the fields: the model's distribution
    logprobs.record(batch, logits, tokens)
    return tokens


def non_finite(layer: int, num_layers: int) -> str:
    where = f"at layer {layer} of {num_layers}" if layer >= 0 else "in the final norm or lm_head"
    return f"non-finite values {where}; the checkpoint's weights or config may be corrupt (klotski check --model DIR)"
