"""Where answers stop, learned from runs: the plan's length model.

A plan prices each answer at a length. Before any run it can only take the line's max_tokens,
the most an answer may hold; a job whose answers stop early (a label, a yes/no) is then priced
at many times the decode it needs. After a run on a quiet machine the lengths the answers had
are kept, per model, in one file (`record`), and the next plan takes them (`lengths_for`):

- **this job** (`job` key: the caller's hash of the planned window's prompts and caps, so the
  same job file planned again, whatever its name): each planned sequence's own answer length,
  the mean over the runs that answered it (the newest weighing 1/KEEP_RUNS at least: sampled
  answers vary run to run), paired with its own prompt as the engine pairs them;
- else **the model's recent runs** (RECENT runs of any job): each answer's length as a share of
  its cap, their quantiles averaged over those runs, laid over this job's caps in an even
  spread (a low-discrepancy sequence, so the first fill's long answers are as the runs had
  them). An offline job is often the same task on new lines; a different task on the same model
  is priced by the last ones until its own run;
- else max_tokens, as before.

Memory is never planned from these: a run may still reach its cap, so the working set stays
sized for it. The file is replaced whole under a lock (one writer at a time across processes;
planner.profile.locked), and a file that cannot be read is ignored with one line (the plan then
takes max_tokens, and the next quiet run writes a fresh one).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from planner.profile import locked, write_whole

VERSION = 1
KEEP_RUNS = 4    # a job's mean over its runs: the newest weighs at least 1/KEEP_RUNS
RECENT = 8       # the model's newest runs kept for jobs not seen yet
JOBS_KEPT = 32   # the newest jobs kept, per model
QUANTILES = 33   # points of a run's share-of-cap distribution
SPREAD = (math.sqrt(5) - 1) / 2  # the golden ratio's step: quantile positions spread evenly over a job


def read(path: Path, warn=None) -> dict:
    """The learned lengths of one model ({} where none were learned yet); a damaged file is
    told to `warn` in one line and read as none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        if warn:
            warn(f"{path}: the learned answer lengths could not be read ({e.strerror}); planning at max_tokens")
        return {}
    try:
        data = json.loads(text)
        if not _well_formed(data):
            raise ValueError("not a lengths file of this version")
        return data
    except ValueError as e:
        if warn:
            warn(f"{path}: the learned answer lengths are damaged ({str(e).splitlines()[0][:80]}); ignored: "
                 "planning at max_tokens, and the next quiet run writes the file afresh")
        return {}


def _well_formed(data) -> bool:
    """Every field `lengths_for` and `learned` read is there, of its type."""
    def numbers(xs):
        return isinstance(xs, list) and all(isinstance(x, (int, float)) for x in xs)
    return (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("jobs"), dict)
            and isinstance(data.get("recent"), list)
            and all(isinstance(j, dict) and numbers(j.get("lengths")) and isinstance(j.get("runs"), int)
                    for j in data["jobs"].values())
            and all(isinstance(r, dict) and numbers(r.get("shares")) and isinstance(r.get("answers"), int)
                    for r in data["recent"]))


def lengths_for(data: dict, job: str, caps: list[int]) -> tuple[list[int], dict]:
    """(the answer length to plan each of `caps`' sequences at, where they came from: `source`
    in words, `runs`). `caps`: each planned sequence's max_tokens, in the planned order; `job`:
    the key `record` was given."""
    caps = [max(1, int(c)) for c in caps]
    seen = (data.get("jobs") or {}).get(job)
    if seen and len(seen.get("lengths", ())) == len(caps):
        lens = [min(c, max(1, round(x))) for x, c in zip(seen["lengths"], caps)]
        return lens, _source(f"learned from {seen['runs']} run{'s' * (seen['runs'] != 1)} of this job",
                             seen["runs"])
    recent = [r for r in data.get("recent", ()) if len(r.get("shares", ())) == QUANTILES]
    if recent and caps:
        shares = [sum(r["shares"][q] for r in recent) / len(recent) for q in range(QUANTILES)]
        lens = [min(c, max(1, round(c * _quantile(shares, ((i + 0.5) * SPREAD) % 1.0)))) for i, c in enumerate(caps)]
        return lens, _source(f"learned from the model's {len(recent)} recent run{'s' * (len(recent) != 1)} "
                             "(other jobs)", len(recent))
    return caps, _source("assumed max_tokens (no run of this model has taught it yet)", 0)


