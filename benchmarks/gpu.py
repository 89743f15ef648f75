"""GPU benchmark (issue 11): klotski vs multibatch vs simple vs transformers+accelerate, device budget
a quarter of the model.

Builds the preset's checkpoint once in --work-dir (`klotski make-tiny DIR --preset P --routing
skewed`), sets the device budget to --budget-fraction of its *.safetensors bytes (a schedule that
refuses it is rerun at the minimum its refusal names x1.02, and its row says so), times a pinned
256 MiB host->device copy (median of 5 after warm-up), then runs each system in its own
subprocess: one warm-up run of the klotski schedule (it fills the hardware-profile cache and the
expert-correlation table in ~/.cache/klotski, and its tokens are the agreement reference), then
--reps runs of each system, reported as medians. Per system: tok/s; decode tok/s (tokens after each
prompt's first / decode time); bubble share of the whole run and of decode steps only (both from
the report); host->device GB/s = bytes / busy time of the transfer
lanes, summed per lane ("busy") and as their union ("link": time the link was in use), the link
rate as % of pinned; peak device memory vs budget; prompts whose token ids equal the warm-up's.
Targets: klotski decode bubble <= 10%; host->device >= 80% of the pinned bandwidth.

On the GPU machine, from the project root (logs stay in WORK/PRESET/logs, WORK = --work-dir, default /tmp/klotski-gpu):
    bash .whl/run.sh python3 benchmarks/gpu.py --preset medium --out $OUT/gpu-medium.json
    bash .whl/run.sh python3 benchmarks/gpu.py --preset xl --timeout 900 --out $OUT/gpu-xl.json
CPU dry run (accelerate there is benchmarks/baselines/accelerate_run.py, the CPU baseline):
    python benchmarks/gpu.py --preset tiny --device cpu --prompts 4 --max-new-tokens 4 --systems klotski,multibatch,simple
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
from bench_runner import LINK_CHANNELS, accelerate_cmd, machine_info  # noqa: E402
from common import write_jobs  # noqa: E402
from planner.units import parse_size  # noqa: E402

SYSTEMS = ("klotski", "hot-prefetch", "multibatch", "simple", "accelerate")
H2D_LANES = LINK_CHANNELS["host_to_device"]  # weights, experts, kv_load: every channel putting bytes on the link
BUILD_TIMEOUT = 3600  # xl writes ~31 GB
TERM_GRACE_S = 30  # after SIGTERM at a time limit, for the run to write its report of the part that ran
# Segments that grow in place (what `klotski` sets for itself) in every child from its start: a
# child that caps its allocator initialises CUDA before `klotski.cli` could set it, and torch reads
# the setting once. A user's own setting wins.
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
       "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cap_allocator(cap: int | None) -> None:
    """This process's CUDA caching allocator capped to `cap` bytes (nothing without CUDA or a cap)."""
    import torch
    if cap and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
PINNED = """import json, statistics, sys, time, torch
dev, n = sys.argv[1], 256 << 20
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
src, dst = torch.ones(n, dtype=torch.uint8, pin_memory=dev == "cuda"), torch.empty(n, dtype=torch.uint8, device=dev)
def once():
    sync(); t = time.perf_counter(); dst.copy_(src, non_blocking=True); sync(); return time.perf_counter() - t
s = [once() for _ in range(7)][2:]  # two warm-up copies, then five timed
print(json.dumps({"gb_per_s": round(n / statistics.median(s) / 1e9, 3), "bytes": n, "seconds": s, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None, "cuda": torch.version.cuda}))"""


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--systems", default="klotski,multibatch,simple,accelerate")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/klotski-gpu"), help="checkpoints, logs, runs (per preset)")
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per subprocess (default 300)")
    ap.add_argument("--accelerate-child", type=Path, help=argparse.SUPPRESS)  # internal: the CUDA baseline
    a = ap.parse_args()
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if bad := set(a.systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(bad)}; choose from {', '.join(SYSTEMS)}")
    a.out = a.out or HERE / "results" / f"gpu-{a.preset}.json"
    a.work_dir /= a.preset  # checkpoint, jobs, logs and runs of this preset
    return a


