"""Adaptive gating's thresholds (`--adaptive-gating A`, issue 64): calibrated on the run's first
group against a stated agreement, saved beside the output so a resumed run answers as the
first would. The rule itself runs in the executor (klotski/execute/gating.py).

AdapMoE (ICCAD'24, eq. 8) skips a token's second expert in layer j where (1 - α)² · S_j ≤ T:
α the top-1 weight's share, S_j the layer's sensitivity, T one bound for every layer. It takes
S_j from the Fisher information, which needs gradients; an inference engine has none, so here
S_j is *measured*: the first group runs once with exact top-k, and every layer records for each
routed token its share α and how far skipping its other experts would have moved its hidden
state (||O' - O||² / ||h||²; both experts are computed anyway). S_j is the least-squares fit of
that cost to (1 - α)², so a layer whose experts differ more, relative to the residual stream,
skips less; the layer's threshold on α is 1 - sqrt(T / S_j).

T is then searched: the recorded tokens' predicted costs (1 - α)² · S_j pooled over layers, T
their q-quantile (so about a share q of the calibration group's routings would skip). Each probe
decodes the group again with one q's thresholds and compares its greedy tokens, position by
position, with the exact run's. Free-running agreement falls steeply and not monotonically with
q (one flipped token changes the rest of its line), and at a bound like 0.95 the q that passes
is small (a few percent of the routings, or less), so q is searched on a log scale (`search`):
divided by STEP_DOWN from 1/2 until a probe passes (at most down to about one skipped routing,
where the run is exact top-k), then bisected geometrically between that pass and the failure
above it until they are within RESOLUTION of each other or MAX_PROBES probes are spent. The q
taken is the largest that passed (none: nothing is skipped). The group (at least
CALIBRATION_LINES lines of the first window: generate.py) decodes at most CALIBRATION_TOKENS new
tokens a line, greedy and unconstrained whatever its line asks, so the calibration costs
1 + at most MAX_PROBES short decodes of one group; its outputs are not written (the run then
generates every line, the first group's included, with the thresholds).
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np

from klotski.execute.contract import SKIP_NONE
from klotski.schedule import sequences as S
from klotski.schedule.stats import Stats
from klotski.util.writes import replace_atomically, writing

CALIBRATION_TOKENS = 32  # new tokens a calibration line decodes
CALIBRATION_LINES = 16   # lines calibrated on at least (of the first window), where the first group is fewer
MAX_PROBES = 8           # probes of the search over q, at most
STEP_DOWN = 4            # q divided by this until a probe passes
RESOLUTION = 1.3         # the search stops once the passing and failing q are within this factor
VERSION = 2  # 2: the log-scale search (thresholds calibrated by version 1's search are not reused)


def thresholds_file(out_path: Path) -> Path:
    """Where a run's thresholds are kept: beside its output (like the progress sidecar)."""
    return out_path.with_name(out_path.name + ".gating.json")


def prepare(engine, seqs: list, agreement: float, out_path: Path, model_key: str, reuse: bool = True) -> dict:
    """Set `engine`'s thresholds: those saved beside `out_path` for this `model_key` (the model and
    what the run computes it for) and agreement, where `reuse` (a run that resumes), else
    calibrated on `seqs` (the first group) and saved (atomically). Returns the calibration."""
    path = thresholds_file(out_path)
    saved = load(path, model_key, agreement) if reuse else None
    reused = saved is not None
    if not reused:
        saved = {"version": VERSION, "model": model_key, "agreement_bound": agreement,
                 **calibrate(engine, seqs, agreement)}
        with writing(path, "adaptive gating's thresholds", then="rerun the same command (it calibrates again)"):
            replace_atomically(path, (json.dumps(saved, indent=1) + "\n").encode())
    gating = engine.pipeline.set_gating(saved["thresholds"])
    gating.calibration = {**{k: v for k, v in saved.items() if k != "thresholds"}, "file": str(path), "reused": reused}
    return saved


