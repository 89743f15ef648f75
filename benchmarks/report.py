"""Render a `klotski bench` results JSON as a Markdown section (for docs/benchmarks.md).

    python benchmarks/report.py benchmarks/results/bench-medium.json [-o docs/bench-section.md]

Everything in the section comes from the JSON: machine, exact command, tables of medians
and spreads, ratios against the issue's targets, every output disagreement, what was
not run and why, and links to the plots. The discussion is left as a list of the
measured facts to explain, because why a ratio is what it is needs a human reading the
trace, not a template.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASH = "–"


def _num(v, fmt="{:.2f}") -> str:
    return DASH if v is None else fmt.format(v)


def _bytes(v) -> str:
    if v is None:
        return DASH
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def _pct(v) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def _spread(d: dict, key: str, fmt="{:.2f}") -> str:
    lo, hi = d["min"].get(key), d["max"].get(key)
    return DASH if lo is None else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _link(path: str, base: str) -> str:
    """Plot path as seen from the section's directory (docs/ by default)."""
    p = Path(path)
    if not p.is_absolute() and p.parts[:1] == (base,):
        return str(Path(*p.parts[1:]))
    return str(p)


def _h2d(m: dict) -> tuple[str, str, str]:
    """Bytes host->device, GB/s while the channels were busy, GB/s over the whole generation."""
    nbytes, gen_s = m.get("host_to_device.bytes"), (m.get("prefill_s") or 0) + (m.get("decode_s") or 0)
    mean = nbytes / gen_s / 1e9 if nbytes and gen_s else None
    return _bytes(nbytes), _num(m.get("host_to_device.gb_per_s")), _num(mean)


# --------------------------------------------------------------------------- sections

def _machine(r: dict) -> list[str]:
    m, s = r["machine"], r["settings"]
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    lines = [f"Measured {r.get('created', '')} on **{m.get('cpu')}**, {m.get('cores')} cores, {ram}, "
             f"Linux {m.get('kernel')}; Python {m.get('python')}, torch {m.get('torch')}, "
             f"transformers {m.get('transformers')}, accelerate {m.get('accelerate')}. "
             f"Load average at start {m.get('loadavg_at_start')}, at end {m.get('loadavg_at_end', DASH)} "
             f"(a shared machine: spreads include neighbours' work).", "",
             "```", s["command"], "```", ""]
    code = r.get("code")
    if code:
        start, end = code["at_start"], code["at_end"]
        dirty = f", {len(start['uncommitted'])} uncommitted file(s)" if start["uncommitted"] else ""
        lines += [f"Code: commit `{start['commit']}`{dirty} (sources `{start['source_sha256']}`)."
                  + (f" **The sources changed during the run** (to commit `{end['commit']}`, sources "
                     f"`{end['source_sha256']}`): the repetitions mix versions." if code["changed_during_run"] else ""), ""]
    model = f"`{s['preset']}` preset, {s.get('routing')} routing, built in {s.get('dtype')}" \
        if s["preset"] != "custom" else f"checkpoint `{s['model_dir']}`"
    lines.append(f"Model: {model} ({_bytes(s['model_bytes'])} on disk). Job: the first {s['prompts']} "
                 f"prompts of `{Path(s['jobs_source']).name}`, {s['max_new_tokens']} new tokens each (greedy). "
                 f"Budgets: device {s['device_memory']}, host {s['host_memory']}. Every process pinned to "
                 f"{s['threads']} torch thread(s). {s['reps']} measured repetitions after a warm-up, "
                 f"configurations interleaved in each round (order: {', '.join(r['order'])}). Klotski reads "
                 f"weights {'with O_DIRECT' if s['direct_io'] else 'through the page cache'}; "
                 f"emulated link: {str(s['link_gbps']) + ' GB/s' if s['link_gbps'] else 'off'}.")
    if s.get("single_batch_prompts"):
        lines.append(f"Single-batch configurations (simple, accelerate at Klotski's batch size) served the first "
                     f"{s['single_batch_prompts']} prompts (whole batches): their weight pass serves one batch, "
                     "so a few batches measure their rate (column *prompts*).")
    if s.get("memory_limit_bytes"):
        lines.append(f"Every process ran in a memory cgroup of {_bytes(s['memory_limit_bytes'])} (device + host "
                     "budgets + 2 GiB for the runtime), page cache included, so memory-mapped reads got no more "
                     "RAM than O_DIRECT ones" + ("; the page cache was dropped before every run." if s.get("cold_cache")
                                                 else "."))
    if s.get("disk_read"):
        samples = [x for when in ("start", "end") for x in s["disk_read"].get(when, [])]
        rates = ", ".join(_num(x.get("gb_per_s")) for x in samples)
        lines.append(f"Disk: sequential O_DIRECT read bandwidth **{_num(s.get('disk_read_gbps'))} GB/s**, the "
                     f"median of {len(samples)} reads of 2 GB before and after the run ({rates} GB/s; e.g. "
                     f"`{samples[0]['command']}`), the physical limit of the bigger-than-RAM regime. The model "
                     f"is {'bigger' if s.get('bigger_than_ram') else 'smaller'} than this machine's RAM.")
    return lines


