"""Shared by the benchmark scripts: the job subset they run, how a run is launched, and the
sizing of the disk regime (`klotski bench --preset disk`) to the machine it runs on."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_jobs(source: str | Path, count: int, out: Path) -> Path:
    """The first `count` prompts of `source`, ids and prompts only, so every run generates the
    same number of tokens per prompt (the run's --max-new-tokens)."""
    lines = Path(source).read_text().splitlines()[:count]
    out.write_text("".join(json.dumps({"id": json.loads(l)["id"], "prompt": json.loads(l)["prompt"]}) + "\n"
                           for l in lines))
    return out


def generate(jobs: Path, report: Path, args: list[str]) -> dict:
    """`klotski generate` in its own process; returns its run report."""
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "-o", str(report.with_suffix(".out.jsonl")),
           "--no-resume", "--no-progress", "--report", str(report)] + args
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return json.loads(report.read_text())


# --------------------------------------------------------------------------- the disk regime, sized

# `klotski bench --preset disk`: a model at least twice the memory every process may use (a
# memory cgroup, page cache included) and at most half the free disk (accelerate's offload
# folder needs about as much again), with a job whose compute stays well under the time the
# disk takes to stream the weights, so the run measures the disk and not the CPU.
# Layer shapes, largest first: Mixtral-8x7B's layer, half its width, the medium preset's.
# The number of layers is what the sizing chooses. float32 throughout: per byte read it is
# half the compute of bfloat16 (which CPUs without AVX-512 BF16 or AMX also emulate slowly),
# and greedy tokens can be compared with transformers' exactly.
DISK_SHAPES = {
    "xl": ("xl", {}),
    "large": ("xl", dict(hidden_size=2048, intermediate_size=7168, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=128)),
    "medium": ("medium", {}),
}
DISK_DTYPE = "float32"
RUNTIME_ALLOWANCE = 2 << 30   # as klotski/bench/driver.py's (--memory-limit auto): outside both budgets
RAM_SHARE = 0.75              # the memory limit leaves the rest of RAM to the driver and the OS
COMPUTE_SHARE = 0.5           # a decode step's compute (the whole group, as the profile times it) / one read
PREFILL_READS = 4.0           # prefill compute, in reads of the weights
DECODE_READ_S = 60.0          # decode steps enough to stream the weights for about this long
MAX_PROMPTS, MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 64, 8, 64
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 4, 16
PROMPT_SLACK = 4              # tokens a truncated prompt may gain when tokenized again (special tokens)
STARTUP_S = 60.0              # a process's start, profile and table, in the time estimate
MMAP_READ_FACTOR = 1.5        # accelerate's page faults against streamed O_DIRECT reads, in the estimate


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the sizing needs to know about the machine (klotski/bench/driver.py probes it)."""
    free_disk_bytes: int
    ram_bytes: int
    cores: int
    disk_gbps: float      # sequential O_DIRECT read, GB/s
    core_gflops: float    # float32 matrix multiply, one thread
    load: float = 0.0     # 1-minute load average: cores busy with other work


class DiskRegimeRefused(ValueError):
    """The machine cannot hold the disk regime; the message (one line) says what it needs."""


def disk_shape(name: str, layers: int):
    """(planner ModelShape, MixtralConfig fields to build it with) of rung `name` at `layers` layers."""
    from klotski.builtin.tiny import PRESETS
    from planner.shapes import ModelShape
    base, overrides = DISK_SHAPES[name]
    fields = {**overrides, "num_hidden_layers": layers}
    cfg = {**PRESETS[base], **fields, "dtype": DISK_DTYPE, "model_type": "mixtral"}
    return ModelShape.from_config(cfg, name=f"disk-{name}"), fields


def model_bytes(shape) -> int:
    from planner.shapes import total_params
    return total_params(shape) * shape.dtype_bytes


def active_params(shape) -> int:
    """Weights one token multiplies with: attention, router, top-k experts per layer, and the head."""
    per_layer = shape.attention_params + shape.gate_params + shape.top_k * shape.expert_params
    return shape.num_layers * per_layer + shape.vocab_size * shape.hidden_size


def _feasibility_cost(shape, sizes=None):
    """A cost model with the planner's sizes (the shape's, or a checkpoint's exact `sizes`); its
    rates are placeholders, as whether a plan fits (planner.place.place_greedy) depends on bytes
    alone."""
    from planner.costmodel import CostModel
    from planner.profile import Profile
    return CostModel(Profile(name="disk-sizing", flops=1e11, mem_bw=1e10, device="cpu",
                             links={"disk_to_host": 1e9, "host_to_device": 1e10, "device_to_host": 1e10}),
                     shape, sizes=sizes)


def plan_at(shape, device: float, host: float, *, bs: int, prompts: int, prompt_len: int, gen_len: int,
            num_batches: int | None = None, chunk: int | None = None, sizes=None):
    """The planner's answer for this job at these budgets (planner.solve.solve), or its refusal."""
    from planner.solve import Budgets, Infeasible, solve
    try:
        return solve(shape, _feasibility_cost(shape, sizes), Budgets(device, host), prompt_len=prompt_len,
                     gen_len=gen_len, batch_sizes=(bs,), max_sequences=prompts, num_batches=num_batches,
                     chunk=chunk)
    except Infeasible as e:
        return e


