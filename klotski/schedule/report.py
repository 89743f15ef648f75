"""A run's report (the JSON at --report) and its summary on stderr, built from the engine's
numbers once the run has ended. The caller passes in what it computed (counts, wall time,
how to replan for the replay); nothing here runs or plans anything itself."""
from __future__ import annotations

import json
from pathlib import Path

from klotski.errors import UserError
from placement.split import resident_hit_rates
from placement.tiers import DEVICE
from klotski.schedule.prefix import report as prefix_report
from klotski.util.writes import WriteFailed, replace_atomically

REPLAY_SAMPLE = 65536  # answers the replay prices at most (it walks every batch and slot)


def save_report(path, report: dict) -> None:
    replace_atomically(Path(path), (json.dumps(report, indent=2) + "\n").encode())


def build_report(engine, setup, *, ok: int, failed: int, skipped: int, wall_s: float, config,
                 model_dir) -> dict:
    report = {"tokens_per_s": 0.0, "predicted_tokens_per_s": None, "prefill_s": 0.0, "decode_s": 0.0,
              "wall_s": round(wall_s, 4), "requests": {"ok": ok, "failed": failed, "skipped": skipped},
              "tokens": {"prompt": 0, "generated": 0}, "model": str(model_dir),
              "order": (f"the job file streams in windows of {config.window} lines; in each window prompts are "
                        + ("grouped by routing, n x bs lines whose prompts pick similar experts, longest first "
                           "within a group" if config.order == "routing" else
                           "sorted longest first and batched in that order (similar lengths share a batch and pad "
                           "little)") + "; records are keyed by id and written as they finish"),
              "config": config.to_json()}
    if engine is None:
        return report
    s, plan = engine.stats, setup.plan
    gen_s = s.prefill_s + s.decode_s
    report.update({
        "tokens_per_s": round(s.generated_tokens / gen_s, 3) if gen_s else 0.0,
        "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 3) if plan else None,
        # the plan's own seconds for the job's first window's lengths, as planned (answers at the
        # lengths it assumed or learned), beside the measured prefill_s and decode_s
        "predicted_prefill_s": round(plan.job_prefill_s, 4) if plan and plan.job_prefill_s else None,
        "predicted_decode_s": round(plan.job_decode_s, 4) if plan and plan.job_decode_s else None,
        "prefill_s": round(s.prefill_s, 4),
        "decode_s": round(s.decode_s, 4),
        "decode_steps": s.decode_steps,
        "tokens": {"prompt": s.prompt_tokens, "generated": s.generated_tokens},
        "plan": {"batch_size": setup.batch_size, "num_batches": setup.num_batches,
                 "prefill_chunk": setup.prefill_chunk, "prefill_passes": s.prefill_passes,
                 "hot_experts": engine.pipeline.K, "schedule": config.schedule,
                 "placement": setup.placement.summary(),
                 "buffers": plan.buffers if plan else None, "binding": plan.binding if plan else None,
                 # the precision run; under --quantize auto, every option weighed and why this one
                 "precision": {"quantize": setup.quantize, **(plan.precision if plan and plan.precision else {})},
                 # GGUF experts kept decoded in host RAM on a CPU, or why not (planning.decoded_copies)
                 "decoded_copies": {k: v for k, v in setup.decoded_copies.items() if k != "say"},
                 # where the answer lengths the plan's time was priced at came from (assumed max_tokens,
                 # or learned from runs: planner/answer_lengths.py)
                 "answer_lengths": plan.answer_lengths if plan else {}},
        "memory": {"peak_device_bytes": engine.memory.peak, "budget_device_bytes": engine.memory.budget,
                   "peak_host_bytes": engine.host_memory.peak, "budget_host_bytes": engine.host_memory.budget,
                   **_allocator(engine)},
        "io": {"bytes": dict(engine.trace.bytes), "decode_bytes": dict(engine.trace.decode_bytes),
               "busy_s": {k: round(v, 4) for k, v in engine.trace.busy.items()},
               "experts_loaded": engine.pipeline.experts_loaded,
               # of those, moved in runs of one layer's experts per submission (into pool slots, or
               # stacked in a Landing of their own while the pool was full)
               "experts_landed_stacked": engine.cache.experts_landed_stacked,
               # the device's expert pool: slots transferred experts land in, held for the run
               "expert_pool_slots": engine.cache.pool.slots if engine.cache.pool else 0,
               # Disk bytes per second of decode wall time: how busy decode kept the disk.
               "decode_disk_bytes": s.decode_disk_bytes,
               "decode_disk_gb_per_s": round(s.decode_disk_bytes / s.decode_s / 1e9, 4) if s.decode_s else None},
        "decode_slot_utilisation": round(s.slot_utilisation, 4) if s.slot_utilisation is not None else None,
        "decode_occupancy": round(s.occupancy, 4) if s.occupancy is not None else None,
        "batching": {"mode": engine.config.batching, "refills": s.refills, "kv_realigns": s.kv_realigns,
                     "rows_moved": s.rows_moved, "prompt_tokens_in_decode_steps": s.decode_prompt_tokens,
                     "order": ("waiting prompts longest max_new_tokens first; a freed row takes the next"
                               if engine.config.batching == "continuous" else
                               "longest prompts first, n batches of bs per group")},
        # --order: how a window's lines waited, and what decode steps asked of the experts and the link
        "line_order": order_report(engine),
        "bubble": {"seconds": round(engine.trace.bubble_s, 4), "share": round(engine.trace.bubble_share(), 4),
                   "decode_share": round(engine.trace.bubble_share(decode_only=True), 4)},
        # busy seconds and the bubble are estimated from the timed steps (one in `every` a phase)
        "timing": {"every": engine.trace.every, "steps": dict(engine.trace.steps),
                   "timed_steps": dict(engine.trace.timed_steps)},
        "prefetch": engine.predictor.report(),
        # the emulated host->device link: demand loads' waits for it, the prefetches' chunks
        # (execute/channels.EmulatedLink); None without --emulate-link
        "link": engine.channels["experts"].link_report() if "experts" in engine.channels else None,
        # the share of each MoE layer's routed picks whose expert was resident, and how the
        # resident experts were divided among layers (--expert-split: placement/split.py)
        "experts": resident_hits(engine, setup),
        "host_compute": engine.pipeline.host.report(),
        # --adaptive-gating: pairs skipped, demand loads not made, and the calibration (schedule/gating.py)
        "adaptive_gating": None if engine.pipeline.gating is None else engine.pipeline.gating.report(),
        "prefix_cache": prefix_report(engine),
        # CPU compute threads over the run: [seconds into it, threads] at each change (util/threads.py)
        "threads": None if engine.threads is None else {"history": engine.threads.history,
                                                        "fixed": bool(engine.threads.fixed)},
    })
    return report