def _plans(r: dict) -> list[str]:
    out = []
    for regime, p in r["plans"].items():
        name = _regime(r, regime)
        out.append(f"- Planner ({name}): bs={p['batch_size']}, n={p['num_batches']} "
                   f"(asked for n={p['num_batches_planned']}; the job has {p['groups']} group(s)), "
                   f"predicted {_num(p['predicted_tokens_per_s'])} tokens/s.")
    mb = r.get("accelerate_max_batch")
    if mb and not mb.get("searched", True):
        out.append(f"- accelerate's best batch: {mb['best_batch_size']} ({mb['note']}).")
    elif mb:
        tried = ", ".join(f"{c['batch_size']} ({'fits' if c['fits'] else 'does not fit'})" for c in mb["candidates"])
        out.append(f"- accelerate's best batch: {mb['best_batch_size']} (max_batch.py search; tried {tried}; "
                   f"{mb['note']}; criterion: {mb['criterion']}).")
    return out


LADDER_ORDER = {"accelerate": 0, "simple": 1, "multibatch": 2, "hot-prefetch": 3, "klotski": 4}


def _ordered(r: dict) -> list[tuple[str, dict]]:
    """Baselines and ladders: fits-in-RAM first, each in ladder order (the sweep has its own table)."""
    rows = [(k, d) for k, d in r["systems"].items() if d["role"] != "sweep"]
    return sorted(rows, key=lambda kd: (kd[1]["regime"] != "plain",
                                        LADDER_ORDER.get(kd[1]["schedule"] or kd[1]["system"], 9), kd[1]["batch_size"]))


def _regime(r: dict, regime: str) -> str:
    if regime != "plain":
        return f"link {r['settings']['link_gbps']:g} GB/s"
    return "from disk" if r["settings"].get("bigger_than_ram") else "in RAM"


def _predicted(d: dict) -> str:
    """The planner re-reads its cached machine profile every run, so its prediction can move too."""
    m, lo, hi = (d[k].get("predicted_tokens_per_s") for k in ("median", "min", "max"))
    if m is None:
        return DASH
    return f"{m:.2f}" if lo == hi else f"{m:.2f} ({lo:.2f}–{hi:.2f})"


def _memory(m: dict) -> str:
    """Peak RSS, and with a memory cgroup the peak it charged (RSS + page cache)."""
    rss, group = _bytes(m.get("peak_rss_bytes")), m.get("peak_cgroup_bytes")
    return rss if group is None else f"{rss} ({_bytes(group)} with page cache)"


