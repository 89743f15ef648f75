"""A prompt prefix every line of a window shares, prefilled once and read once per batch.

Labelling jobs repeat one long instruction (a system prompt, a rubric, few-shot examples)
before a short item. The longest token prefix common to every line of a window (the chat
template's shared part falls out of it: it is the same tokens) is prefilled once, as a
one-row cache on the run's KV tier, charged to that tier's budget like any batch's cache.
Every line then prefills only the rest, its positions counted after the prefix, in a cache
that holds its own tokens only. Attention reads the prefix's keys and values once per layer
for a whole batch (`layers.attend_shared`: one copy broadcast over the rows' queries, the
softmax over prefix and own scores side by side, i.e. over their concatenation); with the
KV on the host, a step loads the prefix once per layer for the whole group, never a copy per
row. The prefix is at most each line's length less one: every line prefills at least its
last token, whose logits give its first new token. It is kept across windows while the
next window's lines all start with it, and given back at the engine's close; a rerun
(resume) computes it again.
"""
from __future__ import annotations

import torch

MIN_TOKENS = 16  # a shorter shared prefix saves less than its own prefill pass costs


def refusal(spec, config) -> str | None:
    """Why prefixes are not shared in this run, or None when they are."""
    if not config.prefix_cache:
        return "off: --no-prefix-cache"
    if not spec.family.SHARED_PREFIX:
        return (f"off: {spec.model_type} attention is not plain attention over cached keys (MLA's latent "
                "cache, gpt-oss's sinks): a shared prefix cannot be read once for every row")
    if any(spec.window(j) is not None for j in range(spec.num_layers)):
        return "off: sliding-window layers would see a different part of the prefix from each line"
    if config.attention != "full":
        return "off: --attention sink/window keeps each line's own first tokens, which the prefix holds"
    return None


def common_prefix(seqs) -> list[int]:
    """The longest token prefix every sequence's prompt starts with, leaving each at least
    one token of its own; [] when shorter than MIN_TOKENS or fewer than two lines share it.
    The prefix common to all is that of the lexicographically first and last prompts."""
    if len(seqs) < 2:
        return []
    prompts = [s.prompt_ids for s in seqs]
    first, last = min(prompts), max(prompts)
    limit = min(map(len, prompts)) - 1
    n = 0
    while n < limit and first[n] == last[n]:
        n += 1
    return list(first[:n]) if n >= MIN_TOKENS else []


class SharedPrefix:
    """The prefix's tokens and its one-row cache (`kv`, in `space`: its budget account)."""

    def __init__(self, ids: list[int], kv, space):
        self.ids, self.kv, self.space = ids, kv, space
        self.length = len(ids)

    @property
    def on_host(self) -> bool:
        return self.kv.on_host

    def serves(self, seqs) -> bool:
        """Every one of `seqs` starts with this prefix and has a token beyond it."""
        P = self.length
        return all(len(s.prompt_ids) > P and s.prompt_ids[:P] == self.ids for s in seqs)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` where they live, as [kv_heads, P, dim] views."""
        return (self.kv.keys[layer][:self.length, 0].transpose(0, 1),
                self.kv.values[layer][:self.length, 0].transpose(0, 1))

    def nbytes(self) -> int:
        """One layer's keys and values: what a load moves."""
        k, v = self.kv.keys[0], self.kv.values[0]
        return self.length * (k[0, 0].numel() + v[0, 0].numel()) * k.element_size()

    def load(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A device copy of `layer`'s keys and values (host tier): each one contiguous block
        of page-locked memory, so on CUDA the copy is asynchronous on the channel's stream."""
        out = []
        for src in (self.kv.keys[layer][:self.length, 0], self.kv.values[layer][:self.length, 0]):
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)
            dst.copy_(src, non_blocking=True)
            out.append(dst.transpose(0, 1))
        return out[0], out[1]

    def release(self) -> None:
        """The tensors go before their account does."""
        self.kv.release()
        self.space.close()


def report(engine) -> dict:
    """The run report's `prefix_cache`: whether prefixes were shared (and why not), the shared
    length, what was not prefilled, and the prefill seconds that saved, estimated at the
    run's measured prefill seconds per prompt token."""
    s = engine.stats
    per_token = s.prefill_s / s.prefill_tokens if s.prefill_tokens else None
    return {"enabled": engine.config.prefix_cache,
            "status": engine.prefix_off or ("shared" if s.prefix_lines else "on: no window's lines shared "
                                            f"a prefix of {MIN_TOKENS} tokens or more"),
            "prefix_tokens": s.prefix_tokens, "prefix_prefills": s.prefix_prefills, "lines": s.prefix_lines,
            "prefill_tokens_saved": s.prefix_tokens_saved,
            "prefill_s_saved_estimate": round(per_token * s.prefix_tokens_saved, 4) if per_token else None,
            "estimate": "prefill tokens saved x this run's prefill seconds per prefilled prompt token",
            "decode_kv_bytes_loaded": s.decode_kv_bytes,
            "decode_kv_bytes_per_step": s.decode_kv_bytes // s.decode_steps if s.decode_steps else None}