def sh(cmd, log: Path, timeout: float) -> tuple[int | None, float, str]:
    """Run cmd with its output in log; (exit status, None on timeout; seconds; last log line)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        fh.write("$ " + shlex.join(map(str, cmd)) + "\n")
        fh.flush()
        proc = subprocess.Popen(list(map(str, cmd)), stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # SIGTERM first: klotski then reports the part that ran
            rc = None
            proc.terminate()
            try:
                proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    lines = [l for l in log.read_text(errors="replace").splitlines()[1:] if l.strip()]  # [0]: the command
    last = lines[-1][:2000] if lines else ""
    return rc, round(time.perf_counter() - t0, 2), last if rc is not None else f"timed out after {timeout:.0f} s: {last}"


def named_minimum(line: str) -> int | None:
    """The device budget a refusal asks for: '...; rerun with --device-memory 0.17MiB or more'."""
    m = re.search(r"--device-memory (\S+) or more", line)
    if not m and "device budget" in line:
        m = re.search(r"needs? (?:at least )?([0-9.]+ ?[KMGT]i?B)", line)
    return parse_size(m.group(1).replace(" ", "")) if m else None


def token_ids(path: Path) -> dict:
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    return {r["id"]: r["token_ids"] for r in recs if "token_ids" in r}


def agreement(ref: dict, mine: dict) -> dict:
    """Prompts whose token ids equal the reference's, and the mean number of leading tokens that do."""
    if not ref or not mine:
        return {"agree": None}
    prefix = [next((k for k, (x, y) in enumerate(zip(t, mine.get(i, []))) if x != y), min(len(t), len(mine.get(i, []))))
              for i, t in ref.items()]
    return {"agree": [sum(mine.get(i) == t for i, t in ref.items()), len(ref)],
            "agree_prefix_tokens": round(statistics.mean(prefix), 2)}


def link_busy(path: Path) -> float | None:
    """Seconds at least one host->device lane was busy (the union of their spans, from the trace)."""
    if not path.exists():
        return None
    ev = json.loads(path.read_text())["traceEvents"]
    lane = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M"}
    spans = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in ev
                   if e.get("ph") == "X" and lane.get(e["tid"]) in H2D_LANES)
    union, reach = 0.0, float("-inf")
    for s, e in spans:
        union, reach = union + max(0.0, e - max(s, reach)), max(reach, e)
    return union


def per_s(num, den, scale=1.0):
    return round(num / den / scale, 3) if num is not None and den else None


def launch(a, system, tag, budget, cmd, out, report) -> tuple[dict, dict | None]:
    """Run one system; its row so far and its report (None if it wrote none)."""
    for p in (out, report):  # a refused or failed run must not leave an older file to be read
        p.unlink(missing_ok=True)
    log = a.work_dir / "logs" / f"{system}-{tag}.log"
    rc, wall, last = sh(cmd, log, a.timeout)
    r = json.loads(report.read_text()) if report.exists() else None
    if r is not None and "error" in r:  # the engine's report of a run that stopped
        rc, last, r = rc or 1, r["error"], None
    partial = bool(r and r.get("stopped"))  # cut at its time limit: the figures are of the part that ran
    crash = re.search(r"details in (\S+\.txt)", last or "")
    if crash and Path(crash.group(1)).is_file():  # the traceback into the row's log: logs travel back, /tmp does not
        with open(log, "a") as fh:
            fh.write("\n" + Path(crash.group(1)).read_text(errors="replace"))
    row = {"system": system, "run": tag, "ok": r is not None, "error": last if rc != 0 else None, "returncode": rc,
           "budget_bytes": budget, "budget_raised": budget != a.budget, "wall_s": wall, "log": str(log), "output": str(out),
           "partial": partial}
    if r and "requests" in r:  # a generation's report (gpu_realdims' kernels probe writes another)
        gen, ok = r["tokens"]["generated"] if "tokens" in r else r["generated_tokens"], r["requests"]["ok"]
        row.update(tok_s=r["tokens_per_s"], decode_tok_s=per_s(gen - ok, r["decode_s"]), prefill_s=r["prefill_s"],
                   decode_s=r["decode_s"], generated_tokens=gen, requests=r["requests"])
    return row, r


