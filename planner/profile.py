"""Machine profiles: what compute and each link can do, measured here or taken from a file.

A `Profile` is plain data (JSON round-trip). `measure()` times the ops of one Mixtral layer
with torch in the model's dtype — attention (decode and prefill), router, one expert FFN,
HQQ-style dequantization, LM head — and the bandwidth of disk→host, host→device and
device→host, and caches the result in the directory the caller names (klotski's user cache,
klotski/cachedir.py). Built-in
profiles (`planner/profiles/*.json`) describe hardware that is not here, from published
peak figures × stated efficiency factors; `load_profile` resolves them to effective values.

torch is imported inside the measuring functions only: planning from a built-in profile
must not pay for (or require) torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.shapes import as_shape

BUILTIN_DIR = Path(__file__).parent / "profiles"


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
        sources={k: d[k] for k in ("description", "flops", "mem_bw", "links", "link_latency_s", "overhead_s", "memory")
                 if k in d},
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


def profile_key(shape, device: str, link_gbps: float | None, grid: dict) -> str:
    text = json.dumps({"machine": machine_fingerprint(device), "shape": as_shape(shape).key(),
                       "link_gbps": link_gbps, "grid": grid}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- measuring ------------------------------------------------------------------------------
def measure(shape, *, batch_sizes=(1, 4, 16), context_lengths=(128, 512), token_counts=(1, 8, 64, 512),
            device: str = "cpu", link_gbps: float | None = None, refresh: bool = False,
            cache_dir: str | os.PathLike | None = None, reps: int = 5, io_bytes: int = 64 << 20,
            io_dir: str | os.PathLike | None = None) -> Profile:
    """Time one layer's ops for `shape` on this machine, kept in `cache_dir` (the caller's;
    none: measured every time) unless `refresh`.

    Attention is measured for decode at every (batch size, context) and for prefill at
    every context with the two smallest batch sizes (prefill is costly and scales plainly
    with batch). `link_gbps` (GB/s) replaces the host↔device bandwidth, as `--emulate-link`
    throttles that channel in the engine.
    """
    shape = as_shape(shape)
    grid = {"bs": list(batch_sizes), "ctx": list(context_lengths), "tokens": list(token_counts),
            "io_bytes": io_bytes}
    key = profile_key(shape, device, link_gbps, grid)
    cache = cache_dir is not None
    path = Path(cache_dir or ".") / f"{key}.json"
    if cache and not refresh and path.exists():
        try:
            return Profile.from_json(path.read_text())
        except (ValueError, TypeError):
            pass  # a damaged cache file is re-measured
    prof = _measure(shape, grid, device, link_gbps, reps, io_bytes, io_dir or cache_dir)
    prof.name = f"measured-{key}"
    if cache:
        _save(path, prof.to_json())
    return prof


def _save(path: Path, text: str) -> None:
    """Cache a profile (whole or not at all); a cache that cannot be written only means
    measuring again next time, so it is said once and the run goes on."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"klotski: warning: {path}: cannot save the hardware profile ({e.strerror}); "
              "the run goes on and the next run measures again", file=sys.stderr)


def _measure(shape, grid, device, link_gbps, reps, io_bytes, io_dir) -> Profile:
    import torch

    from planner.costmodel import CostModel

    started = time.perf_counter()
    dt = getattr(torch, shape.dtype)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ops = _LayerOps(shape, dt, dev)
    samples: dict[str, list[list[float]]] = {"attention": [], "gate": [], "expert": [], "head": [], "dequant": []}

    with torch.inference_mode():
        for ctx in grid["ctx"]:
            for bs in grid["bs"]:
                samples["attention"].append([bs, ctx, 1, _timeit(ops.attention(bs, ctx, 1), reps, sync)])
            for bs in sorted(grid["bs"])[:2]:
                samples["attention"].append([bs, ctx, ctx, _timeit(ops.attention(bs, ctx, ctx), reps, sync)])
        for n in grid["tokens"]:
            samples["gate"].append([n, _timeit(ops.gate(n), reps, sync)])
            samples["expert"].append([n, _timeit(ops.expert(n), reps, sync)])
        for n in sorted({1, max(grid["bs"])}):
            samples["head"].append([n, _timeit(ops.head(n), reps, sync)])
        samples["dequant"].append([shape.expert_params, _timeit(ops.dequant(), reps, sync)])
        links = {"host_to_device": _copy_bandwidth(io_bytes, "cpu", dev, reps, sync),
                 "device_to_host": _copy_bandwidth(io_bytes, dev, "cpu", reps, sync)}
    ops = None
    disk_bw, disk_method = _disk_read_bandwidth(io_bytes, io_dir)
    links["disk_to_host"] = disk_bw
    machine = machine_fingerprint(device) | {"disk_read": disk_method}
    if link_gbps:
        machine["measured_host_to_device"] = links["host_to_device"]
        links["host_to_device"] = links["device_to_host"] = float(link_gbps) * 1e9
        machine["emulated_link_gbps"] = float(link_gbps)

    # Effective roofline parameters: the best compute rate and the best memory rate seen.
    # Between and beyond the measured points the cost model scales these, corrected by
    # the measured/roofline ratio of the nearest samples.
    unit = Profile(name="unit", flops=1.0, mem_bw=1.0, links=links)
    cm = CostModel(unit, shape)
    flops = max(cm.work(k, row[:-1])[0] / row[-1] for k in ("expert", "attention") for row in samples[k])
    mem_bw = max(cm.work(k, row[:-1])[1] / row[-1] for k in ("expert", "gate", "head") for row in samples[k])
    machine["measure_s"] = round(time.perf_counter() - started, 2)
    return Profile(name="measured", device=dev.type, flops=flops, mem_bw=mem_bw, links=links,
                   samples=samples, shape_key=shape.key(), machine=machine,
                   memory=_memory_capacity(dev))