def load(path: Path, model_key: str, agreement: float) -> dict | None:
    """The thresholds saved at `path` for this model and agreement bound; None if absent or other."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("version") != VERSION or saved.get("model") != model_key \
            or saved.get("agreement_bound") != agreement or not isinstance(saved.get("thresholds"), list):
        return None
    return saved


def calibrate(engine, seqs: list, agreement: float) -> dict:
    """Thresholds per MoE layer meeting `agreement` on `seqs` (the module's docstring says how)."""
    lines = [s for s in seqs if s.forced is None and s.sample == 0]
    pipeline = engine.pipeline
    shape = engine.spec.shape
    moe_layers = sum(shape.experts_in(j) > 0 for j in range(shape.num_layers))
    if not lines:  # nothing to measure agreement on: nothing is skipped
        return {"thresholds": [SKIP_NONE] * moe_layers, "sensitivity": [0.0] * moe_layers, "lines": 0, "tokens": 0,
                "q": 0.0, "agreement": 1.0, "skipped_share": 0.0, "exact_tokens_per_s": None,
                "gated_tokens_per_s": None, "probes": []}
    recorder = pipeline.set_gating(None, record=True)
    # the run's routing counts and predictor learn from its own lines only: the calibration's
    # decodes (the first group again and again) ask a throwaway copy and are counted apart
    routed, distinct = pipeline.routed.copy(), copy.deepcopy(pipeline.distinct)
    with pipeline.instrumented(predictor=copy.deepcopy(pipeline.predictor)):
        try:
            exact, exact_s = _decode(engine, lines)
            layers = sorted(recorder.shares)
            fits = {j: _sensitivity(recorder.shares[j], recorder.costs[j]) for j in layers}
            pool = np.concatenate([np.square(1 - np.concatenate(recorder.shares[j])) * fits[j] for j in layers]) \
                if layers else np.zeros(1)
            exact_choice = {"q": 0.0, "thresholds": [SKIP_NONE] * moe_layers, "agreement": 1.0, "seconds": exact_s,
                            "skipped_share": 0.0}
            tried = {}

            def probe(q: float) -> bool:
                bound = float(np.quantile(pool, q))
                # a layer the group recorded nothing for skips nothing (no sensitivity measured)
                thresholds = [_threshold(fits[j], bound) if j in fits else SKIP_NONE for j in range(moe_layers)]
                gating = pipeline.set_gating(thresholds)
                out, seconds = _decode(engine, lines)
                agree = agreement_of(exact, out)
                tried[q] = {"q": q, "thresholds": thresholds, "agreement": agree, "seconds": seconds,
                            "skipped_share": gating.report()["skipped_share"]}
                return agree >= agreement

            best = search(probe, smallest=1.0 / max(pool.size, 1))
            chosen = tried[best] if best else exact_choice
            probes = [{"q": t["q"], "agreement": round(t["agreement"], 4), "skipped_share": t["skipped_share"],
                       "seconds": round(t["seconds"], 4)} for t in tried.values()]
        finally:
            pipeline.set_gating(None)
    pipeline.routed, pipeline.distinct = routed, distinct
    tokens = sum(len(o) for o in exact)
    engine.stats = Stats()  # the run's figures are its own lines', not the calibration's
    return {"thresholds": chosen["thresholds"], "sensitivity": [round(fits.get(j, 0.0), 6) for j in range(moe_layers)],
            "lines": len(lines), "tokens": tokens, "q": chosen["q"], "agreement": round(chosen["agreement"], 4),
            "skipped_share": chosen["skipped_share"],
            "exact_tokens_per_s": round(tokens / exact_s, 3) if exact_s else None,
            "gated_tokens_per_s": round(tokens / chosen["seconds"], 3) if chosen["seconds"] else None,
            "probes": probes}


def search(passes, smallest: float) -> float:
    """The largest q that `passes(q)`, searched on a log scale: q from
    1/2 divided by STEP_DOWN until a pass (not below `smallest`, about one routing skipped), then
    bisected geometrically with the failure above it until within RESOLUTION; at most MAX_PROBES
    calls. 0.0 when none passed."""
    results = {}
    q = 0.5
    while len(results) < MAX_PROBES:
        results[q] = passes(q)
        if results[q] or q / STEP_DOWN < smallest:
            break
        q /= STEP_DOWN
    while len(results) < MAX_PROBES:
        lo = max((x for x, ok in results.items() if ok), default=None)
        hi = min((x for x, ok in results.items() if not ok and (lo is None or x > lo)), default=None)
        if lo is None or hi is None or hi / lo <= RESOLUTION:
            break
        q = float(np.sqrt(lo * hi))
        results[q] = passes(q)
    # (every failure lies above every pass: the descent stops at its first pass, and bisection
    # probes only between the largest pass and the smallest failure)
    return max((x for x, ok in results.items() if ok), default=0.0)


def agreement_of(exact: list[list[int]], other: list[list[int]]) -> float:
    """The share of greedy tokens equal position by position (over the longer of each pair)."""
    same = total = 0
    for a, b in zip(exact, other):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
    return same / total if total else 1.0


def _decode(engine, lines: list) -> tuple[list[list[int]], float]:
    """Greedy, unconstrained copies of `lines` decoded on `engine`: their tokens and the seconds."""
    copies = [S.Sequence(request=s.request, prompt_ids=list(s.prompt_ids),
                         max_new_tokens=min(s.max_new_tokens, CALIBRATION_TOKENS), temperature=0.0, top_p=1.0,
                         stop=s.stop, generator=None) for s in lines]
    t0 = time.perf_counter()
    for _ in engine.run(copies):
        pass
    return [list(c.out) for c in copies], time.perf_counter() - t0


def _sensitivity(shares: list, costs: list) -> float:
    """S with cost ≈ S · (1 - α)², least squares through the origin."""
    u = np.square(1 - np.concatenate(shares).astype(np.float64))
    c = np.concatenate(costs).astype(np.float64)
    den = float(np.dot(u, u))
    return float(np.dot(u, c) / den) if den > 0 else 0.0


def _threshold(sensitivity: float, bound: float) -> float:
    """The top-1 share at or above which a layer skips: (1 - α)² · S ≤ T."""
    if sensitivity <= 0:
        return 0.0
    return float(min(SKIP_NONE, max(0.0, 1 - np.sqrt(max(bound, 0.0) / sensitivity))))
