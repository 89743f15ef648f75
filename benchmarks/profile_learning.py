"""A planner that learns from every run (issue 61): a profile measured while two processes start
busy-looping midway, and predictions before and after runs correct the profile.

    python benchmarks/profile_learning.py spin  [--model tiny-mixtral] [--after 3]
    python benchmarks/profile_learning.py learn [--only NAME,...] [--runs 4]

`spin` measures the model's profile in a fresh cache on the machine as it is, then again in
another fresh cache with two busy-looping processes started `--after` seconds into the measure
(stopped when it ends), and says how each was judged (cached or not, and why), the busy one's
samples against the quiet one's, and the predicted and measured tokens/s of a run from each
cache once the spinners are gone. `learn` runs each configuration `--runs` times in one fresh
cache: the first run's prediction is the measured profile's, the later ones start from what the
runs before them taught it (the median of the later runs is the row). Every figure is printed
with the load average beside it: on a shared machine a run judged busy corrects nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, write_jobs  # noqa: E402

CONFIGS = {
    "offloaded Mixtral-shaped (medium-mixtral, link 2 GB/s)":
        ("wikitext:32", ["--model", "medium-mixtral", "--emulate-link", "2", "--device-memory", "900MB",
                         "--host-memory", "8GiB", "--max-new-tokens", "16"]),
    "trained model, shared prefixes (smollm2-moe, labels)":
        ("labels", ["--model", "smollm2-moe", "--device-memory", "900MiB"]),
    "tiny-mixtral, link 2 GB/s": ("wikitext:32", ["--model", "tiny-mixtral", "--emulate-link", "2",
                                                   "--device-memory", "7000000", "--max-new-tokens", "16"]),
    # klotski.measure.op_count.build_fine_and_coarse's 128-expert twin (Qwen3-shaped, top-8,
    # each expert 128 wide, 3 layers, fp32), every expert resident: the plan's waves and empty groups
    "fine-grained 128 experts (Qwen3-shaped, 3 layers)":
        ("wikitext:32", ["--model", "{fine}", "--dtype", "float32", "--max-new-tokens", "16"]),
}


def fine_grained_model(tmp: Path) -> Path:
    from klotski.measure.op_count import FINE
    from klotski.builtin.families import build_family
    return build_family(tmp / "qwen3-128", "qwen3_moe", num_experts=FINE, num_experts_per_tok=8,
                        moe_intermediate_size=128, num_hidden_layers=3)


def load() -> str:
    return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def klotski(args: list[str], cache: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run([sys.executable, "-m", "klotski.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, **kw)


def run(jobs: Path, report: Path, flags: list[str], cache: Path) -> dict:
    done = klotski(["generate", str(jobs), "-o", str(report.with_suffix(".out.jsonl")), "--no-resume",
                    "--no-progress", "--report", str(report), *flags], cache)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    r = json.loads(report.read_text())
    r["load"] = load()
    return r


def profile_file(cache: Path) -> dict:
    where = cache / "klotski" / "profiles"
    files = [f for f in sorted(where.glob("*.json")) + sorted(where.glob("*.busy")) if "overhead" not in f.name]
    return json.loads(files[0].read_text()) if files else {}


def spin(a, tmp: Path) -> None:
    jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", 16, tmp / "jobs.jsonl")
    flags = ["--model", a.model, "--max-new-tokens", "16"]
    out = {}
    for name in ("quiet", "spinners"):
        cache = tmp / name
        spinners, started = [], time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "klotski.cli", "profile", "--model", a.model],
                                env={**os.environ, "XDG_CACHE_HOME": str(cache)}, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if name == "spinners":
            time.sleep(a.after)
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        at_end = None
        try:
            _, err = proc.communicate()
            at_end = load()
        finally:
            for s in spinners:
                s.kill()
                s.wait()
        prof = profile_file(cache)
        out[name] = {"measure_s": round(time.perf_counter() - started, 1), "load_at_end": at_end,
                     "judged": prof.get("judged", {}).get("verdict"), "samples": prof.get("samples", {})}
        print(f"{name}: measured in {out[name]['measure_s']} s ({at_end}); {out[name]['judged']}", flush=True)
        time.sleep(a.settle)  # the spinners' load leaves the load average
        r = run(jobs, tmp / f"{name}.json", flags, cache)
        out[name].update(predicted=r["predicted_tokens_per_s"], measured=r["tokens_per_s"], run_load=r["load"])
        print(f"  next run: predicted {r['predicted_tokens_per_s']:.1f} tok/s, measured {r['tokens_per_s']:.1f} "
              f"({r['load']}); profile: {(r.get('profile') or {}).get('why') or 'corrected'}", flush=True)
    quiet, busy = out["quiet"]["samples"], out["spinners"]["samples"]
    ratios = [b[-1] / q[-1] for kind in quiet for q, b in zip(quiet[kind], busy.get(kind, []))]
    if ratios:
        print(f"spinners' profile / quiet profile, per sample: median {statistics.median(ratios):.2f}, "
              f"max {max(ratios):.2f}")


def replay_ratio(r: dict) -> float:
    """The plan replayed over the run's own lengths and routing (the cost model alone, the
    job's unknowns taken out) against the run: (prefill + decode) predicted / measured."""
    return (r["replayed_prefill_s"] + r["replayed_decode_s"]) / max(r["prefill_s"] + r["decode_s"], 1e-9)