def _source(words: str, runs: int) -> dict:
    return {"source": words, "runs": runs}


def _quantile(points: list[float], u: float) -> float:
    """The distribution given by evenly spaced quantile `points` at u in [0, 1), interpolated."""
    x = u * (len(points) - 1)
    i = min(int(x), len(points) - 2)
    return points[i] + (x - i) * (points[i + 1] - points[i])


def quantiles(values: list[float]) -> list[float]:
    """QUANTILES evenly spaced quantiles of `values` (interpolated)."""
    s = sorted(values)
    out = []
    for q in range(QUANTILES):
        x = q / (QUANTILES - 1) * (len(s) - 1)
        i = min(int(x), len(s) - 1)
        out.append(s[i] + (x - i) * (s[min(i + 1, len(s) - 1)] - s[i]))
    return [round(v, 4) for v in out]


def learned(data: dict, job: str | None, planned: list[int | None] | None, lens: list[int],
            caps: list[int]) -> dict:
    """`data` with one run added: `lens` (every answer it generated) over their `caps` joins the
    model's recent runs; where the run was planned under key `job`, `planned` (each planned
    sequence's answer length in the planned order, None where it gave none) updates that
    job's mean."""
    data = {"version": VERSION, "jobs": dict(data.get("jobs") or {}), "recent": list(data.get("recent") or [])}
    now = round(time.time())
    if lens:
        shares = [min(1.0, g / max(1, c)) for g, c in zip(lens, caps)]
        data["recent"] = (data["recent"] + [{"job": job, "answers": len(lens), "shares": quantiles(shares),
                                             "at": now}])[-RECENT:]
    if job and planned and any(x is not None for x in planned):
        before = data["jobs"].get(job)
        if before and len(before.get("lengths", ())) == len(planned):
            w = 1.0 / min(before["runs"] + 1, KEEP_RUNS)
            mean = [old if x is None else round(old + w * (x - old), 2) for old, x in zip(before["lengths"], planned)]
            runs = before["runs"] + 1
        else:
            fill = [x for x in planned if x is not None]
            mean, runs = [float(x if x is not None else max(fill)) for x in planned], 1
        data["jobs"][job] = {"lengths": mean, "runs": runs, "at": now}
        if len(data["jobs"]) > JOBS_KEPT:
            newest = sorted(data["jobs"].items(), key=lambda kv: -kv[1].get("at", 0))[:JOBS_KEPT]
            data["jobs"] = dict(newest)
    return data


def record(path: Path, job: str | None, planned: list[int | None] | None, lens: list[int], caps: list[int],
           warn=None) -> dict:
    """Add one quiet run's answers to the model's file (read, updated, replaced whole, under
    the file's lock); returns what the report says of it. Raises OSError when it cannot be
    written."""
    with locked(path):
        data = learned(read(path, warn), job, planned, lens, caps)
        write_whole(path, json.dumps(data, separators=(",", ":")))
    seen = data["jobs"].get(job) if job else None
    return {"answers": len(lens), "answer_tokens": sum(lens), "job_runs": seen["runs"] if seen else 0,
            "model_runs": len(data["recent"])}


def summary(data: dict) -> list[str]:
    """The learned lengths as `klotski profile --show` prints them, a line each."""
    if not data:
        return ["answers   no run has taught this model's answer lengths: plans take max_tokens"]
    lines = []
    for r in data.get("recent", [])[-3:]:
        lines.append(f"answers   a run of {r['answers']} answers: median {r['shares'][QUANTILES // 2]:.0%} of "
                     f"max_tokens, longest {r['shares'][-1]:.0%}")
    jobs = data.get("jobs", {})
    lines.append(f"answers   {len(jobs)} job{'s' * (len(jobs) != 1)} learned, "
                 f"{len(data.get('recent', []))} recent run{'s' * (len(data.get('recent', [])) != 1)} kept")
    for key, j in sorted(jobs.items(), key=lambda kv: -kv[1].get("at", 0))[:3]:
        lens = j["lengths"]
        lines.append(f"answers   job {key[:12]}: {len(lens)} answers, mean {sum(lens) / max(1, len(lens)):.1f} "
                     f"tokens, from {j['runs']} run{'s' * (j['runs'] != 1)}")
    return lines
