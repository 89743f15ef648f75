"""Runs correct the profile: the measured profile is a prior, each run on a quiet machine is
evidence, and the terms of the cost model the run exercised are refitted from it.

A term is what one factor scales in the cost model (planner/costmodel.py: `factors`): an op's
time (attention, gate, expert with its waves, head, dequant), the pipeline's own cost, a link.
A run says how long each phase took (prefill, decode) against what the plan, replayed over the
run's own lengths and routing, predicted; the caller also says how much each term explains of
each phase (its elasticity: d log(phase) / d log(term), 0 for a term hidden behind a transfer).
One observation is then y = log(measured / predicted without corrections) ≈ Σ_k e_k·x_k, with
x_k the log factor of term k; the factors are the ridge fit over every observation kept,
pulled toward 1 (the measurement) by PRIOR: a term that explains most of a run moves most,
one the runs never exercise stays as measured. Why: a profile is one draw of a noisy
measurement (the same check read 1.06 to 1.33 on a quiet machine by which draw was cached),
and nothing ever corrected it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from planner.profile import locked, write_whole

TERMS = ("attention", "gate", "expert", "head", "dequant", "pipeline", "host_to_device", "disk_to_host")
PRIOR = 0.05          # the measurement's weight, in observations of a term explaining all of a phase
KEEP = 32             # observations kept (the newest): the machine may change under a profile
STEP = 0.1            # the log step the caller perturbs a term by to find its elasticity
HUBER = math.log(1.25)  # an observation further than this (in log) from the fit counts less


def observation(phase: str, measured_s: float, predicted_s: float, elasticity: dict[str, float],
                factors: dict[str, float]) -> dict | None:
    """One phase of one run as evidence, relative to the uncorrected profile: the log ratio the
    run measured against the corrected prediction, plus what the current factors already
    explain. None where the phase did not run or was not predicted."""
    if measured_s <= 0 or predicted_s <= 0:
        return None
    e = {k: round(v, 4) for k, v in elasticity.items() if k in TERMS and abs(v) >= 1e-4}
    y = math.log(measured_s / predicted_s) + sum(v * math.log(factors.get(k, 1.0)) for k, v in e.items())
    return {"phase": phase, "y": y, "elasticity": e, "measured_s": measured_s, "predicted_s": predicted_s,
            "at": round(time.time())}


def refit(evidence: list[dict]) -> dict[str, float]:
    """The factor of every term the evidence holds: exp of the ridge solution of y ≈ E·x with
    PRIOR·|x|² (x = 0: as measured), an observation HUBER off the fit weighed down in proportion
    (a run disturbed in a way its busy check missed: a first run of tiny-mixtral measured 218
    tok/s where the three after it measured 426-502)."""
    terms = sorted({k for o in evidence for k in o["elasticity"]})
    if not terms:
        return {}
    E = np.array([[o["elasticity"].get(k, 0.0) for k in terms] for o in evidence])
    y = np.array([o["y"] for o in evidence])
    w = np.ones(len(y))
    for _ in range(5):  # iteratively reweighted: Huber's weights from the last fit's residuals
        x = np.linalg.solve(E.T @ (w[:, None] * E) + PRIOR * np.eye(len(terms)), E.T @ (w * y))
        off = np.abs(y - E @ x)
        w = np.where(off <= HUBER, 1.0, HUBER / np.maximum(off, 1e-12))
    return {k: float(math.exp(v)) for k, v in zip(terms, x)}


def learn(calibration: dict, observations: list[dict]) -> dict:
    """The profile's calibration with a run's observations added (the newest KEEP kept) and its
    factors refitted; `runs` counts the runs seen."""
    run = calibration.get("runs", 0) + 1
    observations = [{**o, "run": run} for o in observations if o]
    if not observations:
        return calibration
    evidence = (calibration.get("evidence", []) + observations)[-KEEP:]
    return {"factors": refit(evidence), "evidence": evidence, "runs": run}


def section(profile) -> dict:
    """The run report's `profile` section's start: which profile, how its measure was judged."""
    return {"name": profile.name, "judged": profile.judged.get("verdict"),
            "runs_before": profile.calibration.get("runs", 0)}


def correct(profile, replay, measured: dict, skip: dict | None = None) -> dict:
    """Learn from one run: `replay(profile)` -> {phase: predicted seconds} (None: the plan could
    not be replayed) is the plan over the run's own job; each term's share of each phase is found
    by replaying with that term STEP larger; each phase measured (`measured`: phase -> seconds)
    becomes an observation (a phase in `skip`, phase -> why, is reported, not learned from), the
    factors are refitted and saved in the profile's cache file (not `profile`: that may hold an
    emulated link's rate in place of the measured one). Returns the report's `profile` section."""
    started = time.perf_counter()
    out = section(profile)
    if profile.cached_at is None:
        return {**out, "corrected": False,
                "why": "the profile is not in the cache (measured while busy, or its samples disagreed)"}
    factors = profile.calibration.get("factors", {})
    base = replay(profile)
    if base is None:
        return {**out, "corrected": False, "why": "the plan could not be replayed for the run's lengths"}
    shares = {phase: {} for phase in base}
    for term in TERMS:
        bumped = dataclasses.replace(profile, calibration={
            "factors": {**factors, term: factors.get(term, 1.0) * math.exp(STEP)}})
        for phase, seconds in (replay(bumped) or {}).items():
            if seconds > 0 and base[phase] > 0:
                shares[phase][term] = math.log(seconds / base[phase]) / STEP
    skip = skip or {}
    observations = [observation(phase, measured.get(phase, 0.0), base[phase], shares[phase], factors)
                    for phase in base if phase not in skip]
    if not any(observations):
        return {**out, "corrected": False, "why": "no phase of the run could be compared with the plan"}
    path = Path(profile.cached_at)
    try:
        with locked(path):  # one writer at a time: a run ending beside this one adds its lesson after
            stored = json.loads(path.read_text())
            stored["calibration"] = learn(stored.get("calibration", {}), observations)
            write_whole(path, json.dumps(stored, indent=1))
    except (OSError, ValueError) as e:
        return {**out, "corrected": False, "why": f"the profile's cache file could not be updated ({e})"}
    phases = {phase: {"predicted_s": round(base[phase], 4), "measured_s": round(measured.get(phase, 0.0), 4),
                      "shares": {k: round(v, 3) for k, v in shares[phase].items() if abs(v) >= 0.01},
                      **({"not_learned": skip[phase]} if phase in skip else {})} for phase in base}
    return {**out, "corrected": True, "phases": phases,
            "factors": {k: round(v, 4) for k, v in stored["calibration"]["factors"].items()},
            "seconds": round(time.perf_counter() - started, 2)}  # the replays it took (one a term)


def rows(profile) -> list[dict]:
    """Each term as `klotski profile --show` prints it: its factor, where it came from and drift
    (how far the runs moved it from the measurement)."""
    cal = profile.calibration
    factors, evidence = cal.get("factors", {}), cal.get("evidence", [])
    out = []
    for term in TERMS:
        runs = len({o.get("run") for o in evidence if o["elasticity"].get(term)})
        factor = factors.get(term, 1.0)
        out.append({"term": term, "factor": factor, "drift": factor - 1.0,
                    "source": f"refitted from {runs} run{'s' * (runs != 1)}" if runs else "measured"})
    return out


def show(profile) -> str:
    """The profile's terms, one a line, and how its measure was judged."""
    lines = [f"profile   {profile.name} ({profile.device}); measured in "
             f"{profile.machine.get('measure_s', '?')} s"]
    judged = profile.judged
    lines.append(f"judged    {judged.get('verdict', 'not judged (measured before judging, or a built-in)')}")
    cal = profile.calibration
    lines.append(f"runs      {cal.get('runs', 0)} runs corrected it")
    lines.append(f"{'term':16s} {'factor':>7s} {'drift':>7s}  source")
    for r in rows(profile):
        lines.append(f"{r['term']:16s} {r['factor']:7.3f} {r['drift']:+7.1%}  {r['source']}")
    return "\n".join(lines)
