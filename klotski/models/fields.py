"""Reading `config.json` fields the way a family's math needs them: each reader returns the
value or raises `BadField`, whose message names the field, the value found and what is
allowed. A family's args dataclass lists its fields through these (see spec.py), so a
hostile config is refused before a weight is read instead of crashing or, worse, running
on nonsense (a negative RoPE base gives NaN logits, top-k 0 gives silent zeros)."""
from __future__ import annotations

import math

_MISSING = object()


class BadField(ValueError):
    """One config field that the math cannot use; str() is the one-line reason."""


def _show(value) -> str:
    return "missing" if value is _MISSING else repr(value)


def integer(cfg: dict, name: str, *, low: int = 1, high: int | None = None, high_name: str = "",
            default=_MISSING, optional: bool = False) -> int | None:
    """An integer in [low, high]; `optional` allows null (returned as None)."""
    value = cfg.get(name, default)
    if optional and value is None:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        limit = f"from {low} to {high_name or high}" + (f" ({high})" if high_name else "") if high is not None \
            else f"of at least {low}"
        null = " or null" if optional else ""
        raise BadField(f"field {name!r} is {_show(value)}; must be an integer {limit}{null}")
    return value


def positive_number(cfg: dict, name: str, *, default=_MISSING, where: str = "") -> float:
    value = cfg.get(name, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise BadField(f"field '{where}{name}' is {_show(value)}; must be a finite number greater than 0")
    return float(value)


def choice(cfg: dict, name: str, allowed: tuple, *, default=_MISSING, why: str = "", where: str = ""):
    value = cfg.get(name, default)
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise BadField(f"field '{where}{name}' is {_show(value)}; must be one of {shown}{why}")
    return value


def boolean(cfg: dict, name: str, *, default=_MISSING) -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise BadField(f"field {name!r} is {_show(value)}; must be true or false")
    return value


def token_ids(cfg: dict, name: str, vocab_size: int) -> tuple[int, ...]:
    """null, one id or a list of ids, each inside the vocabulary."""
    value = cfg.get(name)
    ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise BadField(f"field {name!r} is {value!r}; must be null or token ids from 0 to vocab_size - 1 "
                           f"({vocab_size - 1})")
    return ids


def divisible(name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise BadField(f"field {name!r} is {value}; must be a multiple of {by_name!r} ({by})")
