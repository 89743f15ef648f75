"""TensorRef: where one logical weight lives (its own module so that family modules can
build refs without importing spec, which imports them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorRef:
    """Where one logical weight lives: tensor `name`, optionally `index` along dim 0
    (fused experts) and a row range `rows` = (start, stop) along the next dim; an FP8 weight
    names its `scale` tensor (weight_scale_inv) and the `block` each scale covers."""
    name: str
    index: int | None = None
    rows: tuple[int, int] | None = None
    scale: str | None = None
    block: tuple[int, int] | None = None