def order_report(engine) -> dict:
    """The lines' order (--order) and its measures: distinct experts a MoE layer's routing chose
    per step where every row decoded, and in the other steps (Pipeline.distinct), and host->device
    bytes moved in decode steps per generated token."""
    s, link = engine.stats, engine.trace.decode_bytes.get("host_to_device", 0)
    per_step = {f"distinct_experts_per_{phase}_layer_step": round(chosen / steps, 3) if steps else None
                for phase, (chosen, steps) in engine.pipeline.distinct.items()}
    return {"policy": engine.config.order, **per_step,
            "decode_link_bytes_per_token": round(link / s.generated_tokens) if s.generated_tokens else None}


def resident_hits(engine, setup) -> dict:
    """Per MoE layer, the share of the picks routed there that found their expert resident on the
    device (the run's routing, Pipeline.routed), the whole run's share, and the split."""
    shape, tiers = engine.spec.shape, setup.placement.tiers
    layers = [j for j in range(shape.num_layers) if shape.experts_in(j)]
    resident = [[tiers.get(("expert", j, e)) == DEVICE for e in range(shape.num_experts)] for j in layers]
    routed = engine.pipeline.routed
    total = routed.sum()
    return {"split": setup.expert_split,
            "resident_per_layer": [sum(row) for row in resident],
            "hit_rate": round(float((routed * resident).sum() / total), 4) if total else None,
            "hit_rate_per_layer": resident_hit_rates(routed, resident)}


def _allocator(engine) -> dict:
    """On CUDA, what the caching allocator itself saw since the engine was built: its peak
    above the baseline (the accounts promise this stays within the device budget) and
    whether it ever had to free cached blocks and retry (fragmentation)."""
    if engine.device.type != "cuda":
        return {}
    import torch
    stats = torch.cuda.memory_stats(engine.device)
    return {"allocator_peak_device_bytes": stats["allocated_bytes.all.peak"] - engine.memory.allocator_baseline,
            "cuda_runtime_bytes": engine.memory.runtime_bytes,
            "allocator_reserved_peak_bytes": stats["reserved_bytes.all.peak"],
            "allocator_retries": stats["num_alloc_retries"]}