def klotski_once(a, schedule: str, tag: str, budget: int, extra=(), launcher=None) -> dict:
    """One `klotski generate` run; `extra` flags are appended, `launcher` replaces
    `python -m klotski.cli` (gpu_realdims.py: the allocator capped first)."""
    base = a.work_dir / "runs" / f"{schedule}-{tag}"
    out, report, trace = (base.with_suffix(s) for s in (".out.jsonl", ".report.json", ".trace.json"))
    trace.unlink(missing_ok=True)
    row, r = launch(a, schedule, tag, budget, [
        *(launcher or [sys.executable, "-m", "klotski.cli"]), "generate", a.jobs, "--model", a.model, "-o", out,
        "--report", report,
        "--trace", trace, "--device", a.device, "--dtype", a.dtype, "--max-new-tokens", a.max_new_tokens,
        "--schedule", schedule, "--no-progress", "--no-resume", "--include-token-ids",
        "--device-memory", f"{budget // 1024}KiB", *map(str, extra)], out, report)
    if r is None:
        return row
    io, mem, plan = r.get("io", {}), r.get("memory", {}), r.get("plan", {})
    h2d, busy = io.get("bytes", {}).get("host_to_device", 0), sum(io.get("busy_s", {}).get(l, 0) for l in H2D_LANES)
    union = link_busy(trace)
    return {**row, "bubble": r.get("bubble", {}).get("share"), "decode_bubble": r.get("bubble", {}).get("decode_share"),
            "h2d_bytes": h2d,
            "h2d_busy_sum_s": round(busy, 4), "h2d_busy_union_s": union and round(union, 4),
            "h2d_gbps_busy": per_s(h2d, busy, 1e9), "h2d_gbps_union": per_s(h2d, union, 1e9),
            "h2d_gbps_wall": per_s(h2d, r["prefill_s"] + r["decode_s"], 1e9),
            **{k: mem[k] for k in ("peak_device_bytes", "budget_device_bytes", "allocator_peak_device_bytes",
                                   "allocator_reserved_peak_bytes", "allocator_retries") if k in mem},
            **{k: plan.get(k) for k in ("batch_size", "num_batches", "prefill_chunk", "prefill_passes")}}


def klotski_run(a, schedule: str, tag: str) -> dict:
    """One run at the schedule's budget; a refusal raises it to the minimum the refusal names x1.02, once."""
    refused = None
    for _ in range(2):
        row = klotski_once(a, schedule, tag, a.budgets.get(schedule, a.budget))
        need = None if row["ok"] or refused else named_minimum(row["error"] or "")
        if not need or need <= row["budget_bytes"]:
            return {**row, "refused": refused} if refused else row
        a.budgets[schedule], refused = int(need * 1.02), row["error"]


def accelerate_run(a, tag: str, batch_size: int, budget: int) -> dict:
    base = a.work_dir / "runs" / f"accelerate-{tag}"
    out, report = base.with_suffix(".out.jsonl"), base.with_suffix(".report.json")
    if a.device == "cuda":
        spec = base.with_suffix(".spec.json")
        spec.write_text(json.dumps({"model": str(a.model), "jobs": str(a.jobs), "out": str(out), "report": str(report),
                                    "batch_size": batch_size, "max_new": a.max_new_tokens, "budget": budget,
                                    "dtype": a.dtype, "allocator_cap": getattr(a, "allocator_cap", None)}))
        cmd = [sys.executable, __file__, "--accelerate-child", spec]
    else:  # the CPU baseline: the device budget is the weights kept as CPU tensors, the rest read from disk
        cmd = accelerate_cmd(model=a.model, jobs=a.jobs, out=out, report=report, batch_size=batch_size,
                             max_new_tokens=a.max_new_tokens, device_memory=str(budget), host_memory="100GiB",
                             offload=a.work_dir / "accelerate-offload", threads=os.cpu_count()) + ["--dtype", a.dtype]
    row, r = launch(a, "accelerate", tag, budget, cmd, out, report)
    if r is None:
        return row
    # CUDA: torch.cuda.max_memory_allocated during generation; CPU: accelerate_run's budget_used_bytes
    return {**row, "batch_size": batch_size, "load_s": r.get("load_s"),
            "peak_device_bytes": r.get("peak_device_bytes", r.get("budget_used_bytes")),
            "device_map_param_bytes": r.get("device_map_summary", {}).get("param_bytes")}


