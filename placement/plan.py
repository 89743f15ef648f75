"""Placement: which tier every tensor group lives on between uses.

Group keys come from the model spec: ('outer',), ('attn', j), ('gate', j), ('expert', j, e).
The KV cache has one tier for the whole run. The planner may produce any placement; the
greedy one here is the fallback the paper argues for: small always-used groups on the
device, then experts in host RAM before disk (an expert picked by a gate is needed *now*,
and host RAM answers fastest).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from placement.tiers import DEVICE, DISK, HOST


class PlacementError(Exception):
    pass


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

    @classmethod
    def greedy(cls, sizes: dict, *, device: int, host: int, kv_bytes: int, reserve: int) -> "Placement":
        """Fill the device (less `reserve` for the transient working set), then host, then disk.

        `sizes` maps group key -> bytes; `kv_bytes` is the KV cache of a whole batch group."""
        tiers: dict = {}
        room = {DEVICE: device - reserve, HOST: host}

        def put(key, order):
            for tier in order:
                if tier == DISK or sizes[key] <= room[tier]:
                    if tier != DISK:
                        room[tier] -= sizes[key]
                    tiers[key] = tier
                    return

        small = [k for k in sizes if k[0] != "expert"]
        experts = [k for k in sizes if k[0] == "expert"]
        for key in small:
            put(key, (DEVICE, HOST, DISK))
        if kv_bytes <= room[DEVICE]:
            kv, room[DEVICE] = DEVICE, room[DEVICE] - kv_bytes
        elif kv_bytes <= room[HOST]:
            kv, room[HOST] = HOST, room[HOST] - kv_bytes
        else:
            raise PlacementError(f"the KV cache needs {kv_bytes} bytes but only {room[DEVICE]} device and "
                                 f"{room[HOST]} host bytes are left; lower --batch-size or --num-batches "
                                 f"or --max-new-tokens, or raise --host-memory")
        for key in experts:
            put(key, (DEVICE, HOST, DISK))
        return cls(tiers, kv)
