"""One benchmark run = one child process, measured from outside, turned into one metrics row.

Every system runs in a fresh process so no run inherits another's warm allocator,
page-table or thread-pool state, and so that peak RSS is per run: `os.wait4` returns the
rusage of exactly the child it reaps (RUSAGE_CHILDREN deltas would mix every child
this driver ever waited for).

The two systems write different reports (Klotski's `--report`, accelerate_run.py's
report); `klotski_row` and `accelerate_row` map both onto the same metric names so the
driver, the plots and the Markdown never care which system produced a row.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_RUN = ROOT / "benchmarks" / "baselines" / "accelerate_run.py"

# Which channels carry which link: achieved bandwidth = bytes on the link / the busy time
# of the channels that moved them (busy, not wall, so an idle link does not dilute it).
LINK_CHANNELS = {"host_to_device": ("weights", "experts", "kv_load"),
                 "device_to_host": ("kv_store",),
                 "disk_to_host": ("disk",)}


def child_env(threads: int) -> dict:
    """The environment of every child: same intra-op thread count for all systems.

    OMP/MKL variables are read by torch at start-up, which is the only way to pin a
    `klotski generate` process without a flag; accelerate_run.py also gets --threads.
    """
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_process(cmd: list[str], *, env: dict, log: Path, memory_limit: int | None = None,
                cold_cache: bool = False) -> dict:
    """Run cmd to completion; exit code, wall seconds and the child's own peak RSS.

    memory_limit: run the child in a memory cgroup of that size. The kernel charges a
    cgroup for its page cache too, so a system reading through memory maps gets no more
    RAM than one reading with O_DIRECT: the same budget for everyone, not just for the
    tensors each system admits to. cold_cache: drop the page cache first (needs root), so
    no run inherits the disk reads of the one before."""
    dropped = drop_page_cache() if cold_cache else None
    group = MemoryGroup(memory_limit) if memory_limit else None
    t0 = time.perf_counter()
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    preexec_fn=group.join if group else None)
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            except BaseException:  # Ctrl-C: do not leave a multi-GB child behind
                proc.kill()
                proc.wait()
                raise
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        result = {"returncode": proc.returncode, "process_wall_s": time.perf_counter() - t0,
                  "peak_rss_bytes": usage.ru_maxrss * 1024,  # KiB on Linux
                  "cpu_s": usage.ru_utime + usage.ru_stime}
        if cold_cache:
            result["page_cache_dropped"] = dropped  # False without root: the run was not cold
        if group:
            result["peak_cgroup_bytes"] = group.peak()  # RSS + page cache charged to the run
            result["memory_limit_bytes"] = memory_limit
        return result
    finally:
        if group:
            group.remove()


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


class MemoryGroup:
    """A fresh memory cgroup (v1 `memory` controller or v2) under this process's own, with a
    hard limit that covers page cache. Raises OSError where cgroups cannot be written."""

    def __init__(self, limit: int):
        v1 = v2 = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            elif controllers == "":
                v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
        parent = v1 if v1 and v1.is_dir() else v2
        if parent is None or not parent.is_dir():
            raise OSError("no writable memory cgroup found")
        self.v1 = parent == v1
        self.path = parent / f"klotski-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))

    def join(self) -> None:  # runs in the child between fork and exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        try:
            return int((self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        try:
            if self.v1:  # reclaim its page cache instead of leaving it charged to the parent
                (self.path / "memory.force_empty").write_text("0")
            self.path.rmdir()
        except OSError:
            pass


def tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------- commands

# --------------------------------------------------------------------------- disk reads during decode

def read_bytes() -> int:
    """Bytes this process (all its threads) had the block layer fetch for it: O_DIRECT reads
    and page faults on memory-mapped files alike, page-cache hits not at all."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise OSError("/proc/self/io has no read_bytes")