def replayed(prompt_lens, gen_lens, replan) -> dict:
    """The plan over the lengths the answers had: its tokens/s, and its prefill and decode
    seconds for the whole job, to set beside the measured ones. `replan(prompt_lens,
    gen_lens)` is planning.replayed_plan for this run (None: the run had no plan to replay)."""
    none = {"replayed_tokens_per_s": None}
    if replan is None or not gen_lens:
        return none
    scale = 1.0
    if len(gen_lens) > REPLAY_SAMPLE:  # a rate: an even sample of a long job's answers tells it
        step = len(gen_lens) / REPLAY_SAMPLE
        pick = [int(i * step) for i in range(REPLAY_SAMPLE)]
        prompt_lens, gen_lens = [prompt_lens[i] for i in pick], [gen_lens[i] for i in pick]
        scale = step
    try:
        plan = replan(prompt_lens, gen_lens)
    except (UserError, ValueError):  # the plan's budgets were refused for these lengths: no replay, not no report
        return none
    except WriteFailed:  # a profile to measure and the disk refused its probe: a figure missing, not the run
        return none
    if not plan or not plan.predicted_tokens_per_s:
        return none
    return {"replayed_tokens_per_s": round(plan.predicted_tokens_per_s, 3),
            "replayed_prefill_s": round(plan.job_prefill_s * scale, 4),
            "replayed_decode_s": round(plan.job_decode_s * scale, 4),
            # continuous batching: the passes the replay made (set beside the run's `prefill_passes`)
            "replayed_prefill_passes": round(plan.job_prefill_passes * scale, 1) if plan.job_prefill_passes else None}


def summary(report: dict, out_path: Path) -> str:
    t = report["tokens"]
    lines = [requests_line(report["requests"]), f"tokens    {t['prompt']} prompt, {t['generated']} generated"]
    if "memory" in report:
        mem, plan = report["memory"], report["plan"]
        lines += [
            f"speed     {report['tokens_per_s']:.1f} tok/s (prefill {report['prefill_s']:.2f} s, "
            f"decode {report['decode_s']:.2f} s)"
            + (f"; planner predicted {report['predicted_tokens_per_s']:.1f}" if report["predicted_tokens_per_s"] else "")
            + (f" ({report['replayed_tokens_per_s']:.1f} for the answers' actual lengths and routing: prefill "
               f"{report['replayed_prefill_s']:.2f} s, decode {report['replayed_decode_s']:.2f} s)"
               if report.get("replayed_tokens_per_s") else ""),
            f"plan      batch size {plan['batch_size']} x {plan['num_batches']} batches"
            + (f", prefill in chunks of {plan['prefill_chunk']} tokens" if plan["prefill_chunk"] else ""),
            *([f"precision {plan['precision']['chosen']}: {plan['precision']['why']}"]
              if plan.get("precision", {}).get("why") else []),
            *answers_line(plan.get("answer_lengths")),
            f"bubble    {report['bubble']['share']:.1%} of compute time waiting on transfers",
            *([f"slots     {report['decode_slot_utilisation']:.0%} of decode rows computed served a sequence still "
               f"generating; {report['decode_occupancy']:.0%} of the group's rows did "
               + ("(continuous batching: {} rows refilled, {} prompt tokens prefilled inside decode "
                  "steps; finished rows are not computed)".format(
                   report["batching"]["refills"], report["batching"]["prompt_tokens_in_decode_steps"])
                  if report["batching"]["mode"] == "continuous" else
                  "(static batching: a batch keeps its slots until its longest sequence ends)")]
              if report["decode_slot_utilisation"] is not None else []),
            *_prefetch_line(report["prefetch"]),
            *host_line(report.get("host_compute")),
            *gating_line(report.get("adaptive_gating")),
            *_prefix_line(report.get("prefix_cache")),
            *profile_line(report.get("profile")),
            f"memory    peak device {mem['peak_device_bytes'] / 2**20:.1f} of {mem['budget_device_bytes'] / 2**20:.1f} MiB, "
            f"host {mem['peak_host_bytes'] / 2**20:.1f} of {mem['budget_host_bytes'] / 2**20:.1f} MiB",
        ]
    return "\n".join(lines + closing_lines(report, out_path))


def requests_line(r: dict) -> str:
    """The summary's first line, of a run in one process or on Ray."""
    return f"requests  {r['ok']} ok, {r['failed']} failed" + (f", {r['skipped']} already done" if r["skipped"] else "")


