"""Machine profiles: what compute and each link can do, measured here or taken from a file.

A `Profile` is plain data (JSON round-trip). `measure()` times the ops of one MoE layer in
the model's dtype on a device (cpu or cuda) — attention (decode and prefill), router, one
expert FFN, dequantization of one expert, LM head — and the bandwidth of disk→host,
host→device and device→host, and caches the result in the directory the caller names
(klotski's user cache, klotski/util/cachedir.py). Built-in profiles (`planner/profiles/*.json`)
describe hardware that is not here, from published peak figures × stated efficiency
factors; `load_profile` resolves them to effective values.

The ops themselves are the caller's (`ops=`): klotski passes the engine's own layer code
(klotski/planning.py: EngineOps), so what is timed is what runs; this package never imports
klotski and has no model math of its own. An ops factory is called as
`ops(shape, torch_dtype, torch_device)` and returns an object whose methods
`attention(bs, ctx, new_tokens)`, `gate(tokens)`, `expert(tokens)`, `head(tokens)` and
`dequant()` (one expert's weights) each prepare inputs on the device and return a
zero-argument callable running that op once; optionally `wave(experts, pairs)` (one grouped
call over a stack of experts, the pairs spread over them), `attend(bs, ctx, new_tokens)` (the
attention core alone) and `kernels(bs, ctx)` (the ops one call of each piece of the math
issues: the profile's `kernels`). On a GPU machine the factory is also called with the cpu
device to time host compute (an expert, the attention core) for `host_flops` /
`host_mem_bw`; on a CPU-only machine the host is the device. The factory's `key` (text) names
what is timed and is part of the cache key: change it whenever the timed code changes.

torch is imported inside the measuring functions only: planning from a built-in profile
must not pay for (or require) torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.profile_checks import LoadWatch, settle, verdict
from planner.shapes import as_shape

BUILTIN_DIR = Path(__file__).parent / "profiles"
# The measuring harness's version (grid, timing, links), part of the cache key with the ops' own
# key; each bump is described in git's history (10: grouped expert calls over 1 and WAVE_GROUPS
# experts, `wave`, as the engine runs them; 11: the load watched throughout, samples checked
# against each other and re-measured, two calls at least per op).
PROFILE_VERSION = 11
# This VM's speed moved by a fifth within minutes: one measure priced smollm2-moe's expert at
# 8 tokens 0.74 ms (and every other op about as much faster) where two measures minutes later
# gave 0.91 and 0.93 and the same op timed alone 0.88-0.95; a run meets the typical pace, so
# each point is the median of passes spread over the measure.
ROUNDS = 3
# A chunked prefill pass (new tokens ≪ context) is neither a decode step nor a whole prompt:
# tiny-mixtral's 8 tokens over 128 ran 0.90 ms where the whole-prompt samples priced 0.65.
CHUNK_SAMPLE = 8
# A wave is timed over 1 and WAVE_GROUPS experts at each of WAVE_PAIRS pairs an expert (the stack within WAVE_BYTES).
WAVE_GROUPS = 8
WAVE_PAIRS = (1, 8, 64)
WAVE_BYTES = 1 << 30
REMEASURE_AFTER_S = 600.0  # a profile kept apart (busy, or its samples disagreed) is used this long at least
LONG_OP_S = 2.0  # an op slower than this is timed once (on a CPU, a big model's prefill at 512 tokens)


@dataclass
class Profile:
    name: str
    flops: float                      # effective FLOP/s in the model dtype
    mem_bw: float                     # effective device-memory bytes/s
    links: dict[str, float]           # effective bytes/s: disk_to_host, host_to_device, device_to_host
    device: str = "cpu"               # where compute runs: cpu | cuda
    link_latency_s: float = 0.0       # fixed cost per transfer
    overhead_s: dict[str, float] = field(default_factory=dict)   # fixed cost per op call, by kind
    memory: dict[str, float] = field(default_factory=dict)       # usable bytes: device, host, disk
    samples: dict[str, list[list[float]]] = field(default_factory=dict)  # measured rows, time last
    shape_key: str | None = None      # the model shape the samples belong to
    machine: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)   # provenance of every number (built-ins)
    checks: dict = field(default_factory=dict)    # comparisons against published measurements
    # The CPU next to host RAM, for attention where the KV lives and experts where they live
    # (0: unknown, so the cost model never chooses host compute). On a CPU-only machine the
    # host is the device: the cost model then uses the device's rates and samples.
    host_flops: float = 0.0           # effective host FLOP/s in the model dtype
    host_mem_bw: float = 0.0          # effective host-memory bytes/s read by host compute
    # The host's cost of one op launched on the device (CUDA: launch plus a small kernel's
    # latency; CPU: per-op dispatch), and the ops the engine's pipeline issues around the
    # timed ops, per term of `overhead_s` (counted by the engine: klotski/measure/overhead.py).
    # The cost model never prices a term below its launches: a GPU waits on them.
    launch_s: float = 0.0
    launches: dict[str, float] = field(default_factory=dict)
    # ATen ops of one call of each piece of the model's own math, counted by the ops factory
    # when it can (`ops.kernels()`: klotski/measure/profile_ops.py says which): with `launches`,
    # the kernels a decode layer issues (planner/decode_ops.py). Empty: not counted (a built-in
    # profile, or one measured before they were), and nothing is predicted from them.
    kernels: dict[str, float] = field(default_factory=dict)
    # How the measure was judged (planner/profile_checks.py): the load read through it, the
    # samples that disagreed with their op's other sizes and were re-measured, and the verdict.
    judged: dict = field(default_factory=dict)
    # What runs on this machine taught the cost model (planner/calibrate.py): each term's factor
    # on the measured times, and the evidence it was refitted from. Empty: as measured.
    calibration: dict = field(default_factory=dict)

    cached_at = None  # the cache file it was read from or saved to (not a field: not saved)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))


# ---- built-in profiles ----------------------------------------------------------------------
def _effective(x) -> float:
    """A number, {"value": v}, or {"peak": p, "efficiency": e} → p·e."""
    if isinstance(x, dict):
        return float(x["peak"]) * float(x["efficiency"]) if "peak" in x else float(x["value"])
    return float(x)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike) -> Profile:
    """A built-in profile by name (`rtx3090-pcie4`) or a profile JSON file (built-in style
    with peaks and efficiencies, or a measured profile as written by `measure`)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = BUILTIN_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise FileNotFoundError(f"no hardware profile {str(name_or_path)!r}; built-in: {', '.join(builtin_profiles())}")
    d = json.loads(path.read_text())
    if "samples" in d or isinstance(d.get("flops"), (int, float)):
        return Profile.from_dict(d)
    return Profile(
        name=d["name"], device=d.get("device", "cuda"),
        flops=_effective(d["flops"]), mem_bw=_effective(d["mem_bw"]),
        links={k: _effective(v) for k, v in d["links"].items()},
        link_latency_s=_effective(d.get("link_latency_s", 0.0)),
        overhead_s={k: float(v) for k, v in d.get("overhead_s", {}).items() if k != "source"},
        memory={k: _effective(v) for k, v in d.get("memory", {}).items()},
        host_flops=_effective(d["host"]["flops"]) if "host" in d else 0.0,
        host_mem_bw=_effective(d["host"]["mem_bw"]) if "host" in d else 0.0,
        sources={k: d[k] for k in ("description", "flops", "mem_bw", "links", "link_latency_s", "overhead_s", "memory",
                                   "host") if k in d},
        checks=d.get("checks", {}),
    )


