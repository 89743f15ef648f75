"""What crosses the seam between the scheduler and the executor: plain data, never a cache's tensor.

The scheduler names caches by handle (an int the executor's `CacheManager` hands out when it
makes one) and says what to do with them in operations (`Adopt`, `Scrub`, `Realign`, `Reset`,
`Free`), which the executor applies to the tensors it owns. What the scheduler reads back of a
cache is a `CacheView` (its rows, slots, how many are filled, how far back each row reads). A
step is a list of `BatchStep`s (a cache and the new tokens of the rows it computes: a
`StepInput`); it returns a `StepOutput` per batch (logits and where a row went non-finite).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Adaptive gating's per-layer skip threshold that skips nothing (a top-1 share is at most 1):
# the scheduler's calibration writes it, the executor's gate reads it.
SKIP_NONE = 2.0


@dataclass
class StepInput:
    """One batch's new tokens for this step: ids, validity (False = left padding), positions."""
    ids: torch.Tensor        # [B, T]
    valid: torch.Tensor      # [B, T] bool
    positions: torch.Tensor  # [B, T]


@dataclass
class StepOutput:
    """One batch's result of a step: next-token logits [B, V] (fp32, on the host) and, per
    sequence, the first layer whose output was not finite (-1: none)."""
    logits: torch.Tensor
    broken_at: torch.Tensor


@dataclass(frozen=True)
class BatchStep:
    """One batch of a step: cache `cache` computes its first rows on `input` (as many as it has:
    a batch keeps its live rows in front)."""
    cache: int
    input: StepInput


@dataclass(frozen=True)
class CacheView:
    """A cache as the scheduler sees it: `batch` rows of `capacity` slots, `filled` of them
    written so far; `lengths[r]`: how many of the newest slots row r's tokens reach back (a
    row's tokens are contiguous and end at the newest slot; 0: none)."""
    cache: int
    batch: int
    capacity: int
    filled: int
    lengths: tuple[int, ...]

    def span(self, rows) -> int:
        """How many of the newest slots hold some of these rows' tokens."""
        return max((self.lengths[r] for r in rows), default=0)


@dataclass(frozen=True)
class Adopt:
    """Row `row` of `cache` takes the newest `length` slots of row `src_row` of `src` (a prompt
    prefilled elsewhere, or a row of the same cache), ending at its own newest slot."""
    cache: int
    row: int
    src: int
    src_row: int
    length: int


@dataclass(frozen=True)
class Scrub:
    """Zero row `row`'s slots: its sequence went non-finite, and a later one may attend them masked."""
    cache: int
    row: int


@dataclass(frozen=True)
class Realign:
    """Keep only the newest `keep` slots, moved to the front: the cache's filled slots become `keep`."""
    cache: int
    keep: int


@dataclass(frozen=True)
class Reset:
    """Empty again for `rows` new prompts starting from `chains` (a spare cache used once more)."""
    cache: int
    rows: int
    chains: tuple = ()


@dataclass(frozen=True)
class Free:
    """Give the cache back: its tensors, then its budget."""
    cache: int
