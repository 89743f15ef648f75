"""Engine: the Python API. Opens a checkpoint, turns requests into sequences, runs batch
groups through the pipeline step by step, samples, stops, and hands finished sequences back.

    engine = Engine(RunConfig(model="tiny-mixtral"))
    for seq in engine.run(engine.prepare(requests)[0]):
        print(seq.request.id, seq.text)
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from klotski.channels import make_channels, pin
from klotski.config import RunConfig
from klotski.kvcache import BatchKV
from klotski.models import registry
from klotski.models.spec import DTYPES, ModelSpec
from klotski.pipeline import Pipeline, StepInput
from klotski.prefetch import CorrelationPredictor, FrequencyPredictor, NextGatePredictor
from klotski.trace import Trace
from placement.cache import DISK_TO_HOST, WeightCache
from placement.plan import Placement
from placement.store import TensorStore
from placement.tiers import HOST, DeviceMemory, detect_budgets


@dataclass
class Sequence:
    request: object            # klotski.jobs.Request
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Stats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_disk_bytes: int = 0  # read from disk while decode steps ran: the bigger-than-RAM bound


class Engine:
    def __init__(self, config: RunConfig, placement: Placement | None = None, predictor=None):
        self.config = config
        self.model_dir = registry.resolve(config.model)
        self.store = TensorStore(self.model_dir, direct=config.direct_io)
        self.spec = ModelSpec.from_dir(self.model_dir, self.store.names())
        self.store.validate(self.spec.expected_shapes())
        self.dtype = self.spec.dtype if config.dtype == "auto" else DTYPES[config.dtype]
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.device = _device(config.device)
        self.budgets = detect_budgets(self.device.type, config.device_memory, config.host_memory)
        self.memory = DeviceMemory(self.budgets.device)
        self.trace = Trace(keep_events=bool(config.trace))
        self.channels = make_channels(self.device, self.trace, config.emulate_link_gbps)
        self.placement = placement
        self.predictor = predictor
        self.batch_size = config.batch_size or 8
        self.num_batches = 1 if config.schedule == "simple" else (config.num_batches or 1)
        self.plan = None
        self.pipeline: Pipeline | None = None
        self.stats = Stats()

    def _start(self, seqs: list[Sequence]) -> None:
        """Decide placement (now that the longest sequence is known) and fill the tiers."""
        spec = self.spec
        if self.config.num_batches is None or self.config.batch_size is None or self.placement is None:
            self._plan(seqs)
        codec = None
        if self.config.quantize == "hqq4":
            from klotski.quantized import QuantCodec, ensure_quantized
            qdir = ensure_quantized(self.store, spec, self.model_dir, self.config.offload_dir, self.dtype,
                                    optimize=self.config.quantize_optimize)
            codec = QuantCodec(qdir, self.dtype)
        self.cache = WeightCache(self.store, self.placement, spec.group_refs, self.dtype, self.memory,
                                 to_device=lambda t: t.to(self.device), pin=lambda t: pin(t, self.device),
                                 disk_channel=self.channels["disk"], codec=codec)
        if self.predictor is None:
            self.predictor = self._make_predictor()
        self.pipeline = Pipeline(spec, self.cache, self.channels, self.config, self.trace, self.predictor,
                                 self.memory, self.device)

    def _plan(self, seqs) -> None:
        """Ask the planner for bs, n (those the user left to it) and the placement."""
        import dataclasses

        from klotski import errors, planning
        # plan in the compute dtype: that is what sits on the device and crosses the links
        shape = dataclasses.replace(planning.as_shape(self.spec), dtype=str(self.dtype).removeprefix("torch."))
        profile = planning.profile_for("auto", shape, device=self.device.type,
                                       link_gbps=self.config.emulate_link_gbps)
        # Time is planned for the typical request (batches are formed by length, so padding is
        # small), memory for the worst: the device budget handed to the planner leaves room for
        # the extra attention scores of the longest prompt's prefill.
        lengths = sorted(len(s.prompt_ids) for s in seqs)
        typical, longest = -(-sum(lengths) // len(lengths)), lengths[-1]

        def extra(bs):
            return (planning.activation_bytes(shape, self.dtype.itemsize, tokens=bs * longest,
                                              scores=bs * longest * longest, sequences=bs)
                    - planning.activation_bytes(shape, self.dtype.itemsize, tokens=bs * typical,
                                                scores=bs * typical * typical, sequences=bs))

        def solve(device_memory, prompt_len):
            return planning.make_plan(
                shape, profile, device_memory=device_memory, host_memory=self.budgets.host, prompt_len=prompt_len,
                gen_len=max(s.max_new_tokens for s in seqs), config=self.config, sequences=len(seqs))

        self.plan = solve(self.budgets.device, typical)
        if extra(self.plan.batch_size) > 0:
            try:
                self.plan = solve(self.budgets.device - extra(self.plan.batch_size), typical)
            except errors.USER_ERRORS:  # too tight for that: plan everything for the longest prompt
                self.plan = solve(self.budgets.device, longest)
        self.batch_size = self.config.batch_size or self.plan.batch_size
        if self.config.schedule != "simple":
            self.num_batches = self.config.num_batches or self.plan.num_batches
        if self.placement is None:
            self.placement = planning.engine_placement(self.plan, self.spec)

    def _make_predictor(self):
        spec, how = self.spec, self.config.prefetch
        if how == "correlation":
            from klotski.correlate import load_or_build
            return CorrelationPredictor(load_or_build(self))
        if how == "next-gate":
            return NextGatePredictor(spec.num_layers, spec.num_experts)
        return FrequencyPredictor(spec.num_layers, spec.num_experts)

    # ---- requests -> sequences ----------------------------------------------------------
    def prepare(self, requests):
        """Tokenize; return (sequences, line errors) — a prompt too long is a line error."""
        from klotski.jobs import LineError, prompt_too_long
        seqs, errors = [], []
        ctx = self.spec.max_position_embeddings
        for req in requests:
            try:
                ids = self._tokenize(req)
            except Exception as e:  # a chat template can reject a conversation
                errors.append(LineError(req.id, req.line, f"cannot tokenize: {e}"))
                continue
            if len(ids) >= ctx:
                errors.append(prompt_too_long(req, len(ids), ctx))
                continue
            if not ids:
                errors.append(LineError(req.id, req.line, "prompt is empty after tokenization"))
                continue
            seqs.append(self._sequence(req, ids, ctx))
        return seqs, errors

    def _tokenize(self, req) -> list[int]:
        if req.messages is not None:
            out = self.tokenizer.apply_chat_template(req.chat_messages(), add_generation_prompt=True,
                                                     tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return list(self.tokenizer(req.prompt)["input_ids"])

    def _sequence(self, req, ids, ctx) -> Sequence:
        c = self.config
        temperature = c.temperature if req.temperature is None else req.temperature
        gen = None
        if temperature > 0:
            seed = req.seed if req.seed is not None else _stable_seed(c.seed, req.id)
            gen = torch.Generator().manual_seed(seed)
        max_new = min(req.max_new_tokens or c.max_new_tokens, ctx - len(ids))
        return Sequence(req, ids, max_new, temperature, c.top_p if req.top_p is None else req.top_p,
                        tuple(req.stop), gen)

    # ---- generation ---------------------------------------------------------------------
    def groups(self, seqs: list[Sequence]) -> list[list[list[Sequence]]]:
        """Longest prompts first, so each batch pads little; then n batches of bs per group."""
        bs, n = self.batch_size, self.num_batches
        order = sorted(seqs, key=lambda s: -len(s.prompt_ids))
        batches = [order[i:i + bs] for i in range(0, len(order), bs)]
        return [batches[i:i + n] for i in range(0, len(batches), n)]

    def run(self, seqs: list[Sequence]):
        """Generate for every sequence; yield each one as soon as it finishes."""
        if not seqs:
            return
        if self.pipeline is None:
            self._start(seqs)
        for group in self.groups(seqs):
            yield from self._run_group(group)

    def _run_group(self, group: list[list[Sequence]]):
        spec = self.spec
        prompt_len = [max(len(s.prompt_ids) for s in b) for b in group]
        on_host = self.placement.kv == HOST
        kvs = [BatchKV(spec.num_layers, len(b), spec.num_kv_heads, spec.head_dim,
                       p + max(s.max_new_tokens for s in b), self.dtype, device=self.device, on_host=on_host,
                       pin=lambda t: pin(t, self.device)) for b, p in zip(group, prompt_len)]
        kv_device = 0 if on_host else sum(kv.nbytes() for kv in kvs)
        self.pipeline.make_room(kv_device, "KV cache")
        self.memory.reserve(kv_device, "KV cache")
        try:
            yield from self._steps(group, kvs, prompt_len)
        finally:
            self.memory.free(kv_device)

    def _steps(self, group, kvs, prompt_len):
        """Prefill, then decode until every sequence is done; a batch whose sequences are all
        done leaves the group's steps (its KV cache was sized for its own longest request)."""
        inputs = {k: _prefill_input(b, p, self._pad_id()) for k, (b, p) in enumerate(zip(group, prompt_len))}
        next_pos = {k: inp.positions[:, -1] + 1 for k, inp in inputs.items()}
        self.stats.prompt_tokens += sum(len(s.prompt_ids) for b in group for s in b)
        prefill = True
        while inputs:
            active = list(inputs)
            t0, disk0 = time.perf_counter(), self.trace.bytes[DISK_TO_HOST]
            logits = self.pipeline.forward([kvs[k] for k in active], [inputs[k] for k in active])
            elapsed = time.perf_counter() - t0
            if prefill:
                self.stats.prefill_s += elapsed
            else:
                self.stats.decode_s += elapsed
                self.stats.decode_disk_bytes += self.trace.bytes[DISK_TO_HOST] - disk0
            prefill = False
            inputs = {}
            for k, lg in zip(active, logits):
                batch = group[k]
                tokens = self._pick(batch, lg)
                for s, t in zip(batch, tokens):
                    if not s.done:
                        self._append(s, t)
                        if s.done:
                            yield s
                if not all(s.done for s in batch):
                    ids = torch.tensor(tokens, dtype=torch.long)[:, None]
                    inputs[k] = StepInput(ids, torch.ones_like(ids, dtype=torch.bool), next_pos[k][:, None].clone())
                    next_pos[k] += 1

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else next(iter(self.eos), 0)

    def _pick(self, batch: list[Sequence], logits: torch.Tensor) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        return [g if s.done or s.generator is None else _sample(lg, s.temperature, s.top_p, s.generator)
                for s, g, lg in zip(batch, greedy, logits)]

    def _append(self, s: Sequence, token: int) -> None:
        self.stats.generated_tokens += 1
        if token in self.eos:
            s.finish_reason = "stop"
        else:
            s.out.append(token)
            if s.stop:
                text = self.tokenizer.decode(s.out, skip_special_tokens=True)
                cut = min((i for i in (text.find(x) for x in s.stop) if i >= 0), default=-1)
                if cut >= 0:
                    s.text, s.finish_reason = text[:cut], "stop"
                    return
            if len(s.out) >= s.max_new_tokens:
                s.finish_reason = "length"
        if s.done:
            s.text = self.tokenizer.decode(s.out, skip_special_tokens=True)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.store.close()

    def record(self, s: Sequence) -> dict:
        rec = {"id": s.request.id, "completion": s.text, "finish_reason": s.finish_reason,
               "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.out)}
        if self.config.include_token_ids:
            rec["token_ids"] = list(s.out)
        return rec


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _prefill_input(batch: list[Sequence], length: int, pad: int) -> StepInput:
    """Left-pad prompts to `length`; positions count real tokens only (cumsum(mask) - 1)."""
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    valid = torch.zeros((len(batch), length), dtype=torch.bool)
    for i, s in enumerate(batch):
        ids[i, length - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        valid[i, length - len(s.prompt_ids):] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return StepInput(ids, valid, positions)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def _stable_seed(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
