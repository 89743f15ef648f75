"""Placement: which tier every tensor group lives on between uses.

Group keys come from the model spec: ('embed',), ('head',), ('attn', j), ('gate', j),
('expert', j, e).
The KV cache has one tier for the whole run. The planner chooses the placement
(`planner.solve`); tests build their own with `by_kind`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from placement.tiers import DEVICE


@dataclass(frozen=True)
class Placement:
    tiers: dict          # group key -> tier
    kv: str = DEVICE     # tier of the KV cache

    def tier(self, key) -> str:
        return self.tiers[key]

    def summary(self) -> dict:
        """Counts per kind and tier, e.g. {'expert': {'host': 40, 'disk': 24}, 'kv': 'host'}."""
        out: dict = {}
        for (kind, *_), tier in self.tiers.items():
            out.setdefault(kind, Counter())[tier] += 1
        return {**{k: dict(v) for k, v in out.items()}, "kv": self.kv}

    @classmethod
    def by_kind(cls, keys, *, kv: str = DEVICE, **tier_of_kind) -> "Placement":
        """Same tier for every group of a kind, e.g. by_kind(keys, expert='disk', attn='host')."""
        return cls({k: tier_of_kind.get(k[0], DEVICE) for k in keys}, kv)