def accelerate_child(spec_path: Path) -> int:
    """transformers+accelerate on CUDA: device_map="auto" within the device budget, greedy generate per batch."""
    import torch
    from baselines.accelerate_run import _eos_ids, device_map_summary, generate_batch, load_jobs, make_batches
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = json.loads(spec_path.read_text())
    cap_allocator(s.get("allocator_cap"))  # the same allocator cap as Klotski's process (gpu_realdims.py)
    tok = AutoTokenizer.from_pretrained(s["model"], padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        s["model"], dtype="auto" if s["dtype"] == "auto" else getattr(torch, s["dtype"]), device_map="auto",
        max_memory={0: s["budget"], "cpu": "100GiB"}).eval()
    load_s = time.perf_counter() - t0

    class OnDevice:  # generate_batch pads on the host: the padded batch goes to the GPU
        def __getattr__(self, name):
            return getattr(tok, name)

        def pad(self, *args, **kw):
            return tok.pad(*args, **kw).to("cuda:0")

    context = getattr(model.config, "max_position_embeddings", None) or tok.model_max_length
    items, errors = load_jobs(s["jobs"], tok, s["max_new"], context)
    torch.cuda.reset_peak_memory_stats()
    gen = prefill = total = 0
    with open(s["out"], "w") as out:
        for batch in make_batches(items, s["batch_size"]):
            records, n, pre, tt = generate_batch(model, OnDevice(), batch, tok.pad_token_id, _eos_ids(model, tok))
            gen, prefill, total = gen + n, prefill + pre, total + tt
            out.writelines(json.dumps(r) + "\n" for r in records)
    Path(s["report"]).write_text(json.dumps({
        "tokens_per_s": round(gen / total, 3) if total else 0.0, "generated_tokens": gen, "prefill_s": round(prefill, 4),
        "decode_s": round(total - prefill, 4), "load_s": round(load_s, 2), "requests": {"ok": len(items), "failed": len(errors)},
        "peak_device_bytes": torch.cuda.max_memory_allocated(), "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
        "device_map_summary": device_map_summary(model)}, indent=2))
    return 0


