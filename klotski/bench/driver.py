"""`klotski bench`: the same job, model and memory budget through accelerate and Klotski's
schedule ladder, each run in its own process; medians, spreads, ratios, agreement, plots.

The run matrix lives in `benchmarks/bench_driver.py` (with the accelerate baseline it
drives), so this command needs the source checkout. This module only turns flags into
settings, prepares the model and the prompts, and writes the results.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from klotski.bench import gpu_preset
from klotski.util import cachedir
from klotski.util.writes import replacing

ROOT = Path(__file__).resolve().parents[2]  # the checkout (benchmarks/ beside klotski/)
SYSTEMS = ("accelerate", "simple", "multibatch", "hot-prefetch", "klotski")
# Budgets below the model size, so every system really offloads: (device, host), for the
# preset's own dtype; a preset built in a wider dtype gets a proportionally larger device
# budget so the same share of the model fits (medium: 900MB in bfloat16, 1800MB in float32).
BUDGETS = {"tiny": ("24MB", "256MB"), "small": ("48MB", "1GiB"), "medium": ("900MB", "8GiB"),
           "xl": ("4GiB", "8GiB")}
SHARDS = {"xl": 7}  # ~5 GB shards, as on the hub
XL_DISK_BYTES = 65e9  # the model (~32 GB) and accelerate's re-saved experts (~28 GB)
# Settings the flags default to. The fits-in-RAM presets compare everything, several times.
# xl (~32 GB, bigger than RAM) reads the SSD at every weight pass, so it keeps generations
# short, runs once, skips the n sweep and the emulated link (the disk is the slow link),
# reads with O_DIRECT, runs the single-batch systems on 2 batches, and gives accelerate
# the whole job as its batch (activations are tiny next to the budget; searching would
# reload 28 GB per candidate).
FITS_IN_RAM = dict(prompts=16, max_new_tokens=8, reps=3, emulate_link=2.0, ns="1,2,4", direct_io=False,
                   single_batch_prompts=None, accelerate_batch=None, dtype="float32", memory_limit="none",
                   cold_cache=False, systems=",".join(SYSTEMS), threads=1)
# disk: sized to the machine by benchmarks/common.py (size_disk_run) before anything is built:
# the model, both budgets, the job (prompts, prompt tokens, new tokens) and the threads; the
# comparison is Klotski against accelerate at the same batch size, decode steps only.
PRESET_DEFAULTS = {"tiny": FITS_IN_RAM, "small": FITS_IN_RAM, "medium": FITS_IN_RAM,
                   "xl": dict(prompts=64, max_new_tokens=4, reps=1, emulate_link=0.0, ns="", direct_io=True,
                              single_batch_prompts=8, accelerate_batch=64, dtype="bfloat16", memory_limit="auto",
                              cold_cache=True, systems=",".join(SYSTEMS), threads=1),
                   "disk": dict(reps=1, emulate_link=0.0, ns="", direct_io=True, dtype="float32", memory_limit="auto",
                                cold_cache=True, systems="accelerate,klotski"),
                   "gpu": {}}  # benchmarks/gpu_realdims.py sets its own (klotski/bench/gpu_preset.py)
RUNTIME_ALLOWANCE = 2 << 30  # interpreter, torch, transformers, activations: outside both tier budgets

LLAMA_CPP_NOTE = (
    "skipped: llama-cpp-python (0.3.36) is on the package index only as a source archive "
    "(76 MB, ~775 C/C++ files of llama.cpp built with CMake), too long to compile on this "
    "2-core machine within the session; and the converter it ships "
    "(vendor/llama.cpp/convert_hf_to_gguf.py) cannot convert the built-in checkpoints offline: "
    "it imports sentencepiece (not installed) and, past that, rejects their locally trained "
    "tokenizer ('BPE pre-tokenizer was not recognized'), so there is no GGUF of the same "
    "model to run even with the library built.")
ACCELERATE_LINK_NOTE = (
    "--emulate-link applies to Klotski only: accelerate's only transfer on a CPU-only machine is a "
    "memory-mapped read inside its forward hook, which has no throttle; slowing it would mean "
    "patching accelerate, no longer the stock system users run.")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="compare accelerate and Klotski's schedules on one job and budget (plots, JSON)",
        description="Run the same prompts, model and memory budget through transformers+accelerate "
                    "offloading and Klotski's schedules (simple, multibatch, hot-prefetch, klotski), each "
                    "in its own process, alternating, several repetitions; report medians, spreads, "
                    "ratios and whether all greedy outputs agree. Needs the source checkout (benchmarks/).")
    p.add_argument("--preset", default="medium", choices=tuple(PRESET_DEFAULTS),
                   help="built-in model size (default medium). xl (~32 GB, bigger than RAM, run by hand, "
                        "about an hour) changes the defaults marked 'xl:'. disk: the bigger-than-memory regime "
                        "sized to this machine (free disk, RAM, cores, disk and CPU speed; printed before "
                        "anything is built): a model at least twice the memory limit and at most half the "
                        "free disk, budgets the planner accepts, Klotski against accelerate at the same "
                        "batch size, decode steps only. gpu: real layer dimensions (Mixtral-8x7B, Qwen3-30B-A3B), "
                        "a 24 GiB-equivalent budget, the link held to --emulate-link (25), every system in its own "
                        "process; CUDA when present, else CPU at widths / 16 (benchmarks/gpu_realdims.py)")
    p.add_argument("--disk-shape", choices=("xl", "large", "medium"),
                   help="disk: the layer shape (default: the largest that fits the disk, RAM and --disk-minutes)")
    p.add_argument("--disk-layers", type=int, metavar="L",
                   help="disk: layers (default: the fewest that make the model twice the memory limit)")
    p.add_argument("--disk-minutes", type=float, default=30.0, metavar="M",
                   help="disk: the time one system may take, as estimated from the probes (default 30)")
    p.add_argument("--prompt-tokens", type=int, metavar="P",
                   help="cut every prompt to at most P tokens (default: whole; disk: sized to the CPU)")
    p.add_argument("--routing", default="skewed", choices=("uniform", "skewed"),
                   help="expert popularity of the built model (default: skewed, like real Mixtral)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="dtype the preset is built in (default float32: in bfloat16 transformers' and "
                        "Klotski's kernels round differently, so greedy tokens cannot be compared; "
                        "xl: bfloat16, as float32 would need 64 GB of disk)")
    p.add_argument("--model", metavar="DIR", help="bench this checkpoint instead of building a preset")
    p.add_argument("--jobs", default=str(ROOT / "jobs" / "wikitext.jsonl"),
                   help="prompt file; the first --prompts lines are used (default: jobs/wikitext.jsonl)")
    p.add_argument("--prompts", type=int, help="prompts per run (default 16; xl: 64)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt (default 8; xl: 4)")
    p.add_argument("--reps", type=int, help="measured repetitions after the warm-up (default 3; xl: 1)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="device budget (default: per preset and dtype; medium: 900MB bfloat16, 1800MB float32)")
    p.add_argument("--host-memory", metavar="SIZE", help="host budget (default: per preset, medium 8GiB)")
    p.add_argument("--emulate-link", type=float, metavar="GBPS",
                   help="also run the ladder with host->device throttled to GBPS GB/s (0 = skip; default 2; xl: 0)")
    p.add_argument("--threads", type=int,
                   help="torch threads of every process (default 1: on a shared 2-core box, all-core "
                        "OpenMP stalls whenever a neighbour runs; disk: the cores the load average leaves idle)")
    p.add_argument("--batch-size", metavar="B|auto",
                   help="Klotski's batch size; the planner chooses n for it (auto: the planner chooses both). "
                        "Default 4, as in the paper's ablation: with few prompts the planner's own bs would "
                        "leave a single batch, and n would mean nothing (gpu: the planner's)")
    p.add_argument("--systems", help=f"subset of {','.join(SYSTEMS)} (default: all; disk: accelerate,klotski)")
    p.add_argument("--ns", help="n sweep (batches per group); empty to skip (default 1,2,4; xl: empty)")
    p.add_argument("--sweep-schedules", default="klotski,multibatch", help="schedules swept over n")
    p.add_argument("--sweep-batch-size", type=int, default=4,
                   help="batch size of the sweep; a sweep point runs n x this many prompts as one group")
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction,
                   help="Klotski reads the checkpoint with O_DIRECT (default: page cache, like accelerate's "
                        "memory maps, since the model fits in RAM; xl: O_DIRECT, and the disk's own O_DIRECT "
                        "bandwidth is measured with dd to judge it against)")
    p.add_argument("--single-batch-prompts", type=int, metavar="K",
                   help="simple and accelerate at Klotski's batch size serve one batch per weight pass; run "
                        "them on the first K prompts only (default: all; xl: 8)")
    p.add_argument("--memory-limit", metavar="SIZE|auto|none",
                   help="run every system in a memory cgroup of SIZE, page cache included, so memory-mapped "
                        "reads get no more RAM than the budgets (auto: device + host + 2GiB; default none; "
                        "xl: auto)")
    p.add_argument("--cold-cache", action=argparse.BooleanOptionalAction,
                   help="drop the page cache before every run (root only; default off; xl: on)")
    p.add_argument("--accelerate-batch", type=int, metavar="B",
                   help="accelerate's best batch size, given instead of searched (default: searched; xl: 64)")
    p.add_argument("--out", metavar="JSON", help="results (default: benchmarks/results/bench-PRESET.json)")
    p.add_argument("--img-dir", default=str(ROOT / "docs" / "img"), help="where the PNG plots go")
    p.add_argument("--work-dir", help="keep per-run outputs, reports, logs and traces here (default: temporary)")
    gpu_preset.add_flags(p)
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="cpu (default): the ladder above, the link emulated; cuda: the GPU benchmark "
                        "(benchmarks/gpu.py: klotski, multibatch, simple and accelerate at a quarter of the model, "
                        "the link against the measured pinned-copy bandwidth)")
    return p


def gpu_bench(a) -> int:
    """`klotski bench --device cuda`: benchmarks/gpu.py with this command's preset, job size and output."""
    import subprocess
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--preset", a.preset, "--device", "cuda"]
    for flag, value in (("--prompts", a.prompts), ("--max-new-tokens", a.max_new_tokens), ("--reps", a.reps),
                        ("--out", a.out), ("--work-dir", a.work_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    return subprocess.call(cmd)


# --------------------------------------------------------------------------- model and prompts

def _stamp_ok(path: Path, preset: str, routing: str, dtype: str) -> bool:
    from klotski.builtin import tiny
    try:
        st = json.loads((path / tiny.STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (st.get("build_version"), st.get("preset"), st.get("routing"), st.get("dtype")) == \
        (tiny.BUILD_VERSION, preset, routing, dtype)


def ensure_model(preset: str, routing: str, dtype: str) -> Path:
    """The preset built with this routing and dtype, in the user cache (built once, atomically)."""
    from klotski.builtin import tiny
    final = cachedir.models() / f"{preset}-mixtral-{routing}-{dtype}"
    if _stamp_ok(final, preset, routing, dtype):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    need = XL_DISK_BYTES if preset == "xl" else 0
    free = shutil.disk_usage(final.parent).free
    if free < need:
        raise ValueError(f"{final.parent} has {free / 1e9:.0f} GB free; the xl bench needs about "
                         f"{need / 1e9:.0f} GB (model + accelerate's offload folder); free some space "
                         "or set XDG_CACHE_HOME to a larger disk")
    print(f"bench: building {final.name} into {final.parent}", file=sys.stderr, flush=True)
    with replacing(final) as tmp:
        tiny.build_checkpoint(tmp, preset, routing=routing, dtype=dtype, num_shards=SHARDS.get(preset, 1))
    return final


def ensure_disk_model(sizing: dict, routing: str) -> Path:
    """The disk preset's model as sized (layer shape, layers, float32), built once in the user
    cache; a disk model of another size is removed first (it was counted as free disk)."""
    from klotski.builtin import tiny
    from common import DISK_SHAPES
    base = DISK_SHAPES[sizing["shape"]][0]
    cache = cachedir.models()
    final = cache / f"disk-{sizing['shape']}-{sizing['layers']}l-mixtral-{routing}-{sizing['dtype']}"
    try:
        st = json.loads((final / tiny.STAMP_FILE).read_text())
        if (st.get("build_version"), st.get("preset"), st.get("routing"), st.get("dtype"), st.get("overrides")) == \
                (tiny.BUILD_VERSION, base, routing, sizing["dtype"], sizing["config_fields"]):
            return final
    except (OSError, ValueError):
        pass
    for old in _disk_models(cache):
        print(f"bench: removing {old.name} (another size of the disk model)", file=sys.stderr, flush=True)
        shutil.rmtree(old, ignore_errors=True)
    print(f"bench: building {final.name} ({sizing['model_bytes'] / 1e9:.2f} GB) into {cache}", file=sys.stderr,
          flush=True)
    with replacing(final) as tmp:
        tiny.build_checkpoint(tmp, base, routing=routing, dtype=sizing["dtype"],
                              num_shards=max(1, round(sizing["model_bytes"] / 2e9)), **sizing["config_fields"])
    return final


def _disk_models(cache: Path) -> list[Path]:
    """Every disk model in the cache, and what a killed build of one left (util.writes'
    temporaries are hidden: a dot, then the model's name)."""
    return [*cache.glob("disk-*"), *cache.glob(".disk-*")]


def _engine_compute(rung: str, threads: int):
    """The compute model of the disk sizing: the planner's profile of the engine's own ops for
    one layer of `rung`, timed on `threads` threads as the runs will use (cached in the user
    cache; the first run of a new size times its own shape again)."""
    import torch

    import common
    from klotski.assemble import pipeline_cost
    from klotski.planning import measure_here
    shape, _ = common.disk_shape(rung, 1)
    print(f"bench: disk regime: timing the engine's ops on one {rung} layer, {threads} thread(s) "
          "(the planner's profile)", file=sys.stderr, flush=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return common.planner_compute(measure_here(shape, device="cpu", pipeline_cost=pipeline_cost), shape)
    finally:
        torch.set_num_threads(before)


def disk_settings(a) -> dict:
    """`--preset disk`: probe the machine, size the run (benchmarks/common.py), print it, and
    fill every flag left unset from it; nothing is built yet. Raises common.DiskRegimeRefused."""
    import common
    from klotski.config import parse_size
    cache = cachedir.models()
    cache.mkdir(parents=True, exist_ok=True)
    old = sum(f.stat().st_size for d in _disk_models(cache) for f in d.rglob("*") if f.is_file())
    why = common.regime_controls()
    if why:
        raise common.DiskRegimeRefused(f"the disk regime needs {why}")
    machine, probes = common.probe_machine(cache, reclaimable=old)
    bs = 4 if a.batch_size in (None, "auto") else int(a.batch_size)
    sizing = common.size_disk_run(machine, shape=a.disk_shape, layers=a.disk_layers, bs=bs,
                                  minutes=a.disk_minutes, threads=a.threads, compute=_engine_compute)
    mib = lambda x: f"{x >> 20}MiB"  # the sizing rounds budgets up to whole MiB
    sized = {"prompts": sizing["prompts"], "max_new_tokens": sizing["max_new_tokens"], "threads": sizing["threads"],
             "prompt_tokens": sizing["prompt_tokens"], "single_batch_prompts": bs, "accelerate_batch": bs,
             "device_memory": mib(sizing["device_memory"]), "host_memory": mib(sizing["host_memory"]),
             "batch_size": str(bs), "disk_shape": sizing["shape"], "disk_layers": sizing["layers"]}
    for key, value in sized.items():
        if getattr(a, key) is None or key == "batch_size":
            setattr(a, key, value)
    gb, gib = 1e9, 2**30
    limit = parse_size(a.device_memory) + parse_size(a.host_memory) + common.RUNTIME_ALLOWANCE
    print(f"bench: disk regime, this machine: {machine.free_disk_bytes / gb:.0f} GB free disk at {cache}, "
          f"{machine.ram_bytes / gib:.1f} GiB RAM, {machine.cores} cores (load {machine.load:.1f}), O_DIRECT read "
          f"{machine.disk_gbps} GB/s, float32 matmul {machine.core_gflops} GFLOP/s per core\n"
          f"bench: disk regime, sized: {sizing['shape']} layers x {sizing['layers']} in {sizing['dtype']} = "
          f"{sizing['model_bytes'] / gb:.2f} GB (memory limit {limit / gib:.2f} GiB = device "
          f"{a.device_memory} + host {a.host_memory} + {common.RUNTIME_ALLOWANCE >> 30} GiB runtime); "
          f"{a.prompts} prompts of at most {a.prompt_tokens} tokens, {a.max_new_tokens} new tokens, bs {bs}, "
          f"{a.threads} threads, decode-only tokens/s; a decode step computes in about "
          f"{sizing['decode_step_compute_s']:.1f} s and reads in {sizing['read_s']:.1f} s; "
          f"about {sizing['estimate_s']['klotski'] / 60:.0f} min "
          f"(klotski) and {sizing['estimate_s']['accelerate'] / 60:.0f} min (accelerate)", file=sys.stderr, flush=True)
    return {"machine": dataclasses.asdict(machine), "probes": probes, "sizing": sizing}


def read_prompts(path: str) -> list[dict]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if "prompt" in rec:
                out.append({"id": str(rec.get("id", len(out) + 1)), "prompt": rec["prompt"]})
    return out


# --------------------------------------------------------------------------- main

def default_budgets(preset: str, dtype: str | None) -> tuple[str, str]:
    from klotski.builtin import tiny
    from klotski.config import parse_size
    device, host = BUDGETS.get(preset, BUDGETS["medium"])
    native = tiny.PRESETS.get(preset, tiny.PRESETS["medium"])["dtype"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}
    scale = width.get(dtype or native, 2) / width.get(native, 2)
    return (device if scale == 1 else f"{round(parse_size(device) * scale / 1e6)}MB"), host


def fill_preset_defaults(a) -> None:
    """Flags left unset take the preset's defaults (a --model run takes the fits-in-RAM ones)."""
    defaults = FITS_IN_RAM if a.model and a.preset == "disk" else PRESET_DEFAULTS[a.preset]
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def settings_from_args(a) -> dict:
    fill_preset_defaults(a)
    systems = _csv(a.systems)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"--systems: unknown {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    ns = [int(x) for x in _csv(a.ns)]
    if any(n < 1 for n in ns) or a.prompts < 1 or a.reps < 1 or a.max_new_tokens < 1 or a.threads < 1:
        raise ValueError("--ns, --prompts, --reps, --max-new-tokens and --threads must be at least 1")
    preset = a.preset if not a.model else "custom"
    device, host = default_budgets(a.preset, a.dtype if not a.model else None)
    batch_size = None if a.batch_size == "auto" else int(a.batch_size or 4)
    if batch_size is not None and batch_size < 1:
        raise ValueError("--batch-size must be at least 1 or auto")
    return {
        "preset": preset, "routing": a.routing if not a.model else None, "dtype": a.dtype if not a.model else None,
        "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "reps": a.reps, "batch_size": batch_size,
        "device_memory": a.device_memory or device, "host_memory": a.host_memory or host,
        "link_gbps": a.emulate_link or None, "threads": a.threads, "systems": systems, "ns": ns,
        "sweep_schedules": _csv(a.sweep_schedules), "sweep_batch_size": a.sweep_batch_size,
        "direct_io": a.direct_io, "jobs_source": a.jobs,
        "single_batch_prompts": a.single_batch_prompts, "accelerate_batch": a.accelerate_batch,
        "memory_limit": a.memory_limit, "cold_cache": a.cold_cache, "prompt_tokens": a.prompt_tokens,
        "memory_limit_bytes": memory_limit_bytes(a.memory_limit, a.device_memory or device, a.host_memory or host),
    }


def memory_limit_bytes(text: str, device: str, host: str) -> int | None:
    from klotski.config import parse_size
    if text == "none":
        return None
    if text == "auto":
        return parse_size(device) + parse_size(host) + RUNTIME_ALLOWANCE
    return parse_size(text)


def command_line(s: dict, a) -> str:
    """The exact command that reproduces these results (every default spelled out)."""
    parts = ["klotski", "bench"]
    parts += ["--model", a.model] if a.model else ["--preset", s["preset"], "--routing", s["routing"], "--dtype", s["dtype"]]
    parts += ["--prompts", s["prompts"], "--max-new-tokens", s["max_new_tokens"], "--reps", s["reps"],
              "--device-memory", s["device_memory"], "--host-memory", s["host_memory"],
              "--batch-size", s["batch_size"] or "auto", "--emulate-link", s["link_gbps"] or 0, "--threads", s["threads"], "--systems", ",".join(s["systems"]),
              "--ns", ",".join(map(str, s["ns"])), "--sweep-schedules", ",".join(s["sweep_schedules"]),
              "--sweep-batch-size", s["sweep_batch_size"]]
    parts.append("--direct-io" if s["direct_io"] else "--no-direct-io")
    for flag, key in (("--single-batch-prompts", "single_batch_prompts"), ("--accelerate-batch", "accelerate_batch")):
        if s[key]:
            parts += [flag, s[key]]
    parts += ["--memory-limit", s["memory_limit"], "--cold-cache" if s["cold_cache"] else "--no-cold-cache"]
    if s["prompt_tokens"]:
        parts += ["--prompt-tokens", s["prompt_tokens"]]
    if s["preset"] == "disk":
        parts += ["--disk-shape", a.disk_shape, "--disk-layers", a.disk_layers, "--disk-minutes", a.disk_minutes]
    return shlex.join(map(str, parts))


def _display_path(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main(a) -> int:
    bench_dir = ROOT / "benchmarks"
    if a.preset == "gpu":
        return gpu_preset.run(a)
    if a.device == "cuda" and (bench_dir / "gpu.py").exists():
        return gpu_bench(a)
    if not (bench_dir / "bench_driver.py").exists():
        print(f"klotski: error: bench needs the source checkout ({bench_dir} not found); "
              "run it from a clone of the repository", file=sys.stderr)
        return 2
    for d in (bench_dir, bench_dir / "baselines"):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    import bench_driver
    import bench_plots
    import bench_runner
    import common

    disk = a.preset == "disk" and not a.model
    try:
        sized = disk_settings(a) if disk else None
        s = settings_from_args(a)
        if disk and s["memory_limit_bytes"] and sized["sizing"]["model_bytes"] < 2 * s["memory_limit_bytes"]:
            raise ValueError(f"the disk regime's model ({sized['sizing']['model_bytes'] / 1e9:.2f} GB) must be at "
                             f"least twice the memory limit ({s['memory_limit_bytes'] / 2**30:.2f} GiB); give "
                             "smaller budgets or more --disk-layers")
        s["model_dir"] = str(Path(a.model).expanduser() if a.model else
                             ensure_disk_model(sized["sizing"], a.routing) if disk else
                             ensure_model(a.preset, a.routing, a.dtype))
        pool, checked = common.prepare_prompts(read_prompts(a.jobs), Path(s["model_dir"]), s)
    except ValueError as e:  # common.DiskRegimeRefused among them
        print(f"klotski: error: {e}", file=sys.stderr)
        return 2
    if disk:
        s["disk_regime"] = {**sized, **checked}
    s["command"] = command_line(s, a)
    shards = sorted(Path(s["model_dir"]).glob("*.safetensors"))
    s["model_bytes"] = sum(f.stat().st_size for f in shards)
    machine, code = bench_runner.machine_info(), bench_runner.code_state()
    # The regime is what the processes may use: RAM, or less under a memory cgroup.
    room = min(machine["ram_bytes"] or 0, s["memory_limit_bytes"] or machine["ram_bytes"] or 0)
    s["bigger_than_ram"] = s["model_bytes"] > room
    if s["direct_io"]:  # the physical limit O_DIRECT reads are judged against
        s["disk_read"] = {"start": bench_runner.disk_read_samples(shards)}
        s["disk_read_gbps"] = bench_runner.median_gbps(s["disk_read"]["start"])
        print(f"bench: disk read bandwidth (dd, O_DIRECT, median of 3): {s['disk_read_gbps']} GB/s", file=sys.stderr)
    need = max([s["prompts"]] + [n * s["sweep_batch_size"] for n in s["ns"]])
    if need > len(pool):
        print(f"klotski: error: {a.jobs} has {len(pool)} prompts, the runs need {need}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"bench-{s['preset']}.json"
    keep = a.work_dir is not None
    work = Path(a.work_dir) if keep else Path(tempfile.mkdtemp(prefix="klotski-bench-"))
    print(f"bench: {s['command']}\nbench: model {s['model_dir']} ({s['model_bytes'] / 1e9:.2f} GB), "
          f"work dir {work}", file=sys.stderr, flush=True)
    try:
        try:
            results = bench_driver.run({**s, "prompt_pool": pool, "work_dir": str(work)})
        except RuntimeError as e:  # a planning run failed: nothing to compare against
            print(f"klotski: error: {e}", file=sys.stderr)
            return 1
        machine["loadavg_at_end"] = bench_runner.machine_info()["loadavg_at_start"]
        if s["direct_io"]:  # the limit again after the run; ratios use the median of all samples
            s["disk_read"]["end"] = bench_runner.disk_read_samples(shards)
            s["disk_read_gbps"] = bench_runner.median_gbps(s["disk_read"]["start"] + s["disk_read"]["end"])
        results["ratios"] = bench_driver.ratios(results["systems"], s)
        end = bench_runner.code_state()
        code = {"at_start": code, "at_end": end, "changed_during_run": end["source_sha256"] != code["source_sha256"]}
        if code["changed_during_run"]:
            print("bench: warning: the engine's sources changed during the run; results mix versions",
                  file=sys.stderr)
        results = {"schema": 1, "created": time.strftime("%Y-%m-%d %H:%M"), "machine": machine, "code": code,
                   "settings": s, **results,
                   "skipped": [{"system": "llama.cpp", "reason": LLAMA_CPP_NOTE}],
                   "notes": [ACCELERATE_LINK_NOTE]}
        if not keep:  # the trace is gone with the work dir; the timeline window is in the JSON
            for p in results["plans"].values():
                p["trace"] = None
        plots = bench_plots.make_all(results, Path(a.img_dir), f"bench-{s['preset']}")
        results["plots"] = {k: _display_path(v) for k, v in plots.items()}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(summary(results), file=sys.stderr)
    print(f"bench: results {_display_path(out)}; plots {', '.join(results['plots'].values())}", file=sys.stderr)
    ok = not results["failures"] and results["agreement"]["all_identical"]
    return 0 if ok else 1


def summary(results: dict) -> str:
    lines = [f"{'config':24s} {'tok/s':>9s} {'min-max':>17s} {'bs':>4s} {'n':>3s} {'bubble':>7s} "
             f"{'decode tok/s':>12s} {'decode disk GB/s':>16s}"]
    for key, d in results["systems"].items():
        m, lo, hi = d["median"], d["min"], d["max"]
        if "tokens_per_s" not in m:
            lines.append(f"{key:24s} {'failed':>9s}")
            continue
        bub = m.get("bubble_share")
        lines.append(f"{key:24s} {m['tokens_per_s']:9.2f} {lo['tokens_per_s']:8.2f}-{hi['tokens_per_s']:<8.2f} "
                     f"{d['batch_size']:4d} {d['num_batches'] or 1:3d} {'' if bub is None else f'{bub:6.1%}':>7s} "
                     f"{_num(m.get('decode_tokens_per_s')):>12s} {_num(m.get('decode_read_gb_per_s')):>16s}")
    for r in results["ratios"]:
        lines.append(f"ratio {r['name']}: {r['value']}" + (f" (target {r['target']})" if r["target"] else ""))
    ag = results["agreement"]
    lines.append("outputs: all identical" if ag["all_identical"]
                 else f"outputs: {len(ag['disagreements'])} runs disagree with {ag['reference']}")
    lines.append(f"elapsed {results['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":  # `python -m klotski.bench.driver ...` works before the CLI is wired
    _parser = argparse.ArgumentParser(prog="klotski")
    add_parser(_parser.add_subparsers(dest="command"))
    sys.exit(main(_parser.parse_args(["bench", *sys.argv[1:]])))
