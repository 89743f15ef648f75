"""RunConfig: every knob of a run in one frozen dataclass.

The CLI fills it, the engine and pipeline read it, the run report echoes it. No other
module reads flags or environment variables for behaviour.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from klotski.errors import ConfigError
from klotski.util import dtypes
from planner import units

SCHEDULES = ("klotski", "hot-prefetch", "multibatch", "simple")
BATCHINGS = ("continuous", "static")
ORDERS = ("length", "routing")  # --order: how a window's lines wait (schedule/batching.py)
PREFETCH = ("correlation", "next-gate", "pregate", "none")
DTYPES = ("auto", *sorted(dtypes.NAMES))
OUTPUT_FORMATS = ("auto", "klotski", "openai")
HOST_COMPUTE = ("auto", "on", "off")  # --host-attention, --host-experts
EXPERT_SPLITS = ("dp", "even")  # --expert-split



def parse_size(text: str) -> int:
    """'20GiB' -> 21474836480, '512MB' -> 512000000, '1024' -> 1024 bytes."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _sparse(attention: str) -> tuple[int | None, int | None]:
    """'full' -> (None, None); 'sink:4,window:1020' -> (4, 1020)."""
    if attention == "full":
        return None, None
    m = re.fullmatch(r"sink:(\d+),window:(\d+)", attention.replace(" ", ""))
    if not m or int(m.group(2)) < 1:
        raise ConfigError(f"--attention {attention!r}: use 'full' or 'sink:S,window:W' (e.g. sink:4,window:1020)")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny-mixtral"
    max_new_tokens: int = 32
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    batch_size: int | None = None     # None = planner's choice (or 8 without a planner)
    num_batches: int | None = None    # None = "auto"
    prefill_chunk: int | None = None  # prompt tokens per prefill pass; None = the planner's choice
    device_memory: int | None = None  # bytes; None = detected
    host_memory: int | None = None
    offload_dir: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    schedule: str = "klotski"
    batching: str = "continuous"      # a finished sequence's row takes the next prompt (static: kept to the end)
    # a window's lines wait longest first ("length"), or in groups of n x bs of similar routing,
    # longest first within ("routing": schedule/routing_order.py)
    order: str = "length"
    prefetch: str = "correlation"
    # with --prefetch pregate: also run next-gate speculation beside it and score both on the same
    # layer-steps (the report's prefetch.alongside); off, the pre-gate's tokens/s is its own
    prefetch_compare: bool = False
    hot_experts: int | None = None    # K; None = the model's top-k
    attention: str = "full"           # or "sink:S,window:W" (StreamingLLM-style KV sparsity)
    quantize: str = "none"            # none | hqq4 | auto (the planner weighs precision: planner/precision.py)
    quantize_optimize: bool = False   # HQQ's half-quadratic optimisation (slow on CPU)
    # the quality --quantize auto may cost, as measured (precision_quality.json); None: no bound
    quality_max_gap: float | None = None        # largest mean log-prob gap, nats/token
    quality_min_agreement: float | None = None  # smallest greedy agreement with the reference, 0..1
    emulate_link_gbps: float | None = None
    # a speculative prefetch yields the host->device link to a demand load at its next chunk
    # boundary, a chunk being this many ms of the link (execute/channels.py); 0: whole transfers,
    # first come first served (the ablation); None: DEFAULT_CHUNK_MS on an emulated link, whole
    # transfers on CUDA (its chunked copies are not yet measured on a GPU)
    transfer_chunk_ms: float | None = None
    # the device's resident experts divided among layers: "dp" by the transfers each layer's would
    # save a step (a dynamic program over the learned routing: placement/split.py), "even" (the ablation)
    expert_split: str = "dp"
    # --adaptive-gating A (AdapMoE): a token whose top-1 gate weight dominates skips its other
    # experts, per-layer thresholds calibrated on the first group so that at least A of its greedy
    # tokens equal exact top-k's (klotski/schedule/gating.py); None: exact top-k (the default)
    adaptive_gating: float | None = None
    # Attention where a host KV cache lives / cold experts where they live (klotski/execute/hostcompute.py):
    # auto = the cost model decides per layer and step from the run's profile; off by default, as
    # on a CPU-only machine the host is the device and auto would turn every emulated-link run
    # into host compute.
    host_attention: str = "off"
    host_experts: str = "off"
    # a CPU run's GGUF experts decoded once into the compute dtype and kept in host RAM (charged to
    # the host budget) where that is faster and fits: auto (klotski/planning.decoded_copies) or off
    # (blocks decoded per use, or the int4 kernel); setup_run resolves auto to on or off
    decoded_copies: str = "auto"
    # a CPU's bf16 resident SwiGLU experts and projections (Family.LINEAR_WEIGHTS) reordered once
    # into oneDNN's layout (the same bytes, bit for bit the same products: klotski/models/prepacked.py)
    # where this torch has it (auto), or held as read (off)
    reordered_weights: str = "auto"
    direct_io: bool = True
    threads: int | None = None        # CPU compute threads; None = the cores free now, looked at again as it runs
    prefix_cache: bool = True         # a prompt prefix a window's lines share is prefilled once (schedule/prefix.py)
    resume: bool = True
    include_token_ids: bool = False
    output_format: str = "auto"       # auto: each output line in its input line's form
    report: str | None = None
    trace: str | None = None
    # one step in this many (per phase) has its spans timed (execute/trace.py: the busy seconds
    # and bubble are estimated from those); 1 = every step, as a --trace run does
    time_every: int = 8
    progress: bool = True
    window: int = 4096                # job lines read, tokenized and ordered together (memory holds one window)
    ray: str | None = None            # --ray: a Ray cluster's address ("auto" joins, "local" starts one); None = no Ray
    workers: int | None = None        # Ray actors (engines); None = one per GPU, else one per node
    shard: int = 512                  # job lines handed to a Ray actor at a time (the unit rerun if it dies)
    prompt_field: str = "prompt"      # a dataset input's columns (klotski/io/dataset_files.py)
    messages_field: str = "messages"
    id_field: str = "id"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.batching not in BATCHINGS:
            raise ConfigError(f"--batching {self.batching!r}: choose one of {', '.join(BATCHINGS)}")
        if self.order not in ORDERS:
            raise ConfigError(f"--order {self.order!r}: choose one of {', '.join(ORDERS)}")
        if self.prefetch not in PREFETCH:
            raise ConfigError(f"--prefetch {self.prefetch!r}: choose one of {', '.join(PREFETCH)}")
        if self.prefetch_compare and self.prefetch != "pregate":
            raise ConfigError("--prefetch-compare scores next-gate speculation beside the pre-gate: "
                              "add --prefetch pregate, or drop --prefetch-compare")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens must be at least 1")
        if self.temperature < 0:
            raise ConfigError("--temperature must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.output_format not in OUTPUT_FORMATS:
            raise ConfigError(f"--output-format {self.output_format!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
        for name in ("batch_size", "num_batches", "prefill_chunk", "window", "workers", "shard", "time_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.ray is None and self.workers is not None:
            raise ConfigError("--workers sets the number of Ray actors; it needs --ray (e.g. --ray local --workers 2)")
        _sparse(self.attention)
        for name in ("host_attention", "host_experts"):
            if getattr(self, name) not in HOST_COMPUTE:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose one of "
                                  f"{', '.join(HOST_COMPUTE)}")
        if self.decoded_copies not in ("auto", "on", "off"):
            raise ConfigError(f"--decoded-copies {self.decoded_copies!r}: choose auto or off")
        if self.reordered_weights not in ("auto", "off"):
            raise ConfigError(f"--reordered-weights {self.reordered_weights!r}: choose auto or off")
        if self.quantize not in ("none", "hqq4", "auto"):
            raise ConfigError(f"--quantize {self.quantize!r}: choose none, hqq4 or auto")
        if self.quality_max_gap is not None and not self.quality_max_gap >= 0:
            raise ConfigError("--max-logprob-gap must be a gap in nats/token, 0 or more (e.g. 0.05)")
        if self.quality_min_agreement is not None and not 0 <= self.quality_min_agreement <= 1:
            raise ConfigError("--min-agreement must be a share in [0, 1] (e.g. 0.95)")
        if self.emulate_link_gbps is not None and self.emulate_link_gbps <= 0:
            raise ConfigError("--emulate-link must be a positive bandwidth in GB/s")
        if self.transfer_chunk_ms is not None and not self.transfer_chunk_ms >= 0:
            raise ConfigError("--transfer-chunk-ms must be 0 (whole transfers) or more (e.g. 0.25)")
        if self.expert_split not in EXPERT_SPLITS:
            raise ConfigError(f"--expert-split {self.expert_split!r}: choose one of {', '.join(EXPERT_SPLITS)}")
        if self.adaptive_gating is not None and not 0 <= self.adaptive_gating <= 1:
            raise ConfigError(f"--adaptive-gating {self.adaptive_gating}: the greedy agreement with exact top-k "
                              "the thresholds must keep, a share in [0, 1] (e.g. 0.95)")
        if self.adaptive_gating is not None and self.ray is not None:
            raise ConfigError("--adaptive-gating calibrates on one engine's first group; it does not run with --ray yet")

    @property
    def attention_sink(self) -> int | None:
        return _sparse(self.attention)[0]

    @property
    def attention_recent(self) -> int | None:
        return _sparse(self.attention)[1]

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