def phases(r: dict) -> str:
    """Predicted against measured seconds per phase (the plan's own, as planned), and the
    answer tokens the plan priced against those the run generated."""
    ans = r["plan"].get("answer_lengths") or {}
    return (f"prefill {r.get('predicted_prefill_s') or 0:.2f}/{r['prefill_s']:.2f} s, "
            f"decode {r.get('predicted_decode_s') or 0:.2f}/{r['decode_s']:.2f} s, answer tokens "
            f"{ans.get('answer_tokens', '?')}/{r['tokens']['generated']} ({ans.get('source', '?')})")


def learned(r: dict) -> str:
    p = r.get("profile") or {}
    lengths = (p.get("answer_lengths") or {})
    return ("profile " + ("corrected" if p.get("corrected") else f"not corrected: {p.get('why')}")
            + "; lengths " + ("learned" if lengths.get("learned") else f"not learned: {lengths.get('why')}"))


def learn(a, tmp: Path) -> None:
    rows = []
    for i, (name, (job, flags)) in enumerate(CONFIGS.items()):
        if a.only and not any(part in name for part in a.only.split(",")):
            continue
        if "{fine}" in flags:
            flags = [str(fine_grained_model(tmp)) if f == "{fine}" else f for f in flags]
        if job == "labels":
            jobs = ROOT / "jobs" / "labels.jsonl"
        else:
            jobs = write_jobs(ROOT / "jobs" / "wikitext.jsonl", int(job.split(":")[1]), tmp / f"jobs{i}.jsonl")
        cache = tmp / f"cache{i}"
        runs = []
        for k in range(a.runs):
            r = run(jobs, tmp / f"run{i}-{k}.json", flags, cache)
            runs.append(r)
            print(f"  {name} run {k + 1}: predicted {r['predicted_tokens_per_s']:.1f}, measured "
                  f"{r['tokens_per_s']:.1f} tok/s (x{r['predicted_tokens_per_s'] / r['tokens_per_s']:.2f}); "
                  f"{phases(r)}; replayed/measured seconds {replay_ratio(r):.2f}; {r['load']}; {learned(r)}",
                  file=sys.stderr, flush=True)
        ratio = lambda r: r["predicted_tokens_per_s"] / r["tokens_per_s"]  # noqa: E731
        later = statistics.median(ratio(r) for r in runs[1:]) if len(runs) > 1 else float("nan")
        replayed = statistics.median(replay_ratio(r) for r in runs[1:]) if len(runs) > 1 else float("nan")
        rows.append(f"| {name} | {ratio(runs[0]):.2f} | {later:.2f} | {replay_ratio(runs[0]):.2f} | {replayed:.2f} | "
                    f"{'; '.join(r['load'] for r in runs)} |")
    print("| configuration | run 1: predicted / measured tok/s | runs 2-N (median) | run 1: replayed / measured "
          "seconds | runs 2-N (median) | loads |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("spin", "learn"))
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--after", type=float, default=3.0, help="seconds into the measure the spinners start")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds to wait after the spinners stop")
    ap.add_argument("--only", help="comma-separated configuration names (substrings)")
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="klotski-learning-"))
    (spin if a.what == "spin" else learn)(a, tmp)


if __name__ == "__main__":
    main()
