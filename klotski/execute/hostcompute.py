"""Host compute: attention where a host KV cache lives, cold experts where they live.

`HostCompute` answers the pipeline's two per-layer, per-step questions and counts what the
answers saved and cost:

  * attention: a batch whose KV cache is on the host attends there (q goes down, the output
    comes up) instead of moving its KV prefix up the link;
  * experts: a gate-selected expert that is not on the device and not on its way, whose group
    is in host RAM (the host tier, or staged from disk), is computed there (its tokens go
    down, the outputs come up) instead of being moved.

Each knob is `on` (wherever applicable), `off`, or `auto`: the run's cost model
(planner/costmodel.py: `attention_on_host`, `expert_on_host`, with the profile's measured host
rates) decides. A cost model that cannot price the host (no host rates) never chooses it.
The math is the same function either way, so the tokens are too.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Counts:
    on_host: int = 0           # batch-layers (attention) or expert calls (experts) computed on the host
    bytes_not_moved: int = 0   # bytes that would have crossed host->device otherwise
    host_s: float = 0.0        # host compute time (host clock)
    decided: int = 0           # how many times the question was asked


@dataclass
class HostCompute:
    attention_mode: str = "off"
    experts_mode: str = "off"
    cost: object | None = None   # a planner CostModel, for `auto`
    asked: tuple = ("off", "off")  # the knobs as given (auto resolves: planning.host_modes)
    attention: _Counts = field(default_factory=_Counts)
    experts: _Counts = field(default_factory=_Counts)

    def __post_init__(self):
        self._attn_memo: dict = {}
        self._expert_memo: dict = {}

    @classmethod
    def from_config(cls, config, cost=None) -> "HostCompute":
        return cls(config.host_attention, config.host_experts, cost)

    def attend_on_host(self, bs: int, ctx: int, new: int) -> bool:
        """One batch's attention at one layer, its KV on the host: `ctx` positions attended
        over (those a load would bring up plus this step's), `new` tokens per sequence."""
        self.attention.decided += 1
        if self.attention_mode != "auto":
            return self.attention_mode == "on"
        if self.cost is None:
            return False
        point = (bs, ctx, new)
        if point not in self._attn_memo:
            self._attn_memo[point] = bool(self.cost.attention_on_host(bs, ctx, new))
        return self._attn_memo[point]

    def expert_on_host(self, tokens: int, tier: str) -> bool:
        """One expert with `tokens` tokens this step, not on the device, its group on `tier`."""
        self.experts.decided += 1
        if self.experts_mode != "auto":
            return self.experts_mode == "on"
        if self.cost is None:
            return False
        point = (tokens, tier)
        if point not in self._expert_memo:
            self._expert_memo[point] = bool(self.cost.expert_on_host(tokens, tier))
        return self._expert_memo[point]

    def report(self) -> dict:
        a, e = self.attention, self.experts
        return {"attention": {"mode": self.attention_mode, "batches_layers_on_host": a.on_host,
                              "kv_bytes_not_moved": a.bytes_not_moved, "host_s": round(a.host_s, 4)},
                "experts": {"mode": self.experts_mode, "experts_on_host": e.on_host,
                            "bytes_not_moved": e.bytes_not_moved, "host_s": round(e.host_s, 4)},
                "asked": {"attention": self.asked[0], "experts": self.asked[1]},
                "priced_by": "the run's cost model" if self.cost is not None else None}
