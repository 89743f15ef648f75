"""Log-probabilities of the tokens a step picked, for the sequences whose line asked for them.

Reported is the fp32 log-softmax of the logits row the token was picked from, before
temperature and top_p (after a grammar mask, where a line has one): the model's own
distribution, which is what OpenAI's and vLLM's ``logprobs`` (vLLM's default raw mode) give,
so a sampled answer's numbers compare with a greedy one's; with a grammar mask (vLLM's too) they
are renormalised over the tokens it allows. A step computes them for all the asking rows of a
batch at once (one logsumexp, one gather, one topk: no per-row tensor ops) and copies the
small result out once; a step where no row asks does nothing here. (Today's logits are on the
host already, fp32 [B, V]; the same ops serve device logits.)

`pieces` turns token ids into the text and bytes OpenAI's shapes carry.
"""
from __future__ import annotations

import math
import re

import torch


def record(batch, logits: torch.Tensor, tokens: list[int]) -> None:
    """Append (token, logprob, [(alternative, logprob), ...]) to each asking row's
    ``logprobs``; `logits` are the batch's rows, `tokens` what was picked from them."""
    rows = [i for i, s in enumerate(batch) if s.top_logprobs is not None and not s.done]
    if not rows:
        return
    k = min(max(batch[i].top_logprobs for i in rows), logits.shape[-1])
    # (advanced indexing: index_select on the CPU measured 15-30x slower for rows this wide)
    x = (logits if len(rows) == len(batch) else logits[torch.tensor(rows, device=logits.device)]).float()
    picked = torch.tensor([tokens[i] for i in rows], device=logits.device)[:, None]
    # log_softmax(x) = x - logsumexp(x), taken only where it is read: the picked token and the
    # top k (the logits' top k are the log-softmax's), never a [rows, vocab] tensor written
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    top = x.topk(k, dim=-1) if k else None
    parts = [x.gather(1, picked) - lse] + ([top.values - lse] if top else [])
    # one host copy: float64 holds fp32 values and token ids (< 2**53) exactly
    host = torch.cat([p.double() for p in parts] + ([top.indices.double()] if top else []), dim=1).tolist()
    for i, row in zip(rows, host):
        s, want = batch[i], batch[i].top_logprobs
        # (a grammar's forbidden tokens are -inf: not alternatives, and not JSON)
        alts = [(int(t), v) for v, t in zip(row[1:1 + want], row[1 + k:1 + k + want]) if v > -math.inf]
        s.logprobs.append((tokens[i], row[0], alts))


def pieces(tokenizer, ids) -> dict[int, tuple[str, list[int]]]:
    """Each token id's (text, UTF-8 bytes). A token holding part of a character shows as
    U+FFFD in its text, but its bytes are its own: byte-level BPE's pieces map back to bytes
    (GPT-2's table), a SentencePiece byte-fallback piece is <0xNN>."""
    ids = sorted(set(ids))
    names = tokenizer.convert_ids_to_tokens(ids)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
    out = {}
    for i, name in zip(ids, names):
        text = tokenizer.decode([i])
        name = name or ""
        if byte_level and name and all(c in _UNICODE_TO_BYTE for c in name):
            data = [_UNICODE_TO_BYTE[c] for c in name]
        elif m := _BYTE_PIECE.fullmatch(name):
            data = [int(m.group(1), 16)]
        else:
            data = list(text.encode("utf-8", "surrogatepass"))
        out[i] = (text, data)
    return out


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable bytes stand for themselves, the
    other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_level_table()
