"""The `klotski bench` run matrix: which configurations, in which order, and what they mean.

Phases:

1. Warm-up and planning. One Klotski run with `--num-batches auto` (and the batch size
   given, or the planner's) per regime (plain, emulated link). They absorb every
   first-use cost (page cache, the correlation table and the machine profile that are
   built and cached on a model's first use) and tell the matrix the planner's (bs, n);
   they are not measured. The emulated (else plain) one keeps a trace for the timeline.
   Then accelerate's largest batch within the budget is searched (max_batch.py) from
   Klotski's batch size up to the job size; its runs are accelerate's warm-up (loading
   maps and touches the whole checkpoint, and fills the offload folder).
2. Repetitions. Every configuration once per round, in an interleaved order (baseline,
   ladder, emulated ladder, sweep, baseline, ...), `reps` rounds, so slow drift of a
   shared machine spreads over all systems instead of landing on one.
3. Aggregation: median and min-max per metric; outputs of every run compared token by
   token with the planning run of Klotski (compare.py); ratios of medians.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import bench_runner as runner

LADDER = ("simple", "multibatch", "hot-prefetch", "klotski")
PLAIN, LINK = "plain", "link"

# Targets from issue 6: (numerator, denominator, target, regime the target is set for).
# The accelerate targets are for the bigger-than-RAM regime; in the fits-in-RAM regime
# those ratios are reported against no target.
EMULATED, BIGGER = "emulated link", "bigger than RAM"
TARGETS = [
    ("klotski-link", "multibatch-link", 1.25, EMULATED),
    ("klotski-link", "simple-link", 3.0, EMULATED),
    ("klotski", "accelerate-same-bs", 10.0, BIGGER),
    ("klotski", "accelerate-best-bs", 1.5, BIGGER),
    ("klotski", "multibatch", None, None),
    ("klotski", "simple", None, None),
]
DISK_TARGET = 0.85  # share of the disk's O_DIRECT sequential read bandwidth sustained during decode


@dataclasses.dataclass
class Config:
    key: str                 # unique name used in the JSON, tables and plots
    system: str              # "klotski" (any schedule) or "accelerate"
    schedule: str | None
    regime: str              # PLAIN or LINK
    role: str                # "baseline", "ladder" or "sweep"
    batch_size: int
    num_batches: int | None
    jobs: Path


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def write_jobs(prompts: list[dict], count: int, max_new_tokens: int, path: Path) -> Path:
    """The first `count` prompts, every line with the same max_new_tokens.

    A fixed limit keeps all systems generating the same number of tokens (and steers clear
    of mixing limits inside one batch group)."""
    if count > len(prompts):
        raise ValueError(f"{count} prompts wanted, the prompt file has {len(prompts)}")
    path.write_text("".join(json.dumps({"id": p["id"], "prompt": p["prompt"], "max_new_tokens": max_new_tokens})
                            + "\n" for p in prompts[:count]))
    return path


class Bench:
    def __init__(self, s: dict):
        self.s = s
        self.work = Path(s["work_dir"])
        self.env = runner.child_env(s["threads"])
        self.link = s["link_gbps"]
        self.t0 = time.perf_counter()
        self.outputs: dict[str, list[tuple[str, Path, Path]]] = {}  # key -> (run tag, output, job file)
        self.failures: list[dict] = []
        self.done_runs = 0
        self.total_runs = 0

    # ---- one run ---------------------------------------------------------------------
    def run(self, cfg: Config, tag: str, trace: Path | None = None) -> dict | None:
        base = f"{cfg.key}.{tag}"
        out, report, log = (self.work / f"{base}{ext}" for ext in (".out.jsonl", ".report.json", ".log"))
        s = self.s
        if cfg.system == "accelerate":
            cmd = runner.accelerate_cmd(model=s["model_dir"], jobs=cfg.jobs, out=out, report=report,
                                        batch_size=cfg.batch_size, max_new_tokens=s["max_new_tokens"],
                                        device_memory=s["device_memory"], host_memory=s["host_memory"],
                                        offload=self.work / "offload", threads=s["threads"])
        else:
            cmd = runner.klotski_cmd(model=s["model_dir"], jobs=cfg.jobs, out=out, report=report,
                                     schedule=cfg.schedule, batch_size=cfg.batch_size,
                                     num_batches=cfg.num_batches, max_new_tokens=s["max_new_tokens"],
                                     device_memory=s["device_memory"], host_memory=s["host_memory"],
                                     link_gbps=self.link if cfg.regime == LINK else None,
                                     direct_io=s["direct_io"], trace=trace)
        probe = self.work / f"{base}.io.json"  # disk bytes read during decode, from /proc/self/io
        proc = runner.run_process(runner.with_io_probe(cmd, probe), env=self.env, log=log,
                                  memory_limit=s.get("memory_limit_bytes"), cold_cache=s.get("cold_cache", False))
        if probe.exists():
            proc.update(json.loads(probe.read_text()))
        self.done_runs += 1
        elapsed = time.perf_counter() - self.t0
        if proc["returncode"] != 0 or not report.exists():
            self.failures.append({"config": cfg.key, "run": tag, "returncode": proc["returncode"],
                                  "command": " ".join(map(str, cmd)), "log_tail": runner.tail(log)})
            _log(f"[{self.done_runs}/{self.total_runs} {elapsed:5.0f}s] {tag} {cfg.key}: FAILED "
                 f"(exit {proc['returncode']}), see {log}")
            return None
        rep = runner.read_report(report)
        row = (runner.accelerate_row if cfg.system == "accelerate" else runner.klotski_row)(rep, proc)
        self.outputs.setdefault(cfg.key, []).append((tag, out, cfg.jobs))
        _log(f"[{self.done_runs}/{self.total_runs} {elapsed:5.0f}s] {tag:7s} {cfg.key:22s} "
             f"{row['tokens_per_s']:9.2f} tok/s  bs={row['batch_size']} n={row['num_batches']}  "
             f"wall {proc['process_wall_s']:.1f}s")
        return row

    # ---- phase 1 ---------------------------------------------------------------------
    def plan_and_warm_up(self, jobs: Path) -> dict:
        s, plans = self.s, {}
        regimes = [PLAIN] + ([LINK] if self.link else [])
        for regime in regimes:
            # One trace is enough for the timeline; tracing keeps every event, so only one run pays.
            trace = self.work / f"trace-{regime}.json" if regime == regimes[-1] else None
            cfg = Config(f"plan-{regime}", "klotski", "klotski", regime, "plan", s["batch_size"] or 0, None, jobs)
            row = self.run(cfg, "warmup", trace=trace)
            if row is None:
                raise RuntimeError(f"the planning run ({regime}) failed:\n{self.failures[-1]['log_tail']}")
            plans[regime] = {k: row[k] for k in ("batch_size", "num_batches", "num_batches_planned",
                                                  "groups", "predicted_tokens_per_s", "tokens_per_s")}
            plans[regime]["trace"] = str(trace) if trace else None
        return plans

    def accelerate_best_batch(self, jobs: Path, start: int) -> dict:
        """max_batch.py's search from Klotski's batch size up to the whole job."""
        import argparse
        import max_batch

        n = self.s["prompts"]
        cands, b = [], start
        while b < n:
            cands.append(b)
            b *= 2
        cands.append(n)
        a = argparse.Namespace(model=str(self.s["model_dir"]), jobs=str(jobs),
                               max_new_tokens=self.s["max_new_tokens"],
                               max_memory_device=self.s["device_memory"], max_memory_cpu=self.s["host_memory"],
                               offload_folder=str(self.work / "offload"), dtype="auto", threads=self.s["threads"],
                               batch_cap=n, batch_candidates=",".join(map(str, sorted(set(cands)))))
        t = time.perf_counter()
        result = max_batch.find_max_batch(a)
        result["search_s"] = round(time.perf_counter() - t, 1)
        result["candidates_tried"] = sorted(set(cands))
        result["note"] = (f"candidates from Klotski's batch size ({start}) doubling up to the job's "
                          f"{n} prompts: a batch cannot hold more prompts than the job has")
        return result

    # ---- the matrix --------------------------------------------------------------------
    def single_batch_jobs(self, jobs: Path, batch_size: int) -> Path:
        """The job of configurations whose weight pass serves a single batch (simple, accelerate
        at Klotski's batch size): the first `single_batch_prompts` prompts when set. Such a run
        repeats the same per-batch work, so a few batches measure its rate; in the
        bigger-than-RAM regime all of them would take an hour."""
        k = self.s.get("single_batch_prompts")
        if not k or k >= self.s["prompts"]:
            return jobs
        k = max(batch_size, k - k % batch_size)  # whole batches only
        return write_jobs(self.s["prompt_pool"], k, self.s["max_new_tokens"], self.work / f"jobs-single-{k}.jsonl")

    def configs(self, jobs: Path, plans: dict, best_bs: int | None) -> list[Config]:
        s, systems = self.s, self.s["systems"]
        baseline, ladder, ladder_link, sweep = [], [], [], []
        single = self.single_batch_jobs(jobs, plans[PLAIN]["batch_size"])
        if "accelerate" in systems:
            bs = plans[PLAIN]["batch_size"]
            baseline.append(Config("accelerate-same-bs", "accelerate", None, PLAIN, "baseline", bs, None, single))
            if best_bs and best_bs != bs:
                baseline.append(Config("accelerate-best-bs", "accelerate", None, PLAIN, "baseline", best_bs, None, jobs))
        for regime, dest, suffix in ((PLAIN, ladder, ""), (LINK, ladder_link, "-link")):
            if regime not in plans:
                continue
            p = plans[regime]
            for sched in LADDER:
                if sched in systems:
                    n = 1 if sched == "simple" else p["num_batches"]
                    dest.append(Config(sched + suffix, "klotski", sched, regime, "ladder", p["batch_size"], n,
                                       single if sched == "simple" else jobs))
        regime = LINK if self.link else PLAIN
        bs, index = s["sweep_batch_size"], []
        for sched in s["sweep_schedules"]:
            if sched not in systems:
                continue
            for n in s["ns"]:
                # A sweep point that is exactly a ladder configuration is not run twice.
                same = next((c for c in ladder + ladder_link if (c.schedule, c.regime, c.batch_size, c.num_batches)
                             == (sched, regime, bs, n) and n * bs == s["prompts"]), None)
                if same is None:
                    sweep_jobs = write_jobs(s["prompt_pool"], n * bs, s["max_new_tokens"],
                                            self.work / f"jobs-sweep-{n * bs}.jsonl")
                    same = Config(f"{sched}-n{n}" + ("-link" if regime == LINK else ""), "klotski", sched,
                                  regime, "sweep", bs, n, sweep_jobs)
                    sweep.append(same)
                index.append({"schedule": sched, "n": n, "key": same.key})
        # Round-robin over the four lists: neighbours in time are different kinds of system.
        order = [c for group in itertools.zip_longest(baseline, ladder, ladder_link, sweep) for c in group if c]
        return order, index

    def measure(self, configs: list[Config]) -> dict[str, list[dict]]:
        rows = {c.key: [] for c in configs}
        for rep in range(1, self.s["reps"] + 1):
            for cfg in configs:
                row = self.run(cfg, f"rep{rep}")
                if row is not None:
                    rows[cfg.key].append(row)
        return rows


# --------------------------------------------------------------------------- aggregation

def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None


def summarize(rows: list[dict]) -> dict:
    """Median, min and max of every numeric metric (and of link bandwidths) over the runs."""
    out = {"median": {}, "min": {}, "max": {}}
    if not rows:
        return out
    flat = []
    for r in rows:
        f = {k: v for k, v in r.items() if _numeric(v)}
        for link, d in (r.get("links") or {}).items():
            for k in ("bytes", "gb_per_s", "busy_s"):
                if _numeric(d.get(k)):
                    f[f"{link}.{k}"] = d[k]
        flat.append(f)
    for k in sorted(set().union(*flat)):
        vals = [f[k] for f in flat if k in f]
        out["median"][k] = statistics.median(vals)
        out["min"][k], out["max"][k] = min(vals), max(vals)
    return out


def agreement(outputs: dict, reference: tuple[str, Path]) -> dict:
    """Every run's token ids against the reference run's, restricted to the ids it was given."""
    import compare

    ref_key, ref_name, ref_path = reference
    ref, ref_order = compare.load_tokens(ref_path)
    # Sweep points can serve more prompts than the reference run; for those ids the first
    # run that served them is the reference (the others are still compared with it).
    extra_source = {}
    for key, runs in outputs.items():
        for tag, out, _ in runs:
            for i, toks in compare.load_tokens(out)[0].items():
                if i not in ref:
                    ref[i] = toks
                    ref_order.append(i)
                    extra_source.setdefault(f"{key}.{tag}", []).append(i)
    per_config, disagreements = {}, []
    for key, runs in outputs.items():
        if key == ref_key:
            continue
        ok = True
        for tag, out, jobs in runs:
            ids = [json.loads(line)["id"] for line in Path(jobs).read_text().splitlines() if line.strip()]
            order = [i for i in ref_order if i in set(map(str, ids))]
            pair = compare.compare_pair(ref, order, compare.load_tokens(out)[0])
            if not pair["identical"]:
                ok = False
                disagreements.append({"config": key, "run": tag, **{k: pair[k] for k in (
                    "compared", "differing", "differing_ids", "first_difference", "missing_ids",
                    "extra_ids", "without_token_ids")}})
        per_config[key] = {"runs": len(runs), "identical": ok}
    return {"reference": ref_name, "ids": len(ref_order), "reference_for_other_ids": extra_source,
            "per_config": per_config,
            "disagreements": disagreements, "all_identical": not disagreements and bool(per_config)}


def ratios(systems: dict, s: dict) -> list[dict]:
    regimes = {EMULATED, BIGGER} if s.get("bigger_than_ram") else {EMULATED}
    out = []
    for num, den, target, regime in TARGETS:
        a, b = systems.get(num), systems.get(den)
        if not a or not b:
            continue
        x, y = a["median"].get("tokens_per_s"), b["median"].get("tokens_per_s")
        value = round(x / y, 3) if x and y else None
        applies = regime in regimes
        out.append({"name": f"{num} / {den}", "numerator": num, "denominator": den, "value": value,
                    "target": target, "target_regime": regime, "target_applies": applies,
                    "met": (value >= target) if (value is not None and target and applies) else None})
    a, b = systems.get("klotski"), systems.get("accelerate-same-bs")
    if a and b:  # the disk regime's comparison: decode steps only, prefill (compute-bound) left out
        x, y = a["median"].get("decode_tokens_per_s"), b["median"].get("decode_tokens_per_s")
        out.append({"name": "klotski / accelerate-same-bs (decode tokens/s)", "numerator": "klotski",
                    "denominator": "accelerate-same-bs", "value": round(x / y, 3) if x and y else None,
                    "target": None, "target_regime": None, "target_applies": False, "met": None})
    disk = s.get("disk_read_gbps")
    for key in ("klotski", "accelerate-same-bs", "hot-prefetch", "multibatch") if disk else ():
        # what the kernel fetched for the process while it decoded (/proc/self/io read_bytes)
        rate = systems.get(key, {}).get("median", {}).get("decode_read_gb_per_s")
        if rate is not None:
            value = round(rate / disk, 3)
            applies = key == "klotski" and BIGGER in regimes
            out.append({"name": f"{key} disk read during decode (/proc/self/io) / dd O_DIRECT bandwidth",
                        "numerator": key, "denominator": "disk", "value": value,
                        "target": DISK_TARGET if key == "klotski" else None, "target_regime": BIGGER,
                        "target_applies": applies, "met": value >= DISK_TARGET if applies else None})
    for key in ("klotski", "multibatch", "hot-prefetch") if disk else ():
        rate = systems.get(key, {}).get("median", {}).get("decode_disk_gb_per_s")
        if rate:
            value = round(rate / disk, 3)
            applies = key == "klotski" and BIGGER in regimes
            out.append({"name": f"{key} disk read during decode / dd O_DIRECT bandwidth", "numerator": key,
                        "denominator": "disk", "value": value, "target": DISK_TARGET if key == "klotski" else None,
                        "target_regime": BIGGER, "target_applies": applies,
                        "met": value >= DISK_TARGET if applies else None})
    for key in ("klotski", "klotski-link"):
        m = systems.get(key, {}).get("median", {})
        if m.get("tokens_per_s") and m.get("predicted_tokens_per_s"):
            out.append({"name": f"{key} measured / planner predicted", "numerator": key, "denominator": "planner",
                        "value": round(m["tokens_per_s"] / m["predicted_tokens_per_s"], 3),
                        "target": None, "target_regime": None, "target_applies": False, "met": None})
    return out


# --------------------------------------------------------------------------- timeline

def timeline_window(trace_path: Path, max_new_tokens: int, limit: int = 3000) -> dict | None:
    """Events of one decode step from a Chrome trace: between two consecutive lm_head ends.

    Forward f of a group is its prefill when f % max_new_tokens == 0 (every sequence here
    generates exactly max_new_tokens unless a whole group stops early); the step taken is
    the last decode step before the run's final one, i.e. steady state."""
    try:
        events = json.loads(Path(trace_path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError):
        return None
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [(lanes.get(e["tid"], "other"), e["name"], e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0))
             for e in events if e.get("ph") == "X"]
    heads = sorted(end for lane, name, _, end, _ in spans if lane == "compute" and name == "lm_head")
    if len(heads) < 2:
        return None
    forwards = len(heads)
    f = forwards - 2 if (forwards - 2) % max_new_tokens else forwards - 1  # 0-based forward index
    if f < 1:
        return None
    t0, t1 = heads[f - 1], heads[f]
    kept = [(lane, name, max(a, t0), min(b, t1), nb) for lane, name, a, b, nb in spans if b > t0 and a < t1]
    kept.sort(key=lambda e: e[2])
    return {"forward": f, "forwards": forwards, "start_us": t0, "duration_ms": round((t1 - t0) / 1e3, 3),
            "events": [{"lane": lane, "name": name, "start_ms": round((a - t0) / 1e3, 4),
                        "dur_ms": round((b - a) / 1e3, 4), "bytes": nb} for lane, name, a, b, nb in kept[:limit]],
            "truncated": len(kept) > limit}


# --------------------------------------------------------------------------- entry

def run(s: dict) -> dict:
    work = Path(s["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(s)
    jobs = write_jobs(s["prompt_pool"], s["prompts"], s["max_new_tokens"], work / "jobs.jsonl")
    bench.total_runs = 2 if s["link_gbps"] else 1  # the warm-ups; the matrix is added once planned

    plans = bench.plan_and_warm_up(jobs)
    best = None
    if "accelerate" in s["systems"] and s.get("accelerate_batch"):
        best = {"best_batch_size": s["accelerate_batch"], "searched": False,
                "note": "given with --accelerate-batch, not searched; the run's charged memory "
                        "(budget_used_bytes) is reported against the budget"}
    elif "accelerate" in s["systems"]:
        _log("searching accelerate's largest batch within the budget (max_batch.py)")
        best = bench.accelerate_best_batch(jobs, plans[PLAIN]["batch_size"])
    configs, sweep_index = bench.configs(jobs, plans, best.get("best_batch_size") if best else None)
    bench.total_runs = bench.done_runs + s["reps"] * len(configs)
    rows = bench.measure(configs)

    systems = {}
    for c in configs:
        systems[c.key] = {"system": c.system, "schedule": c.schedule, "regime": c.regime, "role": c.role,
                          "batch_size": c.batch_size, "num_batches": c.num_batches,
                          "prompts": sum(1 for _ in open(c.jobs)), "runs": rows[c.key], **summarize(rows[c.key])}
    ref = ("plan-plain", "plan-plain: klotski at the planner's bs and n (warm-up run)",
           work / "plan-plain.warmup.out.jsonl")
    trace_regime = LINK if s["link_gbps"] else PLAIN
    return {
        "plans": plans,
        "accelerate_max_batch": best,
        "order": [c.key for c in configs],
        "sweep": sweep_index,
        "systems": systems,
        "agreement": agreement(bench.outputs, ref),
        "failures": bench.failures,
        "timeline": {"regime": trace_regime, "batch_size": plans[trace_regime]["batch_size"],
                     "num_batches": plans[trace_regime]["num_batches"],
                     **(timeline_window(Path(plans[trace_regime]["trace"]), s["max_new_tokens"]) or {})},
        "elapsed_s": round(time.perf_counter() - bench.t0, 1),
    }