def median_row(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["ok"]]
    keys = [k for k, v in (ok[0] if ok else {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "returncode"]
    med = {k: round(statistics.median(v), 4) for k in keys if (v := [r[k] for r in ok if r.get(k) is not None])}
    return {**med, "ok_runs": len(ok), "runs": len(rows), "error": next((r["error"] for r in rows if not r["ok"]), None),
            "budget_raised": any(r["budget_raised"] for r in rows),
            "agree": min((r["agree"] for r in ok if r.get("agree")), default=None, key=lambda x: x[0])}


def table(summary: dict, pinned: float | None) -> str:
    def f(v, spec="{:.2f}"):
        return "-" if v is None else spec.format(v)

    head = ("system", "tok/s", "dec tok/s", "bubble", "dec bubble", "h2d GB/s busy", "h2d GB/s link", "% pinned",
            "peak/budget MiB", "alloc peak MiB", "agree")
    rows = []
    for name, m in ((n, m) for n, m in summary.items() if m["ok_runs"]):
        mib = lambda k: f(m.get(k) and m[k] / 2**20, "{:.1f}")  # noqa: E731
        link = m.get("h2d_gbps_union")
        rows.append((name, f(m.get("tok_s")), f(m.get("decode_tok_s")), f(m.get("bubble"), "{:.1%}"),
                     f(m.get("decode_bubble"), "{:.1%}"), f(m.get("h2d_gbps_busy")), f(link),
                     f(pinned and link and 100 * link / pinned, "{:.0f}%"),
                     f"{mib('peak_device_bytes')}/{mib('budget_bytes')}" + ("*" if m["budget_raised"] else ""),
                     mib("allocator_peak_device_bytes"), "{}/{}".format(*m["agree"]) if m["agree"] else "-"))
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in [head, *rows]]
    lines += [f"{name}: {'failed in some runs' if m['ok_runs'] else 'FAILED'}: {m['error']}"
              for name, m in summary.items() if m["error"]]
    return "\n".join(lines)


def main() -> int:
    a = parse_args()
    if a.accelerate_child:
        return accelerate_child(a.accelerate_child)
    for d in ("logs", "runs"):
        (a.work_dir / d).mkdir(parents=True, exist_ok=True)
    a.model = a.work_dir / "model"
    if not (a.model / "klotski-tiny.json").exists():  # written last: a half-built checkpoint has none
        rc, _, last = sh([sys.executable, "-m", "klotski.cli", "make-tiny", a.model, "--preset", a.preset,
                          "--routing", "skewed"], a.work_dir / "logs" / "make-tiny.log", BUILD_TIMEOUT)
        if rc != 0:
            sys.exit(f"gpu.py: building the {a.preset} checkpoint failed: {last}")
    size = sum(f.stat().st_size for f in a.model.glob("*.safetensors"))
    a.budget, a.budgets = int(size * a.budget_fraction), {}
    a.jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", a.prompts, a.work_dir / "jobs.jsonl")
    rc, _, last = sh([sys.executable, "-c", PINNED, a.device], a.work_dir / "logs" / "pinned.log", a.timeout)
    pinned = json.loads(last) if rc == 0 and last.startswith("{") else {"gb_per_s": None, "error": last}
    print(f"model {a.model}: {size / 2**20:.1f} MiB; device budget {a.budget / 2**20:.1f} MiB; "
          f"pinned host->device copy {pinned['gb_per_s']} GB/s", flush=True)

    warm = klotski_run(a, "klotski", "warmup")
    ref = token_ids(Path(warm["output"])) if warm["ok"] else {}
    runs = {s: [] for s in a.systems}
    for rep in range(a.reps):
        for system in a.systems:
            row = (accelerate_run(a, f"rep{rep}", warm.get("batch_size") or 4, a.budgets.get("klotski", a.budget))
                   if system == "accelerate" else klotski_run(a, system, f"rep{rep}"))
            row.update(agreement(ref, token_ids(Path(row["output"])) if row["ok"] else {}))
            runs[system].append(row)
            print(f"{system} rep {rep}: " + (f"{row['tok_s']} tok/s" if row["ok"] else f"failed: {row['error']}"), flush=True)
    summary = {s: median_row(rows) for s, rows in runs.items()}
    print(table(summary, pinned["gb_per_s"]))
    print("* budget raised to the minimum the refusal named x1.02. agree: prompts whose token ids equal the warm-up "
          "klotski run's. link: h2d bytes / union of the transfer lanes' busy time")
    k, pin = summary.get("klotski", {}), pinned["gb_per_s"]
    decode = k.get("decode_bubble") is not None
    bubble, link = k.get("decode_bubble") if decode else k.get("bubble"), k.get("h2d_gbps_union")
    result = {
        "preset": a.preset, "device": a.device, "dtype": a.dtype, "command": shlex.join([sys.executable, *sys.argv]),
        "gpu": pinned.get("gpu"), "torch": pinned.get("torch"), "cuda": pinned.get("cuda"), "machine": machine_info(),
        "model": {"dir": str(a.model), "safetensors_bytes": size},
        "budget": {"fraction": a.budget_fraction, "bytes": a.budget, "raised_to": a.budgets},
        "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "reps": a.reps, "timeout_s": a.timeout,
        "pinned_copy": pinned, "h2d_lanes": list(H2D_LANES),
        "warmup": {"note": "one klotski-schedule run before the measured ones: fills the hardware-profile cache and the "
                           "expert-correlation table (~/.cache/klotski), so measured runs plan and prefetch warm; its "
                           "token ids are the agreement reference", "run": warm},
        "targets": {"klotski_bubble_max": 0.10, "klotski_bubble": bubble,
                    "bubble_scope": "decode steps" if decode else "whole run (no decode-only figure)",
                    "bubble_met": bubble <= 0.10 if bubble is not None else None,
                    "h2d_of_pinned_min": 0.80, "h2d_of_pinned": round(link / pin, 3) if link and pin else None,
                    "h2d_met": link >= 0.8 * pin if link and pin else None},
        "summary": summary, "runs": runs, "work_dir": str(a.work_dir),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