def closing_lines(report: dict, out_path: Path) -> list[str]:
    """The summary's last lines, of a run in one process or on Ray."""
    return [f"wall      {report['wall_s']:.1f} s", f"output    {out_path}"]


def host_line(host: dict | None) -> list[str]:
    """What host compute did (attention beside a host KV cache, experts where they live)."""
    if not host or host["attention"]["mode"] == host["experts"]["mode"] == "off":
        return []
    a, e = host["attention"], host["experts"]
    return [f"host      attention on the host in {a['batches_layers_on_host']} batch-layers "
            f"({a['kv_bytes_not_moved'] / 2**20:.1f} MiB of KV not moved, {a['host_s']:.2f} s; {a['mode']}), "
            f"{e['experts_on_host']} experts on the host ({e['bytes_not_moved'] / 2**20:.1f} MiB not moved, "
            f"{e['host_s']:.2f} s; {e['mode']})"]


def gating_line(gating: dict | None) -> list[str]:
    """What --adaptive-gating skipped, and the agreement its calibration measured."""
    if not gating:
        return []
    c = gating["calibration"] or {}
    how = (f"thresholds from {c.get('file')}" if c.get("reused") else
           f"calibrated on {c.get('lines')} lines: {c.get('agreement', 0):.1%} of greedy tokens equal exact top-k's")
    return [f"gating    {gating['pairs_skipped']} of {gating['pairs']} expert pairs skipped, {gating['experts_not_loaded']} "
            f"loads ({gating['link_bytes_not_loaded'] / 2**20:.1f} MiB) not made; {how}"]


def _prefix_line(prefix: dict | None) -> list[str]:
    """What the shared-prefix cache saved, or why it was off."""
    if not prefix:
        return []
    if not prefix["prefix_prefills"]:
        return [f"prefix    {prefix['status']}"]
    saved = prefix["prefill_s_saved_estimate"]
    parts = prefix.get("prefixes", [])
    each = ", ".join(f"{p['tokens']} tokens x {p['lines']} lines" for p in parts[:4]) + (", ..." if len(parts) > 4 else "")
    return [f"prefix    {len(parts)} shared prefixes ({each}) for {prefix['lines']} lines, prefilled "
            f"{prefix['prefix_prefills']}x: {prefix['prefill_tokens_saved']} prompt tokens not prefilled"
            + (f" (about {saved:.2f} s at this run's prefill rate)" if saved is not None else "")]


def profile_line(profile: dict | None) -> list[str]:
    """How the machine's profile was judged when measured, and what this run taught it
    (learning.learn_from_run): each phase predicted beside measured."""
    if not profile:
        return []
    judged = profile.get("judged") or "a profile not judged when measured"
    taught = profile.get("answer_lengths")
    answers = [] if not taught else [
        f"answers   this run's {taught['answers']} answers ({taught['answer_tokens']} tokens) are what the model's "
        f"next plans take (this job: {taught['job_runs']} runs)" if taught.get("learned")
        else f"answers   not learned from this run: {taught.get('why')}"]
    if not profile.get("corrected"):
        return [f"profile   {judged}; not corrected by this run: {profile.get('why')}", *answers]
    phases = "; ".join(f"{name} predicted {p['predicted_s']:.2f} s, measured {p['measured_s']:.2f} s"
                       + (f" (not learned from: {p['not_learned']})" if p.get("not_learned") else "")
                       for name, p in profile["phases"].items() if p["measured_s"] or p["predicted_s"])
    return [f"profile   {judged}; corrected by this run ({phases}): the next plan starts from it", *answers]


def answers_line(answers: dict | None) -> list[str]:
    """Where the answer lengths the plan priced came from, and their tokens against max_tokens."""
    if not answers:
        return []
    return [f"answers   planned at {answers['answer_tokens']} answer tokens ({answers['max_tokens']} at "
            f"max_tokens): {answers['source']}"]


def _prefetch_line(prefetch: dict) -> list[str]:
    """How well hot experts were predicted, first group (perhaps cold) against the others."""
    groups = [g for g in prefetch.get("per_group", []) if g["precision"] is not None]
    if not groups:
        return []
    line = f"prefetch  {prefetch['precision']:.0%} of prefetched experts were used ({prefetch['predictor']})"
    if len(groups) > 1:
        later = sum(g["precision"] for g in groups[1:]) / (len(groups) - 1)
        line += f"; first group {groups[0]['precision']:.0%} ({groups[0]['predictor']}), later groups {later:.0%}"
    return [line]
