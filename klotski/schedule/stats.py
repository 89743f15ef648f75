"""The engine's numbers for the run report: seconds, tokens and rows, counted step by step
by both batching schedules (klotski/schedule/engine.py, klotski/schedule/batching.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeRows:
    """The rows a decode step computed, those whose sequence was still generating, the rows
    the group has, and the prompt tokens prefilled inside the step (continuous batching)."""
    computed: int
    useful: int
    slots: int
    prompt_tokens: int = 0


@dataclass
class Stats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_passes: int = 0     # forward steps that carried prompt tokens (more than one per group when chunked)
    decode_disk_bytes: int = 0  # read from disk while decode steps ran: the bigger-than-RAM bound
    decode_rows: int = 0        # sequence slots computed by decode steps
    decode_useful_rows: int = 0  # of those, slots whose sequence was still generating
    decode_slots: int = 0       # rows the group has (n x bs, fewer in a job's last static group), per decode step
    refills: int = 0            # continuous batching: sequences that took a row another had finished in
    kv_realigns: int = 0        # continuous batching: times a cache's slots were moved to make room
    rows_moved: int = 0         # continuous batching: live rows moved at the end, out of free rows' way
    decode_prompt_tokens: int = 0  # continuous batching: prompt tokens prefilled by steps that also decode
    prefill_tokens: int = 0     # real prompt tokens computed by prefill-only steps (a shared prefix once)
    decode_steps: int = 0
    decode_kv_bytes: int = 0    # KV bytes loaded host->device by decode steps (the KV on the host)
    prefix_tokens: int = 0      # the longest chain of shared segments a line started from (schedule/prefix.py)
    prefix_prefills: int = 0    # times a shared segment was prefilled (once each unless windows differ)
    prefix_lines: int = 0       # lines started from shared segments
    prefix_tokens_saved: int = 0  # prompt tokens not prefilled thanks to them (their own prefills deducted)
    # per segment (by Segment.key): [start, tokens, lines that started from it, times prefilled]
    prefixes: dict = field(default_factory=dict)

    def record_prompts(self, seqs) -> None:
        """Prompt tokens of sequences whose prefill starts."""
        self.prompt_tokens += sum(len(s.prompt_ids) for s in seqs)

    def record_step(self, seconds: float, disk_bytes: int, *, prompt: bool, decode: DecodeRows | None,
                    tokens: int = 0, kv_bytes: int = 0) -> None:
        """One forward step: `prompt`, it carried prompt tokens; `decode`, it decoded (its time
        is decode time, prompt tokens riding along included), else its time is prefill time
        and `tokens` the real prompt tokens it computed; `kv_bytes`, KV it loaded."""
        if decode is None:
            self.prefill_s += seconds
            self.prefill_tokens += tokens
        else:
            self.decode_s += seconds
            self.decode_steps += 1
            self.decode_kv_bytes += kv_bytes
            self.decode_disk_bytes += disk_bytes
            self.decode_rows += decode.computed
            self.decode_useful_rows += decode.useful
            self.decode_slots += decode.slots
            self.decode_prompt_tokens += decode.prompt_tokens
        if prompt:
            self.prefill_passes += 1

    @property
    def slot_utilisation(self) -> float | None:
        """Useful share of decode work: a static batch computes every slot until its longest
        sequence ends, so finished sequences' slots are work for nothing."""
        return self.decode_useful_rows / self.decode_rows if self.decode_rows else None

    @property
    def occupancy(self) -> float | None:
        """Useful share of the group's rows over decode steps: continuous batching computes
        live rows only (utilisation 1), so what idle rows cost shows here, as tokens a step
        could have made but did not (rows waiting for a newcomer's prefill, the drain)."""
        return self.decode_useful_rows / self.decode_slots if self.decode_slots else None
