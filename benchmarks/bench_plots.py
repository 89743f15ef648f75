"""PNG plots of a `klotski bench` results dict (matplotlib, Agg: no display needed).

Everything is drawn from the results JSON alone (the timeline too: the driver keeps
the decode step's events in it), so the plots can be redrawn without rerunning:

    python benchmarks/bench_plots.py benchmarks/results/bench-medium.json [--img-dir docs/img]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REGIME_LABEL = {"plain": "fits in RAM (memory copies)", "link": "emulated link"}
DISK_LABEL = "bigger than RAM (disk reads)"
SYSTEM_COLOR = {"accelerate": "#7f7f7f", "simple": "#d62728", "multibatch": "#ff7f0e",
                "hot-prefetch": "#2ca02c", "klotski": "#1f77b4"}
LANE_COLOR = {"compute": "#1f77b4", "wait": "#d62728", "weights": "#ff7f0e", "experts": "#2ca02c",
              "kv_load": "#9467bd", "kv_store": "#8c564b", "disk": "#7f7f7f"}
LANES = ("compute", "wait", "weights", "experts", "kv_load", "kv_store", "disk")
# Compute events are named attn.J.bK, gate.J.bK, expert.J.E, embed, lm_head: shade by kind.
OP_COLOR = {"attention": "#1f77b4", "gate": "#aec7e8", "experts": "#17becf", "embed / lm_head": "#393b79"}


def _op_color(name: str) -> str:
    kind = name.split(".", 1)[0]
    return {"attn": OP_COLOR["attention"], "gate": OP_COLOR["gate"],
            "expert": OP_COLOR["experts"]}.get(kind, OP_COLOR["embed / lm_head"])


def _color(d: dict) -> str:
    return SYSTEM_COLOR.get(d["schedule"] or d["system"], "#17becf")


def _regime_label(results: dict, regime: str) -> str:
    if regime == "plain" and results["settings"].get("bigger_than_ram"):
        return DISK_LABEL
    return REGIME_LABEL.get(regime, regime)


def _link_text(results: dict) -> str:
    g = results["settings"].get("link_gbps")
    return f"{g:g} GB/s" if g else "off"


def _subtitle(results: dict) -> str:
    s = results["settings"]
    return (f"{s['preset']} ({s.get('routing') or 'custom'}, {s.get('dtype') or 'checkpoint dtype'}), "
            f"{s['prompts']} prompts x {s['max_new_tokens']} tokens, device {s['device_memory']}, "
            f"host {s['host_memory']}, {s['threads']} thread(s)")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- throughput

def throughput(results: dict, path: Path) -> Path:
    """Median tokens/s per configuration (baselines and ladders), min-max as error bars."""
    order = {"accelerate": 0, "simple": 1, "multibatch": 2, "hot-prefetch": 3, "klotski": 4}
    rows = sorted(((k, d) for k, d in results["systems"].items()
                   if d["role"] in ("baseline", "ladder") and "tokens_per_s" in d["median"]),
                  key=lambda kd: (kd[1]["regime"] == "link", order.get(kd[1]["schedule"] or kd[1]["system"], 9),
                                  kd[1]["batch_size"]))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    ys = list(range(len(rows)))[::-1]
    for y, (key, d) in zip(ys, rows):
        med, lo, hi = d["median"]["tokens_per_s"], d["min"]["tokens_per_s"], d["max"]["tokens_per_s"]
        hatch = "//" if d["regime"] == "link" else None
        ax.barh(y, med, color=_color(d), hatch=hatch, edgecolor="black", linewidth=0.5,
                xerr=[[med - lo], [hi - med]], capsize=3)
        ax.text(hi, y, f"  {med:.1f}", va="center", ha="left", fontsize=8)  # right of the error bar
    ax.set_yticks(ys, [f"{k}  (bs={d['batch_size']}, n={d['num_batches'] or 1})" for k, d in rows], fontsize=8)
    ax.set_xlabel(f"generated tokens/s  (median of {results['settings']['reps']} runs; bars: min-max)")
    ax.set_title(f"Throughput per system\n{_subtitle(results)}", fontsize=10)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label=_regime_label(results, "plain")),
                       Patch(facecolor="white", edgecolor="black", hatch="//",
                             label=f"{REGIME_LABEL['link']} ({_link_text(results)}, Klotski only)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(rows), 1)), ncol=2, fontsize=8)
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


# --------------------------------------------------------------------------- trade-off

def _sweeps(results: dict) -> dict[str, list[dict]]:
    """schedule -> configurations of its n sweep (a point may be a ladder configuration)."""
    by = {}
    for point in results.get("sweep", []):
        d = results["systems"].get(point["key"])
        if d and "tokens_per_s" in d["median"]:
            by.setdefault(point["schedule"], []).append(d)
    return {k: sorted(v, key=lambda d: d["num_batches"]) for k, v in by.items()}


def tradeoff(results: dict, path: Path) -> Path:
    """Figure 11 of the paper: tokens/s against the latency a request sees, over n and bs.

    Left: the n sweep (one group of n x bs prompts per point). Right: the fits-in-RAM
    configurations at their batch sizes, accelerate among them (it cannot be throttled,
    so it only appears where Klotski is not throttled either)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    sweeps = _sweeps(results)
    regime = next((d["regime"] for v in sweeps.values() for d in v), None)
    if not sweeps:
        left.text(0.5, 0.5, "no n sweep in this run\n(--ns was empty)", ha="center", va="center",
                  transform=left.transAxes, fontsize=11, color="#555555")
    for sched, pts in sweeps.items():
        xs = [d["median"]["latency_s"] for d in pts]
        ys = [d["median"]["tokens_per_s"] for d in pts]
        left.plot(xs, ys, "o-", color=SYSTEM_COLOR.get(sched), label=sched)
        for d, x, y in zip(pts, xs, ys):
            left.annotate(f"n={d['num_batches']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    bs = results["settings"]["sweep_batch_size"]
    left.set_title(f"Sweep over n (bs={bs}; {_regime_label(results, regime) if regime else 'no sweep'}"
                   + (f", {_link_text(results)})" if regime == "link" else ")"), fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("latency per request: prefill + decode of its group (s)")
        ax.set_ylabel("generated tokens/s")
        ax.grid(alpha=0.3)
    plain = [(k, d) for k, d in results["systems"].items()
             if d["regime"] == "plain" and d["role"] in ("baseline", "ladder") and "tokens_per_s" in d["median"]]
    for key, d in plain:
        x, y = d["median"]["latency_s"], d["median"]["tokens_per_s"]
        marker = {"accelerate-same-bs": "s", "accelerate-best-bs": "D"}.get(key, "o")
        right.plot([x], [y], marker, color=_color(d), markersize=8,
                   label=f"{key} (bs={d['batch_size']}, n={d['num_batches'] or 1})")
    right.set_title(f"Systems at their batch sizes: {_regime_label(results, 'plain')}", fontsize=10)
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"Throughput-latency trade-off\n{_subtitle(results)}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- bubbles

def bubbles(results: dict, path: Path) -> Path:
    """Share of compute time spent waiting on transfers, over n; ladder medians as markers."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sched, pts in _sweeps(results).items():
        ax.plot([d["num_batches"] for d in pts], [100 * d["median"].get("bubble_share", 0) for d in pts],
                "o-", color=SYSTEM_COLOR.get(sched), label=f"{sched} (sweep, bs={results['settings']['sweep_batch_size']})")
    for key, d in results["systems"].items():
        if d["role"] == "ladder" and d["median"].get("bubble_share") is not None:
            ax.plot([d["num_batches"] or 1], [100 * d["median"]["bubble_share"]],
                    "^" if d["regime"] == "link" else "s", color=_color(d), markersize=8, fillstyle="none",
                    label=f"{key} (ladder, bs={d['batch_size']})")
    ax.set_xscale("log", base=2)
    ns = sorted({d["num_batches"] or 1 for d in results["systems"].values() if d["role"] in ("sweep", "ladder")})
    ax.set_xticks(ns or [1], [str(n) for n in ns] or ["1"])
    ax.minorticks_off()
    ax.set_xlabel("n: batches per group sharing each loaded weight")
    ax.set_ylabel("bubble share (% of compute time waiting)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Pipeline bubbles vs n (link {_link_text(results)})\n{_subtitle(results)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    return _save(fig, path)


# --------------------------------------------------------------------------- timeline

def timeline(results: dict, path: Path) -> Path:
    """One decode step as horizontal bars, one lane per channel (from the run's trace)."""
    tl = results.get("timeline") or {}
    events = tl.get("events") or []
    fig, ax = plt.subplots(figsize=(12, 4))
    lanes = list(LANES)
    for e in events:
        if e["lane"] not in lanes:
            continue
        y = len(lanes) - 1 - lanes.index(e["lane"])
        color = _op_color(e["name"]) if e["lane"] == "compute" else LANE_COLOR[e["lane"]]
        wide = e["dur_ms"] > 0.004 * tl["duration_ms"]  # outlines on slivers would hide their colour
        ax.barh(y, max(e["dur_ms"], 1e-3), left=e["start_ms"], height=0.7, color=color,
                edgecolor="black" if wide else color, linewidth=0.2)
    ax.set_yticks(range(len(lanes)), lanes[::-1])
    ax.set_xlabel("time within the decode step (ms)")
    ax.set_ylabel("lane")
    if events:
        regime = tl.get("regime")
        title = (f"One decode step of klotski (forward {tl['forward']} of {tl['forwards']}, "
                 f"{tl['duration_ms']:.0f} ms), bs={tl.get('batch_size')}, n={tl.get('num_batches')}, "
                 f"{_regime_label(results, regime)}" + (f" {_link_text(results)}" if regime == "link" else ""))
        ax.set_xlim(0, tl["duration_ms"])
    else:
        title = "No trace events recorded"
    ax.set_title(f"{title}\n{_subtitle(results)}", fontsize=10)
    from matplotlib.patches import Patch
    handles = [Patch(color=c, label=f"compute: {k}") for k, c in OP_COLOR.items()]
    handles += [Patch(color=LANE_COLOR[lane], label=lane) for lane in lanes[1:]]
    ax.legend(handles=handles, ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def make_all(results: dict, img_dir: Path, prefix: str) -> dict[str, Path]:
    img_dir = Path(img_dir)
    return {name: fn(results, img_dir / f"{prefix}-{name}.png")
            for name, fn in (("throughput", throughput), ("tradeoff", tradeoff),
                             ("bubbles", bubbles), ("timeline", timeline))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Redraw the plots of a klotski bench results JSON")
    ap.add_argument("results")
    ap.add_argument("--img-dir", default=str(Path(__file__).resolve().parents[1] / "docs" / "img"))
    a = ap.parse_args(argv)
    results = json.loads(Path(a.results).read_text())
    for name, p in make_all(results, Path(a.img_dir), f"bench-{results['settings']['preset']}").items():
        print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