def _main_table(r: dict) -> list[str]:
    reps = r["settings"]["reps"]
    head = ["config", "regime", "prompts", "bs", "n", f"tokens/s (median of {reps})", "min–max", "predicted tok/s",
            "TTFT/group (s)", "latency/group (s)", "wall (s)", "peak RSS", "peak device", "host→device",
            "GB/s busy", "GB/s mean", "disk GB/s (decode)", "bubble"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, d in _ordered(r):
        m = d["median"]
        if "tokens_per_s" not in m:
            lines.append(f"| {key} | {_regime(r, d['regime'])} | {d['prompts']} | {d['batch_size']} | "
                         f"{d['num_batches'] or 1} | failed |" + " |" * (len(head) - 6))
            continue
        moved, bw, mean = _h2d(m)
        if d["system"] == "accelerate":
            mapped = m.get("disk_mmap_upper_bound.bytes")
            moved = f"≤ {_bytes(mapped)} mapped" if mapped else "none (all resident)"
        lines.append("| " + " | ".join([
            key, _regime(r, d["regime"]), str(d["prompts"]), str(d["batch_size"]),
            str(d["num_batches"] or 1), f"**{m['tokens_per_s']:.2f}**", _spread(d, "tokens_per_s"),
            _predicted(d), _num(m.get("ttft_s")), _num(m.get("latency_s")),
            _num(m.get("process_wall_s"), "{:.1f}"), _memory(m),
            _bytes(m.get("peak_device_bytes")), moved, bw, mean, _num(m.get("decode_disk_gb_per_s")),
            _pct(m.get("bubble_share"))]) + " |")
    return lines


def _sweep_table(r: dict) -> list[str]:
    rows = [(p["key"], r["systems"][p["key"]]) for p in r.get("sweep", []) if p["key"] in r["systems"]]
    if not rows:
        return ["No n sweep in this run."]
    lines = ["| schedule | regime | n | bs | prompts (one group) | tokens/s | min–max | latency (s) | bubble | "
             "host→device | GB/s busy | GB/s mean | config |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, d in sorted(rows, key=lambda kd: (kd[1]["schedule"], kd[1]["num_batches"])):
        m = d["median"]
        if "tokens_per_s" not in m:
            lines.append(f"| {d['schedule']} | {_regime(r, d['regime'])} | {d['num_batches']} | {d['batch_size']} | "
                         f"{d['prompts']} | failed | | | | | | | {key} |")
            continue
        moved, bw, mean = _h2d(m)
        lines.append(f"| {d['schedule']} | {_regime(r, d['regime'])} | {d['num_batches']} | {d['batch_size']} | {d['prompts']} | "
                     f"{m['tokens_per_s']:.2f} | {_spread(d, 'tokens_per_s')} | {_num(m.get('latency_s'))} | "
                     f"{_pct(m.get('bubble_share'))} | {moved} | {bw} | {mean} | {key} |")
    return lines


def _ratio_table(r: dict) -> list[str]:
    lines = ["| ratio (tokens/s medians) | measured | target | target set for | met |", "|---|---|---|---|---|"]
    for x in r["ratios"]:
        if not x["target"]:
            target, met = DASH, DASH
        elif not x.get("target_applies", True):
            target, met = f"(≥ {x['target']:g}×)", "n/a: other regime"
        else:
            target, met = f"≥ {x['target']:g}×", "yes" if x["met"] else "**no**"
        lines.append(f"| {x['name']} | {_num(x['value'], '{:.2f}×')} | {target} | {x['target_regime'] or DASH} | {met} |")
    return lines


def _agreement(r: dict) -> list[str]:
    ag = r["agreement"]
    runs = sum(v["runs"] for v in ag["per_config"].values())
    if ag["all_identical"]:
        return [f"All {runs} compared runs (warm-ups included) produced the same greedy token ids as the "
                f"reference ({ag['reference']}) for all {ag['ids']} prompts (`benchmarks/baselines/compare.py`)."]
    lines = [f"**{len(ag['disagreements'])} run(s) disagree** with the reference ({ag['reference']}):", "",
             "| config | run | compared | differing | first difference (id, position, expected, got) | "
             "missing | extra | without token ids |", "|---|---|---|---|---|---|---|---|"]
    for d in ag["disagreements"]:
        f = d["first_difference"]
        first = DASH if not f else f"{f['id']}, {f['position']}, {f['expected']}, {f['got']}"
        lines.append(f"| {d['config']} | {d['run']} | {d['compared']} | {d['differing']} | {first} | "
                     f"{len(d['missing_ids'])} | {len(d['extra_ids'])} | {len(d['without_token_ids'])} |")
    return lines


def _failures(r: dict) -> list[str]:
    if not r.get("failures"):
        return []
    lines = ["", "Failed runs:", ""]
    for f in r["failures"]:
        last = f["log_tail"].strip().splitlines()[-1:] or [""]
        lines.append(f"- {f['config']} ({f['run']}): exit {f['returncode']}: `{last[0][:200]}`")
    return lines


def _discussion(r: dict) -> list[str]:
    """Measured facts the discussion has to explain; the explanations are the writer's job."""
    by = {x["name"]: x for x in r["ratios"]}
    lines = ["Placeholders: each line is a measured fact from this run; replace the *why* with what the trace "
             "and the tables show.", ""]
    for x in r["ratios"]:
        tgt = ""
        if x["target"]:
            tgt = (f" against a target of ≥ {x['target']:g}× ({x['target_regime']})" if x.get("target_applies", True)
                   else f" (the issue's ≥ {x['target']:g}× is for the {x['target_regime']} regime, not this one)")
        verdict = "" if x["met"] is None else (" — met." if x["met"] else " — **not met**.")
        lines.append(f"- `{x['name']}` = {_num(x['value'], '{:.2f}×')}{tgt}{verdict or '.'} Why: _to do_.")
    if not by:
        lines.append("- No ratios: some systems were not run.")
    if not r["settings"].get("bigger_than_ram"):
        lines.append("- Bigger-than-RAM targets (≥ 10× / ≥ 1.5× accelerate, ≥ 85% of the disk's sequential read "
                     "bandwidth during decode) are not measured here; see *Not run*.")
    return lines


def render(results: dict, link_base: str = "docs") -> str:
    r, s = results, results["settings"]
    out = [f"## `klotski bench`: {s['preset']} preset" + (f", {s['routing']} routing" if s.get("routing") else ""), ""]
    out += _machine(r) + [""] + _plans(r) + [""]
    title = "bigger-than-RAM regime" if s.get("bigger_than_ram") else "fits-in-RAM regime" + (
        " and emulated link" if s.get("link_gbps") else "")
    out += [f"### Systems ({title})", ""] + _main_table(r)
    out += ["", "TTFT/group: prefill time per batch group (every sequence of a group gets its first token "
                "when the group's prefill ends); latency/group: prefill + decode per group; wall: the whole "
                "process, start-up and loading included; peak RSS: the process's high-water mark (`wait4`); "
                "peak device: Klotski's device-tier accounting, for accelerate the weights it keeps resident; "
                "disk GB/s (decode): bytes Klotski read from disk while decode steps ran / decode time; "
                "GB/s busy: host→device bytes / summed busy seconds of the channels that moved them "
                "(a lower bound on the rate while moving: channels overlap, and with an emulated link a "
                "transfer's busy time includes queueing for the shared link); GB/s mean: the same bytes / "
                "prefill + decode time. "
                "accelerate's transfers are memory-mapped reads inside its hooks and are not instrumented "
                "(the upper bound counts every offloaded weight once per forward)."]
    out += ["", "### Sweep over n (throughput–latency)", ""] + _sweep_table(r)
    out += ["", "### Ratios, measured in the same run", ""] + _ratio_table(r)
    out += ["", "### Do all systems produce the same tokens?", ""] + _agreement(r) + _failures(r)
    out += ["", "### Not run", ""]
    out += [f"- **{x['system']}**: {x['reason']}" for x in r.get("skipped", [])]
    if not s.get("bigger_than_ram"):
        out += ["- **Bigger-than-RAM regime**: `klotski bench --preset xl`, run by hand (about an hour); "
                "see its own section."]
    out += [f"- {n}" for n in r.get("notes", [])]
    out += ["", "### Plots", ""]
    titles = {"throughput": "Throughput per system", "tradeoff": "Throughput–latency trade-off over n and batch size",
              "bubbles": "Bubble share vs n", "timeline": "One decode step (trace)"}
    for name, path in r.get("plots", {}).items():
        out += [f"![{titles.get(name, name)}]({_link(path, link_base)})", ""]
    out += ["### Discussion", ""] + _discussion(r)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="results JSON written by klotski bench")
    ap.add_argument("-o", "--output", default=str(ROOT / "docs" / "bench-section.md"))
    a = ap.parse_args(argv)
    text = render(json.loads(Path(a.results).read_text()))
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(text)
    print(f"wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