def _timeit(fn, reps: int, sync) -> float:
    """Median of `reps` timed calls after one warm-up; slow ops get fewer repetitions."""
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    reps = max(1, min(reps, int(1.0 / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _LayerOps:
    """Random weights of one MoE layer and closures running each op as the engine would."""

    def __init__(self, shape, dt, dev):
        import torch

        self.torch, self.s, self.dt, self.dev = torch, shape, dt, dev
        g = torch.Generator().manual_seed(0)
        H, I = shape.hidden_size, shape.intermediate_size
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

        def w(*size):
            return (torch.randn(*size, generator=g) * 0.02).to(dt).to(dev)

        self.wq, self.wk, self.wv, self.wo = w(q, H), w(kv, H), w(kv, H), w(H, q)
        self.norm = torch.ones(H, dtype=dt, device=dev)
        self.wg = w(shape.num_experts, H)
        Is = shape.shared_intermediate_size  # a shared expert runs with the router (Qwen2-MoE)
        self.shared = (w(Is, H), w(Is, H), w(H, Is)) if Is else None
        self.w1, self.w3, self.w2 = w(I, H), w(I, H), w(H, I)
        self._head = None

    def _x(self, *size):
        return self.torch.randn(*size, dtype=self.dt, device=self.dev)

    def _rms(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(v + 1e-5)).to(self.dt) * self.norm

    def attention(self, bs, ctx, new):
        torch, s = self.torch, self.s
        F = torch.nn.functional
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        x = self._x(bs, new, s.hidden_size)
        past = ctx - new
        pk = self._x(bs, nkv, past, hd) if past > 0 else None
        pv = self._x(bs, nkv, past, hd) if past > 0 else None
        pos = torch.arange(past, ctx, device=self.dev, dtype=torch.float32)
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=self.dev, dtype=torch.float32) / hd))
        ang = torch.outer(pos, inv)
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.dt)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(self.dt)

        def rope(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat([-b, a], -1) * sin

        def run():
            h = self._rms(x)
            qh = rope(F.linear(h, self.wq).view(bs, new, nh, hd).transpose(1, 2))
            kh = rope(F.linear(h, self.wk).view(bs, new, nkv, hd).transpose(1, 2))
            vh = F.linear(h, self.wv).view(bs, new, nkv, hd).transpose(1, 2)
            if pk is not None:
                kh, vh = torch.cat([pk, kh], 2), torch.cat([pv, vh], 2)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=new > 1, enable_gqa=nh != nkv)
            return x + F.linear(o.transpose(1, 2).reshape(bs, new, nh * hd), self.wo)
        return run

    def gate(self, n):
        torch = self.torch
        x = self._x(n, self.s.hidden_size)

        def run():
            F = torch.nn.functional
            probs = torch.softmax(F.linear(x, self.wg).float(), -1)
            if self.shared:
                w1, w3, w2 = self.shared
                F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
            return torch.topk(probs, self.s.top_k, -1)
        return run

    def expert(self, n):
        F = self.torch.nn.functional
        x = self._x(n, self.s.hidden_size)
        return lambda: F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)

    def head(self, n):
        if self._head is None:
            self._head = self._x(self.s.vocab_size, self.s.hidden_size)
        x = self._x(n, self.s.hidden_size)
        return lambda: self.torch.nn.functional.linear(self._rms(x), self._head).float()

    def dequant(self):
        """HQQ-style 4-bit dequantization of one expert: unpack nibbles, (q − zero)·scale
        per group of 64 (scales/zeros held in dtype; their own 8-bit quantization is small)."""
        torch = self.torch
        params = self.s.expert_params - self.s.expert_params % 128
        packed = torch.randint(0, 256, (params // 2,), dtype=torch.uint8, device=self.dev)
        scale = self._x(params // 64, 1)
        zero = self._x(params // 64, 1)

        def run():
            q = torch.stack([packed >> 4, packed & 15], -1).view(-1, 64).to(self.dt)
            return (q - zero) * scale
        return run


def _copy_bandwidth(nbytes, src, dst, reps, sync) -> float:
    """Bytes/s of one `nbytes` copy src→dst (pinned host memory when a GPU is involved)."""
    import torch

    src, dst = torch.device(src), torch.device(dst)
    pin = torch.cuda.is_available() and "cuda" in (src.type, dst.type)
    a = torch.empty(nbytes, dtype=torch.uint8, device=src, pin_memory=pin and src.type == "cpu")
    a.fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst, pin_memory=pin and dst.type == "cpu")
    t = _timeit(lambda: b.copy_(a, non_blocking=pin), reps, sync)
    return nbytes / t


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