def count_reads(cls, name: str, acc: dict, *, counts=lambda kwargs: True) -> None:
    """Wrap method `name` of `cls` so the bytes read (read_bytes) and seconds spent inside the
    calls that `counts` (from their keyword arguments) add up in acc["bytes"], acc["s"]."""
    inner = getattr(cls, name)

    def wrapped(*args, **kwargs):
        if not counts(kwargs):
            return inner(*args, **kwargs)
        b0, t0 = read_bytes(), time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc["bytes"] += read_bytes() - b0
            acc["s"] += time.perf_counter() - t0
            acc["calls"] += 1
    setattr(cls, name, wrapped)


def with_io_probe(cmd: list[str], out: Path) -> list[str]:
    """`cmd` (a `klotski generate` or accelerate_run.py command) run under `probe_main`, which
    writes the disk bytes the process read during decode to `out`."""
    return [cmd[0], str(Path(__file__).resolve()), "--io-probe", str(out), *cmd[1:]]


def probe_main(out: str, argv: list[str]) -> int:
    """Run a system in this process with its decode phase instrumented, exactly where its own
    report times decode: Klotski's `Engine.step` when it decodes (Stats.record_step adds those
    seconds to decode_s); accelerate_run.py from the first logits call of a generate (its
    StepClock: prefill has ended) to the last (no forward follows it)."""
    import runpy
    acc = {"bytes": 0, "s": 0.0, "calls": 0}
    settle = lambda: None
    if argv[:2] == ["-m", "klotski.cli"]:
        from klotski.schedule.engine import Engine
        count_reads(Engine, "step", acc, counts=lambda kw: kw.get("decode") is not None)
        sys.argv = ["klotski", *argv[2:]]
        target = lambda: runpy.run_module("klotski.cli", run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        import accelerate_run
        clock_call, clocks = accelerate_run.StepClock.__call__, []

        def clocked(self, input_ids, scores):
            now = (read_bytes(), time.perf_counter())
            if self.first is None:  # one clock per generate: [first call, last call]
                self.probe = [now, now]
                clocks.append(self)
            else:
                self.probe[1] = now
            return clock_call(self, input_ids, scores)

        def settle():
            for c in clocks:
                (b0, t0), (b1, t1) = c.probe
                acc["bytes"], acc["s"], acc["calls"] = acc["bytes"] + b1 - b0, acc["s"] + t1 - t0, acc["calls"] + 1
        accelerate_run.StepClock.__call__ = clocked
        target = lambda: accelerate_run.main(argv[1:])
    try:
        code = target()
    except SystemExit as e:
        code = e.code
    finally:
        settle()
        Path(out).write_text(json.dumps({"decode_read_bytes": acc["bytes"], "decode_probe_s": round(acc["s"], 4),
                                         "decode_probe_calls": acc["calls"], "read_bytes_total": read_bytes()}))
    return code if isinstance(code, int) else (0 if code is None else 1)


def klotski_cmd(*, model, jobs, out, report, schedule, batch_size=None, num_batches=None,
                max_new_tokens, device_memory, host_memory, link_gbps=None, direct_io=False,
                trace=None) -> list[str]:
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "--model", str(model),
           "-o", str(out), "--report", str(report), "--include-token-ids", "--no-progress",
           "--no-resume", "--schedule", schedule, "--max-new-tokens", str(max_new_tokens),
           "--device-memory", device_memory, "--host-memory", host_memory,
           "--num-batches", str(num_batches) if num_batches else "auto"]
    if batch_size:  # without it the planner chooses
        cmd += ["--batch-size", str(batch_size)]
    if link_gbps:
        cmd += ["--emulate-link", str(link_gbps)]
    if not direct_io:
        cmd.append("--no-direct-io")
    if trace:
        cmd += ["--trace", str(trace)]
    return cmd


def accelerate_cmd(*, model, jobs, out, report, batch_size, max_new_tokens, device_memory,
                   host_memory, offload, threads) -> list[str]:
    return [sys.executable, str(ACCELERATE_RUN), "--model", str(model), "--jobs", str(jobs),
            "--out", str(out), "--report", str(report), "--batch-size", str(batch_size),
            "--max-new-tokens", str(max_new_tokens), "--max-memory-device", device_memory,
            "--max-memory-cpu", host_memory, "--offload-folder", str(offload),
            "--threads", str(threads)]


# --------------------------------------------------------------------------- metrics rows