def planned_budgets(shape, *, bs: int, prompts: int, prompt_len: int, gen_len: int) -> tuple[int, int]:
    """The smallest (device, host) budgets the planner accepts for a job of `prompts` prompts of
    up to `prompt_len` tokens, all in one group, prefilled in one pass: the device minimum is
    the planner's refusal with the host unlimited (planner.infeasible.diagnose), raised until
    the planner's own prefill chunk is the whole prompt (a shorter chunk streams every weight
    once more per chunk) and its transfer buffers overlap (at their minimum, experts were
    read from disk 1.7x per decode step: 15.9 GB a step of an 8.74 GB model, measured); the
    host minimum is its refusal at that device budget. Each gets a
    margin for the checkpoint's exact group sizes, which the engine plans with, and is rounded
    up to whole MiB (as the flags will say)."""
    from planner.solve import Infeasible
    n = max(1, prompts // bs)
    job = dict(bs=bs, prompts=prompts, prompt_len=prompt_len, gen_len=gen_len)
    roomy = 4.0 * model_bytes(shape)  # finite: the placement MILP takes no infinite budget
    refused = plan_at(shape, 1.0, roomy, num_batches=n, chunk=prompt_len, **job)
    device = refused.needed if isinstance(refused, Infeasible) else 1.0
    for _ in range(40):
        plan = plan_at(shape, device, roomy, num_batches=n, **job)
        if not isinstance(plan, Infeasible) and plan.prefill_chunk >= prompt_len and plan.buffers == "overlap":
            break
        device *= 1.2
    refused = plan_at(shape, device, 1.0, num_batches=n, **job)
    host = refused.needed if isinstance(refused, Infeasible) else 1.0
    mib = lambda x: math.ceil(x / 2**20) << 20
    return mib(device * 1.05 + (32 << 20)), mib(host * 1.05 + (64 << 20))


# A compute model: seconds for one pass over the whole model of `n` batches of `bs` rows with
# `tokens` new tokens each (decode: 1) at context `ctx`.
def gemm_compute(m: Machine, threads: int):
    """The matrix-multiply rate alone (2 FLOP per weight per token): a lower bound on the time,
    as if every op ran at the probe's rate."""
    flops = m.core_gflops * 1e9 * threads
    return lambda shape, bs, n, tokens, ctx: 2.0 * active_params(shape) * n * bs * tokens / flops


def planner_compute(profile, layer_shape):
    """The planner's cost model of the engine's own ops, timed on this machine (a profile
    measured for `layer_shape`: its per-layer op times hold for any layer count of it):
    attention, router, the experts a pass hits and the head, and the pipeline's own cost."""
    from planner.costmodel import CostModel
    from planner.waves import resident_calls
    cost = CostModel(profile, layer_shape)

    def compute_s(shape, bs, n, tokens, ctx):
        E, k, L = shape.num_experts, shape.top_k, shape.num_layers
        rows = n * bs * tokens
        hit = min(E, rows * k)  # experts a layer runs: all of them once a pass has E/k tokens
        attn = cost.t_attn(bs, ctx) if tokens == 1 else cost.t_attn(bs, ctx, tokens)
        # the experts in waves, as the engine computes them resident (planner/waves.py)
        layer = n * (attn + cost.t_gate(bs * tokens)) + cost.t_wave(hit, rows * k, resident_calls(rows, k, E))
        return (L * layer + n * cost.t_head(bs)
                + cost.t_pipeline(batch_layers=n * L, expert_calls=hit * L, steps=1, tokens=rows * L))
    return compute_s


def _compute_job(shape, read_s: float, compute_s, bs: int) -> tuple[int, int, int]:
    """(prompts, prompt tokens, new tokens) whose compute stays under the reads of the weights:
    the largest group whose decode step computes in COMPUTE_SHARE of a read, the longest prompt
    a full group prefills in PREFILL_READS reads (so it shrinks with the compute as the group
    does), and decode steps enough to read the weights for DECODE_READ_S."""
    ctx = MIN_PROMPT_TOKENS + MAX_NEW_TOKENS
    prompts = next((p for p in range(MAX_PROMPTS // bs * bs, bs, -bs)
                    if compute_s(shape, bs, p // bs, 1, ctx) <= COMPUTE_SHARE * read_s), bs)
    tokens = next((t for t in range(MAX_PROMPT_TOKENS, MIN_PROMPT_TOKENS, -1)
                   if compute_s(shape, bs, MAX_PROMPTS // bs, t, t) <= PREFILL_READS * read_s), MIN_PROMPT_TOKENS)
    new = max(MIN_NEW_TOKENS, min(MAX_NEW_TOKENS, 1 + math.ceil(DECODE_READ_S / read_s)))
    return prompts, tokens, new


def estimate_s(shape, read_s: float, compute_s, *, bs: int, prompts: int, prompt_tokens: int,
               new_tokens: int) -> dict:
    """Rough seconds per system: a pass over the weights takes the longer of reading and
    computing them; Klotski runs twice (a planning warm-up, one measured run) with every prompt
    in one group, accelerate once on one batch after copying the offloaded weights."""
    ctx = prompt_tokens + new_tokens

    def run(n: int, read: float) -> float:
        return (STARTUP_S + max(read, compute_s(shape, bs, n, prompt_tokens, prompt_tokens))
                + (new_tokens - 1) * max(read, compute_s(shape, bs, n, 1, ctx)))
    return {"klotski": round(2 * run(prompts // bs, read_s)),
            "accelerate": round(2 * read_s + run(1, MMAP_READ_FACTOR * read_s))}


def size_disk_run(m: Machine, *, shape: str | None = None, layers: int | None = None, bs: int = 4,
                  minutes: float = 30.0, threads: int | None = None, compute=None) -> dict:
    """The disk regime for machine `m`: the largest layer shape (or `shape`) whose model, in
    the fewest layers (or `layers`) that make it at least twice the memory limit, fits in half
    the free disk, under RAM_SHARE of RAM, and in `minutes` per system; its budgets from the
    planner (planned_budgets), the limit they make, and a job sized to the compute. `threads`:
    the cores other work leaves idle (at least one). `compute(rung, threads)` gives the rung's
    compute model (default gemm_compute; the driver passes the planner's, planner_compute).
    Pure: the same machine and compute model give the same sizing. Raises DiskRegimeRefused."""
    if m.disk_gbps <= 0 or m.core_gflops <= 0:
        raise DiskRegimeRefused("the disk regime is sized from an O_DIRECT read of the disk and a matrix "
                                "multiply, and the probe gave no figure for the disk (dd iflag=direct refused, "
                                "or under 4 GiB free for its scratch file)")
    threads = threads or max(1, min(m.cores, round(m.cores - m.load)))
    compute = compute or (lambda rung, threads: gemm_compute(m, threads))
    smallest = lambda sh, read_s: (bs, MIN_PROMPT_TOKENS, MIN_NEW_TOKENS)
    reasons = []
    for name in [shape] if shape else list(DISK_SHAPES):
        # the smallest job first: a shape the disk or RAM cannot hold is not timed at all
        s = _sized(m, name, layers, bs, threads, smallest, lambda *a: 0.0)
        why = _unfit(m, s, math.inf)
        if not why:
            compute_s = compute(name, threads)
            s = _sized(m, name, layers, bs, threads, lambda sh, read_s: _compute_job(sh, read_s, compute_s, bs),
                       compute_s)
            why = _unfit(m, s, minutes)
            if not why:
                return s
        reasons.append(f"{why} ({name} layers, {s['layers']} of them)")
    # the smallest shape tried: what the machine lacks for any of them
    raise DiskRegimeRefused(f"the disk regime does not fit this machine: {reasons[-1]}")


def _sized(m: Machine, name: str, layers: int | None, bs: int, threads: int, job, compute_s) -> dict:
    """Rung `name` in the fewest layers (or `layers`) that make the model twice the memory
    limit, with the job `job(shape, read_s)` gives and the budgets the planner accepts for it."""
    L = layers or 1
    for _ in range(64):  # the limit grows a little with the layers (KV cache): a fixed point
        sh, fields = disk_shape(name, L)
        size = model_bytes(sh)
        read_s = size / (m.disk_gbps * 1e9)
        prompts, tokens, new = job(sh, read_s)
        device, host = planned_budgets(sh, bs=bs, prompts=prompts, prompt_len=tokens + PROMPT_SLACK, gen_len=new)
        limit = device + host + RUNTIME_ALLOWANCE
        if size >= 2 * limit or layers:
            break
        L = max(L + 1, math.ceil(L * 2 * limit / size))
    return {"shape": name, "layers": L, "config_fields": fields, "dtype": DISK_DTYPE, "model_bytes": size,
            "device_memory": device, "host_memory": host, "memory_limit": limit, "threads": threads,
            "batch_size": bs, "prompts": prompts, "prompt_tokens": tokens, "max_new_tokens": new,
            "read_s": round(read_s, 2), "decode_step_compute_s": round(compute_s(sh, bs, prompts // bs, 1, tokens + new), 2),
            "estimate_s": estimate_s(sh, read_s, compute_s, bs=bs, prompts=prompts, prompt_tokens=tokens,
                                     new_tokens=new)}


def _unfit(m: Machine, s: dict, minutes: float) -> str | None:
    """Why sizing `s` does not fit machine `m`, in words; None if it does."""
    gb, gib = 1e9, 2**30
    if s["model_bytes"] < 2 * s["memory_limit"]:
        return (f"a {s['model_bytes'] / gb:.1f} GB model is under twice its memory limit of "
                f"{s['memory_limit'] / gib:.2f} GiB; give more layers")
    if 2 * s["model_bytes"] > m.free_disk_bytes:
        return (f"it needs {2 * s['model_bytes'] / gb:.0f} GB of free disk (a {s['model_bytes'] / gb:.1f} GB model, "
                f"twice the smallest workable memory limit of {s['memory_limit'] / gib:.2f} GiB, kept under half "
                f"the free disk for accelerate's offload copy) and {m.free_disk_bytes / gb:.0f} GB is free; "
                "free some space or set XDG_CACHE_HOME and TMPDIR to a larger disk")
    if s["memory_limit"] > RAM_SHARE * m.ram_bytes:
        return (f"its memory limit of {s['memory_limit'] / gib:.2f} GiB needs {s['memory_limit'] / RAM_SHARE / gib:.1f} "
                f"GiB of RAM and there is {m.ram_bytes / gib:.1f} GiB")
    worst = max(s["estimate_s"].values())
    if worst > 60 * minutes:
        return f"a system would take about {worst / 60:.0f} minutes here, over the {minutes:g} allowed"
    return None


def probe_machine(where: Path, *, reclaimable: int = 0) -> tuple[Machine, dict]:
    """This machine as the sizing sees it: free disk at `where` (plus `reclaimable` bytes the
    bench would delete first), RAM, the cores this process may use, a sequential O_DIRECT read
    of a 1 GiB scratch file there (dd, median of 3), and a float32 matrix multiply on one core
    (the medium preset's expert shape at 64 tokens, median of 5)."""
    import os
    import shutil
    import statistics
    import time

    import torch
    from bench_runner import disk_read_gbps
    free = shutil.disk_usage(where).free + reclaimable
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0))
    scratch, reads = where / ".disk-probe.bin", []
    if free > 4 << 30:
        try:
            with open(scratch, "wb") as f:
                block = os.urandom(1 << 20) * 64
                for _ in range(16):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            reads = [disk_read_gbps(scratch, 1 << 30) for _ in range(3)]
        finally:
            scratch.unlink(missing_ok=True)
    rates = [r["gb_per_s"] for r in reads if r.get("gb_per_s")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(64, 1024), torch.randn(1024, 3584)
        a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                a @ b
            times.append((time.perf_counter() - t0) / 10)
    finally:
        torch.set_num_threads(threads)
    gflops = 2 * 64 * 1024 * 3584 / statistics.median(times) / 1e9
    machine = Machine(free_disk_bytes=int(free), ram_bytes=int(ram), cores=cores,
                      disk_gbps=round(statistics.median(rates), 3) if rates else 0.0, core_gflops=round(gflops, 1),
                      load=round(os.getloadavg()[0], 2))
    return machine, {"disk_reads": reads, "gemm_s": [round(x, 6) for x in times], "where": str(where),
                     "reclaimable_bytes": reclaimable}


def regime_controls() -> str | None:
    """Why this machine cannot impose the regime's memory limit and cold reads, or None: a
    memory cgroup the bench can create (bench_runner.MemoryGroup) and a writable drop_caches
    (without both, earlier runs' page cache would serve reads the regime means to come from disk)."""
    import os
    from bench_runner import MemoryGroup
    try:
        MemoryGroup(1 << 30).remove()
    except OSError as e:
        return f"a memory cgroup the bench can create (here: {e})"
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "a writable /proc/sys/vm/drop_caches to drop the page cache before each run (root)"
    return None


def prepare_prompts(pool: list[dict], model_dir: Path, s: dict) -> tuple[list[dict], dict | None]:
    """The prompt pool cut to --prompt-tokens tokens with the model's own tokenizer (a cut that
    tokenizes longer again is cut shorter); for the disk preset, the budgets checked against the
    built checkpoint's exact group sizes and these prompts, as the engine will plan them, so no
    run is refused after its profile. Raises DiskRegimeRefused."""
    if not s.get("prompt_tokens") and s["preset"] != "disk":
        return pool, None
    import torch

    from klotski.config import parse_size
    from klotski.io.checkpoint import Checkpoint
    from planner.shapes import as_shape
    ckpt = Checkpoint.open(str(model_dir))
    try:
        tok, limit, out = ckpt.tokenizer, s["prompt_tokens"], []
        count = lambda text: len(tok(text)["input_ids"])
        for p in pool:
            ids, text = tok(p["prompt"])["input_ids"], p["prompt"]
            k = min(len(ids), limit or len(ids))
            while limit and count(text) > limit and k > 0:
                text, k = tok.decode(ids[:k], skip_special_tokens=True), k - 1
            out.append({**p, "prompt": text})
        lens = [count(p["prompt"]) for p in out[:s["prompts"]]]
        if s["preset"] != "disk":
            return out, None
        shape = dataclasses.replace(as_shape(ckpt.spec), dtype=s["dtype"])
        plan = plan_at(shape, parse_size(s["device_memory"]), parse_size(s["host_memory"]), bs=s["batch_size"],
                       prompts=s["prompts"], prompt_len=max(lens), gen_len=s["max_new_tokens"],
                       sizes=ckpt.group_bytes(getattr(torch, s["dtype"])))
    finally:
        ckpt.close()
    if not hasattr(plan, "prefill_chunk"):
        raise DiskRegimeRefused(f"the planner refuses the sized budgets for the built checkpoint: {plan}")
    return out, {"prompt_tokens_max": max(lens), "prompt_tokens_mean": round(sum(lens) / len(lens), 1),
                 "planner_check": {"batch_size": plan.batch_size, "num_batches": plan.num_batches,
                                   "prefill_chunk": plan.prefill_chunk}}