# ---- cache --------------------------------------------------------------------------------
def machine_fingerprint(device: str = "cpu") -> dict:
    """What the timings depend on — not the hostname, so identical machines share profiles."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    fp = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "device": device,
          "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        fp["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return fp


def profile_key(shape, device: str, grid: dict, ops_key: str = "") -> str:
    """What a cached profile stands for: machine, shape, grid, the harness's version and the
    ops that were timed (`ops_key`: the ops factory's `key`). Not an emulated link: that only
    replaces the measured link's rate (`with_link`), so every `--emulate-link` shares one."""
    text = json.dumps({"version": PROFILE_VERSION, "ops": ops_key, "machine": machine_fingerprint(device),
                       "shape": as_shape(shape).key(), "grid": grid}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- measuring ------------------------------------------------------------------------------
def measure(shape, *, ops, batch_sizes=(1, 4, 16, 64), context_lengths=(128, 512), token_counts=(1, 8, 64, 512),
            device: str = "cpu", link_gbps: float | None = None, refresh: bool = False,
            cache_dir: str | os.PathLike | None = None, reps: int = 5, io_bytes: int = 64 << 20,
            io_dir: str | os.PathLike | None = None, announce=None, busy=None) -> Profile:
    """Time one layer's ops (`ops`: the caller's factory, see the module docstring) for
    `shape` on `device` of this machine, kept in `cache_dir` (the caller's; none: measured
    every time) unless `refresh`.

    Attention is measured for decode at every (batch size, context) and for prefill at
    every context with the two smallest batch sizes, and with the largest at the shortest
    context (prefill is costly; a big batch's does not scale plainly from a small one's),
    whole prompts and chunks of CHUNK_SAMPLE tokens over them.
    `link_gbps` (GB/s) replaces the host↔device bandwidth, as `--emulate-link` throttles
    that channel in the engine. `announce(text)`, if given, is told when a measurement starts
    and how long it took (nothing when the cache answers). `busy()`, if given, says whether
    other processes are taking the cores (their runnable threads, or None). It is read before,
    every WATCH_EVERY_S during and after the measure (planner/profile_checks.py: a disturbance
    that starts midway got through a check made only before), and the samples are checked
    against each other, those that disagree measured again. A profile measured while the load
    was up, or whose samples still disagree, is that moment's speed, not the machine's: it is
    kept apart (`KEY.busy`), used while the machine is still busy and measured again once it is
    not. `judged` says which, and why.
    """
    shape = as_shape(shape)
    grid = {"bs": list(batch_sizes), "ctx": list(context_lengths), "tokens": list(token_counts),
            "io_bytes": io_bytes, "clone": "inline"}  # how a CPU copy is timed (part of the cache key)
    key = profile_key(shape, device, grid, ops.key)
    cache = cache_dir is not None
    path = Path(cache_dir or ".") / f"{key}.json"
    if cache and not refresh and path.exists():
        try:
            prof = Profile.from_json(path.read_text())
            prof.cached_at = str(path)
            return with_link(prof, link_gbps)
        except (ValueError, TypeError):
            pass  # a damaged cache file is re-measured
    # measured while busy earlier: used while the machine is still busy, measured again once it
    # is not, but not more often than every REMEASURE_AFTER_S (a disturbance the load reader does
    # not see, as another test worker's bursts, would otherwise have every run measure again)
    stale = path.with_suffix(".busy")
    if cache and not refresh and stale.exists() and (
            busy is None or busy() is not None or time.time() - stale.stat().st_mtime < REMEASURE_AFTER_S):
        try:
            return with_link(Profile.from_json(stale.read_text()), link_gbps)
        except (ValueError, TypeError):
            pass
    started = time.perf_counter()
    if announce:  # a new machine or new layer shapes: the user waits, so say for what
        announce(f"measuring this machine's speed at this model's layer shapes on {device} (once; cached"
                 f"{' in ' + str(cache_dir) if cache else ' for this run only'})")
    watch = LoadWatch(busy)
    watch.poll(force=True)
    prof = _measure(shape, ops, grid, device, reps, io_bytes, io_dir or cache_dir, watch)
    watch.poll(force=True)
    if announce:
        announce(f"speed measured in {time.perf_counter() - started:.1f} s")
    prof.name = f"measured-{key}"
    keep, why = verdict(watch, prof.judged["checks"])
    prof.judged.update(load=watch.summary(), cached=keep and cache, verdict=why)
    if watch.busy:
        prof.machine["busy_runnable_threads"] = watch.most
    if not keep:
        if announce:
            cause = (f"the machine was busy while measuring ({watch.most:g} other runnable threads)" if watch.busy
                     else "the measured speeds disagree with each other (" + why.split(" (", 1)[-1])
            announce(f"{cause}: this speed is used while the machine stays busy and measured again once it is quiet")
        if cache:
            _save(stale, prof.to_json())
    elif cache:
        _save(path, prof.to_json())
        stale.unlink(missing_ok=True)
    if cache and keep:
        prof.cached_at = str(path)  # where runs' corrections go (planner/calibrate.py)
    return with_link(prof, link_gbps)


def with_link(prof: Profile, link_gbps: float | None) -> Profile:
    """`prof` with the host<->device link at `link_gbps` GB/s (`--emulate-link`), the measured
    rate kept in `machine`; unchanged for None (the real link)."""
    if not link_gbps:
        return prof
    prof.machine["measured_host_to_device"] = prof.links["host_to_device"]
    prof.machine["emulated_link_gbps"] = float(link_gbps)
    prof.links["host_to_device"] = prof.links["device_to_host"] = float(link_gbps) * 1e9
    return prof


def write_whole(path: Path, text: str) -> None:
    """Write a profile's cache file whole or not at all (a run's corrections too:
    planner/calibrate.py); raises OSError. The temporary file is this process's own, so two
    writers never write into one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(path: Path):
    """Hold `path`'s lock file (`path`.lock) while a read-modify-write of `path` runs: two runs
    ending at once (two processes, or a server's batches) each add their lesson, neither
    overwriting the other's with what it read before. Raises OSError where it cannot be made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save(path: Path, text: str) -> None:
    """Cache a profile; a cache that cannot be written only means measuring again next time,
    so it is said once and the run goes on."""
    try:
        write_whole(path, text)
    except OSError as e:
        print(f"klotski: warning: {path}: cannot save the hardware profile ({e.strerror}); "
              "the run goes on and the next run measures again", file=sys.stderr)


def _measure(shape, make_ops, grid, device, reps, io_bytes, io_dir, watch=None) -> Profile:
    import torch

    from planner.costmodel import CostModel

    started = time.perf_counter()
    dt = getattr(torch, shape.dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        # kernels are queued, not run: a timed region ends only when the device is idle
        def sync():
            torch.cuda.synchronize(dev)
    else:
        def sync():
            pass
    ops = make_ops(shape, dt, dev)
    watch = watch or LoadWatch()
    unit = CostModel(Profile(name="unit", flops=1.0, mem_bw=1.0, links={}), shape)

    with torch.inference_mode():
        points = grid_points(ops, shape, grid)
        samples = median_of_rounds([time_points(points, reps, sync, watch) for _ in range(ROUNDS)])
        checks = settle(samples, unit.work, lambda kind, i: _retime(points, kind, i, reps, sync, watch))
        links = {"host_to_device": _copy_bandwidth(io_bytes, "cpu", dev, reps, sync),
                 "device_to_host": _copy_bandwidth(io_bytes, dev, "cpu", reps, sync)}
        if dev.type == "cpu":
            links["host_to_device"] = _clone_bandwidth(shape.expert_nbytes())
        # counted, not timed: once, at the grid's first decode point
        kernels = ops.kernels(grid["bs"][0], grid["ctx"][0]) if hasattr(ops, "kernels") else {}
    ops = None
    if dev.type == "cuda":  # the engine that runs next gets the device without the profile's blocks
        torch.cuda.empty_cache()
    disk_bw, disk_method = _disk_read_bandwidth(io_bytes, io_dir)
    links["disk_to_host"] = disk_bw
    machine = machine_fingerprint(device) | {"disk_read": disk_method}

    # Effective roofline parameters: the best compute rate and the best memory rate seen.
    # Between and beyond the measured points the cost model scales these, corrected by
    # the measured/roofline ratio of the nearest samples.
    flops = max(unit.work(k, row[:-1])[0] / row[-1] for k in ("expert", "attention") for row in samples[k])
    mem_bw = max(unit.work(k, row[:-1])[1] / row[-1] for k in ("expert", "gate", "head") for row in samples[k])
    host_flops, host_bw = flops, mem_bw  # CPU-only: the host is the device
    if dev.type == "cuda":
        host_flops, host_bw = host_rates(shape, make_ops, grid, reps, samples)
    launch_s = _launch_cost(dev, sync)
    machine["measure_s"] = round(time.perf_counter() - started, 2)
    return Profile(name="measured", device=dev.type, flops=flops, mem_bw=mem_bw, links=links,
                   samples=samples, shape_key=shape.key(), machine=machine,
                   memory=_memory_capacity(dev), host_flops=host_flops, host_mem_bw=host_bw, launch_s=launch_s,
                   kernels=kernels, judged={"checks": checks})


def _launch_cost(dev, sync, ops: int = 2000, rounds: int = 5) -> float:
    """Seconds per op of a chain of one-element ops issued back to back and waited for once:
    on CUDA a kernel launch plus the smallest kernel's latency, on a CPU the dispatch of an
    op. The median of `rounds`."""
    import torch
    x = torch.zeros(1, device=dev)
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)
        sync()
        times.append((time.perf_counter() - start) / ops)
    return statistics.median(times)


def median_of_rounds(rounds: list[dict[str, list[list[float]]]]) -> dict[str, list[list[float]]]:
    """Each point of the grid at the median of its time over the rounds (same points, same order)."""
    return {kind: [row[:-1] + [statistics.median(r[kind][i][-1] for r in rounds)] for i, row in enumerate(rows)]
            for kind, rows in rounds[0].items()}


def grid_points(ops, shape, grid) -> list[tuple[str, list[float], object]]:
    """The grid as (kind, point, op maker) in timing order: each op at each of its points; a
    maker returns the zero-argument call timed (so a disagreeing sample can be timed again)."""
    points = []
    for ctx in grid["ctx"]:
        for bs in grid["bs"]:
            points.append(("attention", [bs, ctx, 1], lambda bs=bs, ctx=ctx: ops.attention(bs, ctx, 1)))
        # the largest batch too at the shortest context: a big batch's prefill is not a
        # small one's scaled (32 x 207 tokens ran 1.4x the bs-4 extrapolation here)
        wide = sorted(grid["bs"])[:2] + ([max(grid["bs"])] if ctx == min(grid["ctx"]) else [])
        for bs in sorted(set(wide)):
            points.append(("attention", [bs, ctx, ctx], lambda bs=bs, ctx=ctx: ops.attention(bs, ctx, ctx)))
        for bs in sorted(grid["bs"])[:2]:
            new = min(CHUNK_SAMPLE, ctx // 2)
            points.append(("attention", [bs, ctx, new], lambda bs=bs, ctx=ctx, new=new: ops.attention(bs, ctx, new)))
    for n in grid["tokens"]:
        points.append(("gate", [n], lambda n=n: ops.gate(n)))
        points.append(("expert", [n], lambda n=n: ops.expert(n)))
    for n in sorted({1, max(grid["bs"])}):
        points.append(("head", [n], lambda n=n: ops.head(n)))
    points.append(("dequant", [shape.expert_params], ops.dequant))
    if hasattr(ops, "wave"):  # [experts, pairs, seconds]; wave_empty: one expert's among g - 1 empty groups
        g = wave_groups(shape)
        points += [("wave", [k, k * n], lambda k=k, n=n: ops.wave(k, k * n)) for n in WAVE_PAIRS for k in (1, g)]
        points.append(("wave_empty", [g, 8], lambda g=g: ops.wave(g, 8, spread=False)))
    return points


def time_points(points, reps, sync, watch=None) -> dict[str, list[list[float]]]:
    """One round of the grid: each point timed, as [point..., seconds] rows by kind; the load
    read between ops (`watch`) as often as it asks."""
    samples: dict[str, list[list[float]]] = {"attention": [], "gate": [], "expert": [], "head": [], "dequant": []}
    for kind, point, make in points:
        if watch is not None:
            watch.poll()
        samples.setdefault(kind, []).append(point + [time_op(make(), reps, sync)])
    return samples


def _retime(points, kind, index, reps, sync, watch) -> float:
    """A sample that disagreed, timed again (its `index`-th row of `kind`)."""
    make = [m for k, _, m in points if k == kind][index]
    watch.poll()
    return time_op(make(), reps, sync)


def wave_groups(shape) -> int:
    """Experts in the larger timed wave: WAVE_GROUPS, or the model's, or what WAVE_BYTES holds (≥ 2)."""
    return max(2, min(WAVE_GROUPS, shape.num_experts, WAVE_BYTES // max(1, shape.expert_params * shape.dtype_bytes)))


def host_rates(shape, make_ops, grid, reps, samples=None) -> tuple[float, float]:
    """Effective (FLOP/s, bytes/s) of host compute: the engine's expert FFN at a few token
    counts and its attention core (when the ops have one) at decode, timed on the CPU. Rows
    go into `samples` as `host_expert` / `host_attend` for the record."""
    import torch

    from planner.costmodel import CostModel

    ops = make_ops(shape, getattr(torch, shape.dtype), torch.device("cpu"))
    rows = {"expert": [[n, time_op(ops.expert(n), reps, lambda: None)] for n in sorted(grid["tokens"])[:3]]}
    if hasattr(ops, "attend"):
        rows["attend"] = [[bs, ctx, 1, time_op(ops.attend(bs, ctx, 1), reps, lambda: None)]
                          for ctx in grid["ctx"] for bs in sorted(grid["bs"])[:2]]
    cm = CostModel(Profile(name="unit", flops=1.0, mem_bw=1.0, links={}), shape)
    work = [(cm.work(kind, row[:-1]), row[-1]) for kind, kind_rows in rows.items() for row in kind_rows]
    if samples is not None:
        samples.update({f"host_{kind}": kind_rows for kind, kind_rows in rows.items()})
    return max(f / t for (f, _), t in work), max(b / t for (_, b), t in work)


def time_op(fn, reps: int, sync) -> float:
    """The median of up to `reps` timed calls after one untimed warm-up (which, on a GPU,
    also pays for kernel loading, library handles and the allocator's first blocks). Each
    timed call starts and ends synchronized, so it holds its own work and nothing queued
    before; ops slower than ~1/reps s get fewer repetitions. The median, not the fastest:
    a step pays an op's typical time (the fastest of 5 priced smollm2-moe's expert at 8
    tokens 0.73 ms, its attention at bs 16 0.78; the same ops ran 0.96-1.0 and 0.88-0.92
    call after call, in the pipeline too). How many calls: as many as fit in about a second at
    the fastest call so far, and two at least for an op under LONG_OP_S (a first call slowed by
    another process once decided alone that a 0.1 s op got one repetition: the disturbed one);
    of two, the faster. A sample disturbed throughout is caught by the shape checks
    (planner/profile_checks.py) or dropped by the cost model (planner/costmodel.py: OUTLIER)."""
    def once() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    fn()
    sync()
    times = [once()]
    while len(times) < min(reps, max(2 if min(times) < LONG_OP_S else 1, int(1.0 / max(min(times), 1e-6)))):
        times.append(once())
    return min(times) if len(times) == 2 else statistics.median(times)


def _copy_bandwidth(nbytes, src, dst, reps, sync) -> float:
    """Bytes/s of one `nbytes` copy src→dst (pinned host memory when a GPU is involved)."""
    import torch

    src, dst = torch.device(src), torch.device(dst)
    pin = torch.cuda.is_available() and "cuda" in (src.type, dst.type)
    a = torch.empty(nbytes, dtype=torch.uint8, device=src, pin_memory=pin and src.type == "cpu")
    a.fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst, pin_memory=pin and dst.type == "cpu")
    t = time_op(lambda: b.copy_(a, non_blocking=pin), reps, sync)
    return nbytes / t


def _clone_bandwidth(nbytes: int, total: int = 256 << 20, count: int = 40) -> float:
    """Bytes/s of a CPU "transfer" as the engine makes it without an emulated link
    (klotski/execute/channels.py: `Channel.inline`): a clone of a group of `nbytes` into
    memory the allocator reuses, on the calling thread with torch's own threads, from sources
    cycled through `total` bytes (cold), the median of `count`. (With an emulated link the
    link's rate replaces this.) Timed on a one-thread worker, as the engine once copied, it
    priced the demo's copies at 7.1 GB/s where its inline copies ran ~17."""
    import torch

    nbytes = max(1, int(nbytes))
    sources = [torch.ones(nbytes, dtype=torch.uint8) for _ in range(max(2, min(64, total // nbytes)))]
    times, kept = [], []
    for i in range(count):
        start = time.perf_counter()
        kept.append(sources[i % len(sources)].clone())
        times.append(time.perf_counter() - start)
        del kept[:-2]  # the engine frees what it no longer holds: memory is reused, as there
    return nbytes / statistics.median(times)


def _disk_read_bandwidth(nbytes: int, where) -> tuple[float, str]:
    """Bytes/s reading a fresh temp file: O_DIRECT when the filesystem allows, otherwise a
    buffered read after asking the kernel to drop the file from the page cache."""
    where = Path(where) if where else Path(tempfile.gettempdir())
    where.mkdir(parents=True, exist_ok=True)
    chunk = 4 << 20
    nbytes = max(chunk, nbytes - nbytes % chunk)
    fd, name = tempfile.mkstemp(prefix="klotski-io-", dir=where)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires

    def read_all(direct: bool) -> float:
        rfd = os.open(name, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.readv(rfd, [buf]) > 0:
                pass
            return time.perf_counter() - t0
        finally:
            os.close(rfd)

    try:
        block = os.urandom(chunk)
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        method = "o_direct" if hasattr(os, "O_DIRECT") else "buffered+fadvise"
        times = []
        for _ in range(3):
            try:
                times.append(read_all(method == "o_direct"))
            except OSError:
                if method != "o_direct":
                    raise
                method = "buffered+fadvise"  # e.g. tmpfs refuses O_DIRECT
                times.append(read_all(False))
        return nbytes / statistics.median(times), method
    finally:
        buf.close()
        os.unlink(name)


def _memory_capacity(dev) -> dict[str, float]:
    """Physical capacities, for budget defaults (the user's budgets always win)."""
    out: dict[str, float] = {}
    try:
        out["host"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    if dev.type == "cuda":
        import torch
        out["device"] = float(torch.cuda.get_device_properties(dev).total_memory)
    elif "host" in out:
        out["device"] = out["host"]
    return out