def decode_rates(generated: int, sequences: int, decode_s: float, proc: dict) -> dict:
    """Decode-only figures: every sequence's first token comes from its prefill, the rest from
    decode steps; the disk bytes the process read while decoding (the io probe) per second."""
    nbytes = proc.get("decode_read_bytes")
    return {"decode_tokens_per_s": round((generated - sequences) / decode_s, 3) if decode_s else None,
            "decode_read_gb_per_s": round(nbytes / decode_s / 1e9, 4) if decode_s and nbytes is not None else None}


def _per_group(total: float, groups: int) -> float:
    return total / groups if groups else 0.0


def klotski_row(report: dict, proc: dict) -> dict:
    plan, io = report["plan"], report["io"]
    served = report["requests"]["ok"]
    # The planner's batch size can exceed the job; the batches actually run are what count.
    bs, n_plan = min(plan["batch_size"], max(served, 1)), plan["num_batches"]
    batches = math.ceil(served / bs) if bs else 0
    n = max(1, min(n_plan, batches))  # the planner may ask for more batches than the job has
    groups = math.ceil(batches / n) if batches else 0
    busy = io.get("busy_s", {})
    links = {}
    for link, nbytes in io.get("bytes", {}).items():
        secs = sum(busy.get(c, 0.0) for c in LINK_CHANNELS.get(link, ()))
        links[link] = {"bytes": nbytes, "busy_s": round(secs, 4),
                       "gb_per_s": round(nbytes / secs / 1e9, 3) if secs else None}
    gen_s = report["prefill_s"] + report["decode_s"]
    return {
        "tokens_per_s": report["tokens_per_s"],
        **decode_rates(report["tokens"]["generated"], served, report["decode_s"], proc),
        "predicted_tokens_per_s": report.get("predicted_tokens_per_s"),
        "generated_tokens": report["tokens"]["generated"],
        "prefill_s": report["prefill_s"], "decode_s": report["decode_s"],
        # Every sequence of a group gets its first token when the group's prefill ends and
        # its last when the group ends, so per-group means are TTFT and request latency.
        "ttft_s": round(_per_group(report["prefill_s"], groups), 4),
        "latency_s": round(_per_group(gen_s, groups), 4),
        "wall_s": report["wall_s"],
        "batch_size": bs, "batch_size_planned": plan["batch_size"],
        "num_batches": n, "num_batches_planned": n_plan, "groups": groups,
        "requests": served,
        "peak_device_bytes": report["memory"]["peak_device_bytes"],
        "budget_device_bytes": report["memory"]["budget_device_bytes"],
        "budget_host_bytes": report["memory"].get("budget_host_bytes"),
        "links": links,
        "busy_s": busy,
        "bubble_s": report["bubble"]["seconds"], "bubble_share": report["bubble"]["share"],
        "experts_loaded": io.get("experts_loaded"),
        "decode_disk_gb_per_s": io.get("decode_disk_gb_per_s"),
        "prefetch_precision": report.get("prefetch", {}).get("precision"),
        "placement": plan.get("placement"),
        **proc,
    }


def accelerate_row(report: dict, proc: dict) -> dict:
    placement = report.get("device_map_summary", {})
    disk_bytes = placement.get("param_bytes", {}).get("disk", 0)
    batches = report["num_batches"]
    steps = batches * report["max_new_tokens"]
    return {
        "tokens_per_s": report["tokens_per_s"],
        **decode_rates(report["generated_tokens"], report["requests"]["ok"], report["decode_s"], proc),
        "predicted_tokens_per_s": None,
        "generated_tokens": report["generated_tokens"],
        "prefill_s": report["prefill_s"], "decode_s": report["decode_s"],
        "ttft_s": round(_per_group(report["prefill_s"], batches), 4),
        "latency_s": round(_per_group(report["generate_s"], batches), 4),
        "wall_s": report["wall_s"],
        "batch_size": report["batch_size"], "num_batches": 1, "num_batches_planned": None,
        "groups": batches, "requests": report["requests"]["ok"],
        # accelerate's "device" tier here is the weights it keeps as CPU tensors.
        "peak_device_bytes": report.get("resident_weight_bytes"),
        "budget_device_bytes": report["max_memory"]["device"],
        "budget_host_bytes": report["max_memory"]["cpu"],
        # Not instrumented: offloaded modules are memory-mapped inside the forward hook. The
        # upper bound is every disk weight mapped once per forward (padding steps included).
        "links": {"disk_mmap_upper_bound": {"bytes": disk_bytes * steps, "busy_s": None, "gb_per_s": None}},
        "busy_s": {},
        "bubble_s": None, "bubble_share": None,
        "experts_loaded": None, "prefetch_precision": None,
        "placement": {"param_bytes": placement.get("param_bytes"), "modules": placement.get("modules")},
        "load_s": report.get("load_s"),
        "budget_used_bytes": report.get("budget_used_bytes"),
        **proc,
    }


