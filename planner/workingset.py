"""The device working set of a batch group: the one estimate of the device bytes a run needs
besides its resident weights and resident KV cache.

The planner places weights around it, its refusals name a minimum computed from it, and
the pipeline reserves its activations with `activation_bytes` and its KV buffers with
`KV_BUFFERS`, so no second estimate exists anywhere.

Two sizes of weight buffers:

* `overlap`: double buffers for attention and gates, the schedule's expert slots, the LM
  head: room for the next transfer while the current group computes (what makes the
  pipeline bubble-free). The planner uses this whenever it fits.
* `minimum`: the largest single group the pipeline holds while computing with it (plus,
  during attention, the KV buffers). The pipeline pins exactly the group it computes with
  and evicts anything else to make room, so it always runs in this; it just waits for
  each transfer. The planner falls back to it when `overlap` does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.shapes import as_shape
from planner.waves import PREFILL_EXPERT_CHUNK  # tokens per expert call (bounds the FFN intermediate)

DISK_WINDOW_LAYERS = 2          # layers staged in host memory ahead of the disk-resident ones
STAGED_RING_BYTES = 32 << 20   # a channel's page-locked ring that pageable disk reads go up through
STAGED_RINGS = 2               # one per channel that carries disk-tier groups up: weights, experts
ACTIVATION_RING_BYTES = 4 << 20  # host compute's results going up (in pieces of half of it): the
                                 # engine's host account holds it where host compute may run on a GPU
KV_STAGING_BYTES = 16 << 20     # the kv_load channel's page-locked ring a host KV cache's strided slots
                                # are gathered into on their way up (held on a GPU when the KV is on the host)
STEP_RING_BYTES = 2 << 20       # a step's small uploads (ids, masks, RoPE tables) and routing reads: two
                                # page-locked rings of half of it, held on a GPU for the whole run
KV_BUFFERS = 3                  # host-KV batches on the device at once: storing, computing, loading
ATTENTION_SCORE_CHUNK = 1 << 24  # attention scores alive at once (queries are chunked past it)
PREFILL_SHARE = 0.25            # a prefill chunk's activations may take this much of the device
DECODE_WORKSPACE_BYTES = 64 << 20  # packed experts decoded into the pool at once (beyond one): the bytes
                                   # their decoded copies and temporaries take, at most


@dataclass(frozen=True)
class Step:
    """The shape of one forward step of a group, as activations see it: `tokens` new tokens
    over all batches, `sequences` sequences (one logits row each), and the largest single
    batch's attention: `batch` sequences x `queries` new tokens x `keys` cache slots. Where
    the batches differ (a continuous step: decode rows beside newcomers' prefill chunks),
    `attention` holds each batch's (rows, queries, keys): attention runs one batch at a
    time, so the largest of them counts, not the product of the largest sides."""
    tokens: int
    sequences: int
    batch: int
    queries: int
    keys: int
    attention: tuple = ()

    @classmethod
    def prefill(cls, bs: int, n: int, chunk: int, context: int) -> "Step":
        # keys = the whole context: a step may mix one batch's prefill chunk with another
        # batch's decode at the end of its context
        return cls(tokens=n * bs * chunk, sequences=n * bs, batch=bs, queries=chunk, keys=context)

    @classmethod
    def decode(cls, bs: int, n: int, context: int) -> "Step":
        return cls(tokens=n * bs, sequences=n * bs, batch=bs, queries=1, keys=context)

    @classmethod
    def of_batches(cls, shapes) -> "Step":
        """A step over batches of their own (rows, queries, keys)."""
        shapes = tuple(shapes)
        return cls(tokens=sum(r * q for r, q, _ in shapes), sequences=sum(r for r, _, _ in shapes),
                   batch=max(r for r, _, _ in shapes), queries=max(q for _, q, _ in shapes),
                   keys=max(k for _, _, k in shapes), attention=shapes)

    def batches(self) -> tuple:
        return self.attention or ((self.batch, self.queries, self.keys),)


def activation_bytes(shape, itemsize: int, step: Step, host_attention: bool = False) -> int:
    """Device bytes of one forward step's activations.

    Alive for the whole step: the hidden states of every batch (residual, MoE input and
    output, their sum), each batch's attention mask and rotary tables. On top, the largest
    of three phases: one batch's attention (normed input, q/k/v, keys/values gathered or
    expanded for grouped queries, scores in fp32 in chunks, context, output), the routing
    and one expert call over all tokens (gathered inputs, outputs, FFN intermediates in
    chunks; the top-k slots of weighted outputs in fp32; a shared expert's output and its
    intermediates over the largest batch), and the fp32 logits of every sequence. With
    `host_attention` the keys, values and scores live on the host: the device holds only
    the projections of one batch. `shape`: a ModelShape or what as_shape takes (the engine's
    ModelSpec), here and in the functions below that price steps with this one."""
    s, t = as_shape(shape), step
    q, kv = s.attention_widths
    # keys/values over every head, as grouped queries once expanded them (layers.attend no
    # longer does: kept as a bound, not yet measured down), or (MLA) kv_b's output from the
    # latent (values are a view of it) and the keys assembled with their rotary part
    per_key = 2 * q if not s.kv_lora_rank else kv - s.num_heads * s.head_dim + q
    kv //= 2
    base = (4 * t.tokens * s.hidden_size * itemsize + t.tokens * t.keys
            + 2 * t.tokens * s.head_dim * itemsize)
    largest = max(b * new for b, new, _ in t.batches())  # one batch's new tokens

    def one_batch(batch: int, queries: int, keys: int) -> int:
        new = batch * queries
        out = new * (2 * s.hidden_size + 2 * q + 2 * kv) * itemsize
        if not host_attention:
            out += (batch * keys * per_key * itemsize
                    + min(s.num_heads * new * keys, ATTENTION_SCORE_CHUNK) * (3 * 4 + itemsize))
        return out
    attention = max(one_batch(*b) for b in t.batches())
    moe = (t.tokens * (2 * s.num_experts * 4 + s.top_k * 12)
           + 3 * t.tokens * s.hidden_size * itemsize
           + 3 * min(t.tokens, PREFILL_EXPERT_CHUNK) * s.intermediate_size * itemsize
           + t.tokens * s.top_k * s.hidden_size * 4)
    shared = max(s.shared_intermediate_size, s.dense_intermediate_size)  # or a dense layer's MLP
    if shared:
        moe += t.tokens * s.hidden_size * itemsize + 3 * largest * shared * itemsize
    head = t.sequences * (s.vocab_size * 4 + s.hidden_size * itemsize)
    return base + max(attention, moe, head)


def widest_chunk(shape, itemsize: int, limit: int, decode_rows: int, bs: int, context: int,
                 batch: tuple, others: list, host_attention: bool = False, shared: int = 0) -> int:
    """The longest prefill chunk for a newcomer `batch` (rows, columns done, columns left)
    whose step stays within `limit` activation bytes beside `decode_rows` decode rows (in
    batches of bs over the whole `context`, a bound on how the engine holds them) and other
    newcomer batches (rows, chunk, columns done); 0 when not even one column fits. Every
    batch may also score `shared` keys of shared prompt segments (schedule/prefix.py) beside
    its own. The engine sizes its newcomers' chunks with it and the planner's replay of
    continuous batching does the same (planner.occupancy)."""
    context += shared
    decode = [(bs, 1, context)] * (decode_rows // bs) + ([(decode_rows % bs, 1, context)] if decode_rows % bs else [])
    rest = decode + [(r, c, shared + done + c) for r, c, done in others]
    rows, done, left = batch

    def fits(chunk: int) -> bool:
        step = Step.of_batches(rest + [(rows, chunk, shared + done + chunk)])
        return activation_bytes(shape, itemsize, step, host_attention) <= limit

    lo, hi = 0, left  # activations grow with the chunk: the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def planned_activations(shape, itemsize: int, bs: int, n: int, chunk: int, prompt_len: int, gen_len: int,
                        host_attention: bool = False) -> int:
    """The activation bytes a plan reserves: n batches of bs prompts of `prompt_len` tokens
    prefilled in chunks of `chunk`, or decoding at the end of `gen_len` more."""
    context, chunk = prompt_len + gen_len, max(1, min(chunk, prompt_len))
    return max(activation_bytes(shape, itemsize, Step.prefill(bs, n, chunk, context), host_attention),
               activation_bytes(shape, itemsize, Step.decode(bs, n, context), host_attention))


def chunk_within(shape, itemsize: int, limit: int, bs: int, n: int, chunk: int, context: int,
                 host_attention: bool = False) -> int:
    """The longest prefill chunk up to `chunk` whose step (n batches of bs prompts over
    `context` keys) takes at most `limit` activation bytes; 1 when none does. Rows that score
    more keys than the plan counted (shared prompt segments beside a long line of its own, a
    later window's longer prompts) are prefilled in shorter chunks instead of past the plan."""
    def fits(c: int) -> bool:
        return activation_bytes(shape, itemsize, Step.prefill(bs, n, c, context), host_attention) <= limit

    lo, hi = 1, max(1, chunk)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def continuous_step_limit(shape, itemsize: int, bs: int, n: int, chunk: int, context: int,
                          host_attention: bool = False) -> int:
    """The activations a continuous step may take: the first prefill step's, n batches of bs
    prompts in chunks of `chunk` over the window's longest `context` (what the plan reserved;
    with `host_attention`, keys and scores stay beside the host cache)."""
    return activation_bytes(shape, itemsize, Step.prefill(bs, n, min(chunk, context), context), host_attention)


def newcomer_chunks(shape, itemsize: int, bs: int, n: int, chunk: int, context: int, host_attention: bool = False,
                    shared: int = 0):
    """Continuous batching's rule for newcomers' chunks, `widest(batch, decode_rows, others,
    shared)` (`widest_chunk` within `continuous_step_limit`; `shared`: the keys of the shared
    prompt segments held when it is asked, which may grow after the limit was set with
    `shared`): the engine sizes its newcomers with it and the planner's replay
    (planner.occupancy) does the same."""
    limit = continuous_step_limit(shape, itemsize, bs, n, chunk, context + shared, host_attention)
    return lambda batch, decode_rows, others, shared_now=shared: widest_chunk(
        shape, itemsize, limit, decode_rows, bs, context, batch, others, host_attention, shared_now)


def staging_bytes(cost) -> int:
    """Host buffers of the disk window: the layer being computed and DISK_WINDOW_LAYERS ahead
    (each layer is staged before the current one is let go); on a CUDA device also the
    page-locked rings the disk reads cross the link through (execute/staging.StagedCopies)."""
    rings = STAGED_RINGS * STAGED_RING_BYTES if cost.profile.device == "cuda" else 0
    return (DISK_WINDOW_LAYERS + 1) * cost.layer_bytes() + rings


def host_ring_bytes(cost, host) -> int:
    """The page-locked rings every CUDA run holds in host memory, as the engine holds them
    (assemble.reserve_staging_rings): a step's small uploads and routing reads
    (STEP_RING_BYTES), and the ring host compute's results go up through
    (ACTIVATION_RING_BYTES) wherever `host` (planner.layer.Host) may compute."""
    if cost.profile.device != "cuda":
        return 0
    may = host.attention or host.experts != "off"
    return STEP_RING_BYTES + (ACTIVATION_RING_BYTES if may else 0)


def kv_staging_bytes(cost) -> int:
    """Host bytes the kv_load channel's staging ring takes where the KV cache is on the host of
    a CUDA device (assemble.reserve_staging_rings charges it)."""
    return KV_STAGING_BYTES if cost.profile.device == "cuda" else 0


def kv_buffer_bytes(cost, bs: int, context: int) -> int:
    """Device buffers for a KV cache kept on the host: KV_BUFFERS batches of one layer."""
    return int(KV_BUFFERS * bs * context * cost.kv_bytes_per_token_layer)


def chunk_candidates(prompt_len: int) -> list[int]:
    """Prefill chunk sizes tried, largest first: the whole prompt, then powers of two."""
    out, c = [prompt_len], 1
    while c < prompt_len:
        out.append(c)
        c *= 2
    return sorted(set(out), reverse=True)


def prefill_chunk(cost, bs: int, n: int, prompt_len: int, gen_len: int, device_budget: float,
                  rest: float, host_attention: bool = False) -> int:
    """The prefill chunk for a group: the whole prompt where its activations take at most
    PREFILL_SHARE of the device (or no more than a decode step's), else the largest power of
    two that does; and never so large that the activations plus `rest` (the rest of the
    minimum working set) exceed the budget. One token per chunk always qualifies."""
    s, b = cost.shape, cost.shape.dtype_bytes
    context = prompt_len + gen_len
    decode = activation_bytes(s, b, Step.decode(bs, n, context), host_attention)
    for c in chunk_candidates(prompt_len):
        act = activation_bytes(s, b, Step.prefill(bs, n, c, context), host_attention)
        if act <= max(decode, PREFILL_SHARE * device_budget) and act + rest <= device_budget:
            return c
    return 1


def working_set(cost, *, bs: int, n: int, prompt_len: int, gen_len: int, chunk: int, schedule: str,
                hot: int, buffers: str = "overlap", host_attention: bool = False) -> dict:
    """Device bytes needed besides resident weights and a device-resident KV cache, assuming
    every weight group is off the device (placement drops a group kind's buffer when the whole
    kind is resident). Packed experts' overlapping buffers are the expert pool's slots, each
    decoded beside its packed row, and its decode workspace (placement/pool.py). Keys: activations, decoded (dequantized copies), then the buffers:
    attention, gate, expert, head, kv (host-resident KV). With buffers="minimum" the buffer
    entries are what the pipeline holds at once; the caller takes their max, not their sum
    (attention and KV buffers are held together). With `host_attention` no KV comes to the
    device: no KV buffers, and no keys among the activations."""
    from planner.layer import expert_slots
    s, b = cost.shape, cost.shape.dtype_bytes
    context = prompt_len + gen_len
    act = planned_activations(s, b, bs, n, chunk, prompt_len, gen_len, host_attention)
    kv = 0 if host_attention else kv_buffer_bytes(cost, bs, context)
    if buffers == "minimum":
        return {"activations": act, "decoded": 0,
                "attention_buffers": cost.attention_bytes + cost.attention_decoded + cost.attention_workspace,
                "gate_buffers": cost.gate_bytes,
                "expert_buffers": cost.expert_bytes + cost.expert_decoded + cost.expert_workspace,
                "head_buffer": cost.head_bytes, "kv_buffers": kv,
                # a resident quantized group is still dequantized into a transient copy per use
                "attention_resident": cost.attention_decoded + cost.attention_workspace,
                "expert_resident": cost.expert_decoded + cost.expert_workspace}
    slots = expert_slots(schedule, s.num_experts, hot)
    experts = slots * cost.expert_bytes
    if cost.expert_decoded:  # packed experts land in the pool decoded, beside their packed rows
        experts += slots * cost.expert_decoded + decode_workspace(slots, cost.expert_decoded + cost.expert_workspace)
    return {"activations": act, "decoded": (cost.attention_decoded + cost.attention_workspace + cost.expert_decoded
                                            + cost.expert_workspace),
            "attention_buffers": 2 * cost.attention_bytes, "gate_buffers": 2 * cost.gate_bytes,
            "expert_buffers": experts,
            "head_buffer": cost.head_bytes, "kv_buffers": kv}


def decode_workspace(slots: int, decode_bytes: int) -> int:
    """Device bytes the expert pool keeps for decoding packed experts into its `slots`: the
    decoded copies and codec temporaries (`decode_bytes` an expert) of as many experts as one
    codec call takes, all of them up to DECODE_WORKSPACE_BYTES, at least one. Grows with the
    slots and with an expert's bytes, so a plan sized with the larger ones covers the run."""
    return min(slots * decode_bytes, max(decode_bytes, DECODE_WORKSPACE_BYTES))


def expert_pool_slots(ws: dict, buffers: str, resident: dict, free: float, expert_bytes: int, schedule: str,
                      num_experts: int, hot: int, decode_bytes: int = 0) -> int:
    """Slots of the device's one expert pool (placement/pool.py), held for the whole run: the
    expert buffers the working set `ws` counts (the schedule's `expert_slots` with "overlap"
    buffers, one with "minimum"), as many of them as fit in `free` (the device budget less
    resident weights and KV) once the rest of the working set is counted (its activations and
    other buffers; in "minimum" mode the largest of those, which the pool no longer shares).
    0 when not even one fits beside the rest: experts then land one at a time in copies of
    their own. Room beyond the working set stays free for what the engine sizes as it runs
    (newcomers' caches, shared prompt segments). Packed experts: `expert_bytes` is a slot's
    decoded and packed rows, and the pool's `decode_workspace` of `decode_bytes` fits beside."""
    from planner.layer import expert_slots
    if not expert_bytes:
        return 0
    room = free - device_need({**ws, "expert_buffers": 0}, buffers, resident)
    cap = 1 if buffers == "minimum" else expert_slots(schedule, num_experts, hot)
    lo, hi = 0, max(0, int(min(cap, room // expert_bytes)))  # free may be inf
    while lo < hi:  # the most slots whose decode workspace fits beside them (it grows with them)
        mid = (lo + hi + 1) // 2
        fits = mid * expert_bytes + (decode_workspace(mid, decode_bytes) if decode_bytes else 0) <= room
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def pool_slots_planned(cost, ws: dict, buffers: str, resident: dict, free: float, *, schedule: str,
                       hot: int) -> int:
    """The expert pool's slots the engine opens for a plan (`expert_pool_slots` in the cost
    model's sizes: a slot holds an expert, a packed one decoded beside its packed row); 0
    when every expert is resident."""
    if resident.get("expert"):
        return 0
    decode = cost.expert_decoded + cost.expert_workspace if cost.expert_decoded else 0
    return expert_pool_slots(ws, buffers, resident, free, cost.expert_bytes + cost.expert_decoded, schedule,
                             cost.shape.num_experts, hot, decode)


def newcomer_room(cost, free: float, resident: dict, minimum: dict, slots: int) -> float:
    """Device bytes continuous batching's newcomer caches can take at once beside a plan: the
    engine makes each one's room by evicting transient groups, keeping free what a step needs
    (its activations and the largest group it fetches; schedule/batching.py). So: `free` (the
    budget less resident weights and the group's KV caches) less the expert pool of `slots`
    (held for the run) and the rest of the working set at its `minimum` (buffers="minimum")."""
    decode = cost.expert_decoded + cost.expert_workspace if cost.expert_decoded else 0
    pool = slots * (cost.expert_bytes + cost.expert_decoded) + (decode_workspace(slots, decode) if decode and slots else 0)
    rest = device_need({**minimum, "expert_buffers": 0} if slots else minimum, "minimum", resident)
    return max(0.0, free - pool - rest)


BUFFER_KINDS = ("attention", "gate", "expert", "head", "kv")


def buffer_key(kind: str) -> str:
    return "head_buffer" if kind == "head" else f"{kind}_buffers"


def device_need(ws: dict, buffers: str, resident: dict | None = None) -> float:
    """Total device bytes of a working set `ws`, without the buffers of kinds that are wholly
    resident (`resident` maps a kind of BUFFER_KINDS to True)."""
    r = resident or {}

    def keep(kind):
        if r.get(kind):
            return ws.get(f"{kind}_resident", 0) if buffers == "minimum" else 0
        return ws[buffer_key(kind)]
    if buffers == "minimum":
        weights = max(keep("attention") + keep("kv"), keep("gate"), keep("expert"), keep("head"))
        return ws["activations"] + weights
    return ws["activations"] + ws["decoded"] + sum(keep(k) for k in BUFFER_KINDS)
