"""Byte sizes as people write them ("20GiB", "512MB") and as people read them."""
from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int | float) -> int:
    """'20GiB' -> 21474836480. Decimal units (GB) are powers of 10, binary (GiB) powers of 2."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not like '20GiB', '512MB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size_flag(n: float) -> str:
    """A size to pass back on the command line that parses to at least `n` bytes: MiB with two
    decimals, rounded up ("3.88MiB"), or GiB for sizes of 10 GiB and more."""
    unit, scale = ("GiB", 2**30) if n >= 10 * 2**30 else ("MiB", 2**20)
    value = math.ceil((n + 1) / scale * 100) / 100
    while parse_size(f"{value:.2f}{unit}") < n:  # float rounding of the product
        value += 0.01
    return f"{value:.2f}{unit}"


def format_bytes(n: float) -> str:
    """Binary units, three significant figures: 1.50 GiB."""
    if n != n or n in (float("inf"), float("-inf")):
        return "unlimited"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
