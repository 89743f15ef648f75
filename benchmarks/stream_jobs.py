"""Issue 20: a job file of millions of lines, streamed. Measures, on the built-in tiny model:

  * time from start to the first record, resident memory (VmRSS from /proc) after 60 s, after
    300 s and when the run is killed, records per second — for a big job and, beside it, a small one;
  * the big job killed (SIGKILL) and rerun: time to the rerun's next new record, and a check
    that no id appears twice in the output;
  * a rerun where half of the big job is already finished (the finished records are written
    straight into the output file here, as a long earlier run would have left them): time to
    the next new record, memory, and again no id twice.

    python benchmarks/stream_jobs.py --lines 5000000 --small 20000 --run-s 120

Every run is cut short (SIGKILL) after --run-s seconds: the point is the start, the memory
and the resume, not finishing millions of lines. Results: benchmarks/results/stream_jobs.json
and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the river old mill stone bridge north village winter harvest quiet road small market "
         "bell tower green field long night bright morning").split()


def write_job(path: Path, lines: int) -> None:
    """`lines` prompts of a dozen words each, ids j0, j1, ..."""
    n = len(WORDS)
    with open(path, "w") as f:
        for start in range(0, lines, 10_000):
            f.write("".join(
                f'{{"id": "j{i}", "prompt": "{" ".join(WORDS[(i * 7 + k * 3) % n] for k in range(12))}"}}\n'
                for i in range(start, min(lines, start + 10_000))))


def write_finished(job_lines: int, out: Path, done: int) -> None:
    """Records for the first `done` ids, as klotski writes them (an earlier run's output)."""
    with open(out, "w") as f:
        for start in range(0, done, 10_000):
            f.write("".join(f'{{"id": "j{i}", "completion": " the", "finish_reason": "length", '
                            f'"prompt_tokens": 13, "completion_tokens": 1}}\n'
                            for i in range(start, min(done, start + 10_000))))


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def count_records(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def run_for(job: Path, out: Path, seconds: float, args, after_first: float | None = None, until=None) -> dict:
    """Start `klotski generate`, watch the output grow, SIGKILL it after `seconds` (or
    `after_first` seconds after its first new record, or once `until()` holds after it)."""
    before = count_records(out)
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(job), "-o", str(out), "--model", args.model,
           "--max-new-tokens", str(args.max_new_tokens), "--no-progress", "--window", str(args.window)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = rss60 = rss300 = None
    first_count = before
    peak = 0.0
    while proc.poll() is None:
        now = time.perf_counter() - t0
        rss = rss_mib(proc.pid)
        peak = max(peak, rss or 0)
        if first is None:
            n = count_records(out)
            if n > before:
                first, first_count = now, n
        if rss60 is None and now >= 60:
            rss60 = rss
        if rss300 is None and now >= 300:
            rss300 = rss
        if now >= seconds or (after_first is not None and first is not None and now >= first + after_first):
            break
        if until is not None and first is not None and until():
            break
        time.sleep(0.05 if first is None else 0.5)
    end = time.perf_counter() - t0
    rss_end = rss_mib(proc.pid)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    stderr = proc.stderr.read().decode(errors="replace")
    after = count_records(out)
    rate = (after - first_count) / (end - first) if first is not None and end > first else None
    return {"command": " ".join(cmd[1:]), "first_record_s": round(first, 2) if first is not None else None,
            "rss_mib_60s": round(rss60, 1) if rss60 else None,
            "rss_mib_300s": round(rss300, 1) if rss300 else None, "rss_mib_end": round(rss_end, 1) if rss_end else None,
            "rss_mib_peak": round(peak, 1), "ran_s": round(end, 1), "killed": killed,
            "records_before": before, "records_after": after,
            "records_per_s": round(rate, 1) if rate is not None else None,
            "stderr_tail": stderr.strip().splitlines()[-3:]}


def unique_ids(out: Path) -> tuple[int, int]:
    ids = []
    with open(out, "rb") as f:
        for line in f:
            obj = json.loads(line)
            ids.append(obj.get("custom_id", obj.get("id")))
    return len(ids), len(set(ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=5_000_000)
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--run-s", type=float, default=120, help="seconds each run is given before SIGKILL")
    p.add_argument("--rerun-s", type=float, default=120, help="most seconds a rerun is given")
    p.add_argument("--after-first-s", type=float, default=20, help="a rerun runs this long after its first record")
    p.add_argument("--model", default="tiny-mixtral")
    p.add_argument("--max-new-tokens", type=int, default=1)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--dir", default="/tmp/klotski-stream-bench")
    p.add_argument("--results", default=str(Path(__file__).parent / "results" / "stream_jobs.json"))
    p.add_argument("--resume-only", action="store_true",
                   help="only the half-done rerun: without a progress sidecar (the full pass), killed once it "
                        "has written one, then rerun with it")
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    big, small = d / f"big-{args.lines}.jsonl", d / f"small-{args.small}.jsonl"
    for path, n in ((big, args.lines), (small, args.small)):
        if not path.exists():
            t = time.perf_counter()
            write_job(path, n)
            print(f"wrote {path} ({n} lines, {path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s",
                  file=sys.stderr)
    res = {"machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
                      f"(shared), Python {platform.python_version()}",
           "lines": args.lines, "small_lines": args.small, "max_new_tokens": args.max_new_tokens,
           "window": args.window, "run_s": args.run_s}
    if args.resume_only:
        return resume_only(big, d, res, args)
    out_small, out_big, out_half = d / "small.out.jsonl", d / "big.out.jsonl", d / "half.out.jsonl"
    for f in (out_small, out_big, out_half):
        f.unlink(missing_ok=True)
    print("small job ...", file=sys.stderr)
    res["small"] = run_for(small, out_small, min(args.run_s, 70), args)
    print("big job ...", file=sys.stderr)
    res["big"] = run_for(big, out_big, args.run_s, args)
    print("big job rerun after SIGKILL ...", file=sys.stderr)
    res["big_rerun"] = run_for(big, out_big, args.rerun_s, args, args.after_first_s)
    total, distinct = unique_ids(out_big)
    res["big_rerun"]["records_total"], res["big_rerun"]["ids_distinct"] = total, distinct
    print("big job, half finished ...", file=sys.stderr)
    t = time.perf_counter()
    write_finished(args.lines, out_half, args.lines // 2)
    res["half_output_written_s"] = round(time.perf_counter() - t, 1)
    res["big_half_done_rerun"] = run_for(big, out_half, args.rerun_s, args, args.after_first_s)
    total, distinct = unique_ids(out_half)
    res["big_half_done_rerun"]["records_total"], res["big_half_done_rerun"]["ids_distinct"] = total, distinct
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


def resume_only(big: Path, d: Path, res: dict, args) -> None:
    """Half of the big job finished by an earlier run that left no sidecar: the rerun takes
    the full pass (as every rerun did before the sidecar) and writes a sidecar as it goes; it
    is killed once it has, and the next rerun starts from the sidecar's watermark."""
    import shutil
    out = d / "resume.out.jsonl"
    out.unlink(missing_ok=True)
    shutil.rmtree(d / "resume.out.jsonl.klotski-progress", ignore_errors=True)
    write_finished(args.lines, out, args.lines // 2)
    state = d / "resume.out.jsonl.klotski-progress" / "state.json"
    print("half-done rerun, full pass ...", file=sys.stderr)
    res["half_done_full_pass"] = run_for(big, out, args.rerun_s, args, until=state.exists)
    print("half-done rerun, from the sidecar ...", file=sys.stderr)
    res["half_done_sidecar"] = run_for(big, out, args.rerun_s, args, args.after_first_s)
    res["records_total"], res["ids_distinct"] = unique_ids(out)
    res["load_average"] = os.getloadavg()
    path = Path(args.results).with_name("stream_jobs_resume.json")
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