def read_report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def disk_read_gbps(path: Path, nbytes: int = 2 << 30) -> dict:
    """The disk's sequential read bandwidth with the page cache bypassed, as `dd iflag=direct`
    measures it: the physical limit the bigger-than-RAM regime is judged against."""
    import re
    size = Path(path).stat().st_size
    block = 64 << 20
    count = max(1, min(nbytes, size) // block)
    cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", proc.stderr)
    if proc.returncode != 0 or not m:
        return {"command": " ".join(cmd), "gb_per_s": None, "error": proc.stderr.strip()[-300:]}
    return {"command": " ".join(cmd), "bytes": int(m.group(1)), "seconds": float(m.group(2)),
            "gb_per_s": round(int(m.group(1)) / float(m.group(2)) / 1e9, 3)}


def disk_read_samples(files: list[Path], count: int = 3) -> list[dict]:
    """`disk_read_gbps` on the `count` largest files: one 2 GB read swings from 1.0 to 1.7
    GB/s on this shared disk, so a single sample is not a limit to judge against."""
    largest = sorted(files, key=lambda f: f.stat().st_size, reverse=True)[:count]
    return [disk_read_gbps(f) for f in largest]


def median_gbps(samples: list[dict]) -> float | None:
    import statistics
    rates = [x["gb_per_s"] for x in samples if x.get("gb_per_s")]
    return round(statistics.median(rates), 3) if rates else None


def machine_info() -> dict:
    """What the numbers were measured on, from /proc and the installed packages."""
    import platform
    import re

    def grab(path: str, pattern: str) -> str | None:
        try:
            m = re.search(pattern, Path(path).read_text(), re.M)
        except OSError:
            return None
        return m.group(1).strip() if m else None

    versions = {}
    for mod in ("torch", "transformers", "accelerate"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    mem_kib = grab("/proc/meminfo", r"^MemTotal:\s+(\d+) kB")
    load = grab("/proc/loadavg", r"^(\S+ \S+ \S+)")
    return {"cpu": grab("/proc/cpuinfo", r"^model name\s*:\s*(.+)$"), "cores": os.cpu_count(),
            "ram_bytes": int(mem_kib) * 1024 if mem_kib else None, "kernel": platform.release(),
            "python": platform.python_version(), **versions,
            "loadavg_at_start": load}


def code_state() -> dict:
    """Commit and a hash of the engine's sources: a run that straddles a code change shows it."""
    import hashlib

    def git(*args) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    # What runs during a measurement: the engine and the baseline/driver scripts (not the
    # plotting or report code, nor other benchmark scripts that may change alongside).
    files = [f for pkg in ("klotski", "planner", "placement", "benchmarks/baselines") for f in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / "benchmarks" / "bench_driver.py", ROOT / "benchmarks" / "bench_runner.py"]
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    dirty = git("status", "--porcelain", "--", "klotski", "planner", "placement", "benchmarks")
    return {"commit": git("rev-parse", "--short", "HEAD"), "source_sha256": h.hexdigest()[:16],
            "uncommitted": dirty.splitlines() if dirty else []}


if __name__ == "__main__" and sys.argv[1:2] == ["--io-probe"]:  # with_io_probe's commands
    sys.exit(probe_main(sys.argv[2], sys.argv[3:]))
