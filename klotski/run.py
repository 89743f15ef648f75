"""`klotski generate`: job file in, one JSON line per prompt out, a summary and a report.

Output is written the moment each sequence finishes (flushed and fsynced by the writer),
so a crash or Ctrl-C loses at most the sequences in flight; rerunning resumes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from klotski.config import RunConfig
from klotski.errors import UserError


def default_output(jobs: Path) -> Path:
    return jobs.with_name(jobs.name.removesuffix(".jsonl") + ".out.jsonl")


def generate(config: RunConfig, jobs: Path, output: str | None) -> int:
    from tqdm import tqdm

    from klotski.engine import Engine
    from klotski.jobs import OutputWriter, read_jobs

    t_start = time.perf_counter()
    out_path = Path(output) if output else default_output(jobs)
    if out_path.resolve() == jobs.resolve():
        raise UserError(f"{out_path}: the output would overwrite the job file; choose another -o path")
    requests, bad_lines = read_jobs(jobs)
    engine = Engine(config)  # a bad model fails here, before an output file is created
    try:
        writer = OutputWriter(out_path, resume=config.resume)
    except OSError as e:
        raise UserError(f"{out_path}: cannot open the output file ({e.strerror}); choose another -o path") from None
    with writer:
        done = writer.done_ids
        skipped = sum(r.id in done for r in requests)
        todo = [r for r in requests if r.id not in done]
        seqs, too_long = engine.prepare(todo)
        failed = 0
        for err in list(bad_lines) + too_long:
            failed += writer.write(err.record())
        if skipped:
            print(f"klotski: resuming {out_path}: {skipped} requests already done", file=sys.stderr)
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        bar = tqdm(total=len(seqs), unit="req", desc="generate", disable=None if config.progress else True,
                   file=sys.stderr, mininterval=0.5)
        with bar:
            for seq in engine.run(seqs):
                writer.write(engine.record(seq))
                bar.update(1)
                gen_s = engine.stats.prefill_s + engine.stats.decode_s
                if gen_s > 0:
                    bar.set_postfix_str(f"{engine.stats.generated_tokens / gen_s:.1f} tok/s")
        engine.close()
        report = build_report(engine, ok=len(seqs), failed=failed, skipped=skipped,
                              wall_s=time.perf_counter() - t_start)
    print(summary(report, out_path), file=sys.stderr)
    if config.trace:
        Path(config.trace).write_text(json.dumps(engine.trace.to_chrome()))
    if config.report:
        Path(config.report).parent.mkdir(parents=True, exist_ok=True)
        Path(config.report).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


def build_report(engine, *, ok: int, failed: int, skipped: int, wall_s: float) -> dict:
    s, c = engine.stats, engine.config
    gen_s = s.prefill_s + s.decode_s
    return {
        "tokens_per_s": round(s.generated_tokens / gen_s, 3) if gen_s else 0.0,
        "predicted_tokens_per_s": round(engine.plan.predicted_tokens_per_s, 3) if engine.plan else None,
        "prefill_s": round(s.prefill_s, 4),
        "decode_s": round(s.decode_s, 4),
        "wall_s": round(wall_s, 4),
        "requests": {"ok": ok, "failed": failed, "skipped": skipped},
        "tokens": {"prompt": s.prompt_tokens, "generated": s.generated_tokens},
        "plan": {"batch_size": engine.batch_size, "num_batches": engine.num_batches,
                 "hot_experts": engine.pipeline.K if engine.pipeline else None, "schedule": c.schedule,
                 "placement": engine.placement.summary() if engine.placement else None,
                 "binding": engine.plan.binding if engine.plan else None},
        "memory": {"peak_device_bytes": engine.memory.peak, "budget_device_bytes": engine.memory.budget,
                   "budget_host_bytes": engine.budgets.host},
        "io": {"bytes": dict(engine.trace.bytes),
               "busy_s": {k: round(v, 4) for k, v in engine.trace.busy.items()},
               "experts_loaded": engine.pipeline.experts_loaded if engine.pipeline else 0,
               # Disk bytes per second of decode wall time: how busy decode kept the disk.
               "decode_disk_bytes": s.decode_disk_bytes,
               "decode_disk_gb_per_s": round(s.decode_disk_bytes / s.decode_s / 1e9, 4) if s.decode_s else None},
        "bubble": {"seconds": round(engine.trace.bubble_s, 4), "share": round(engine.trace.bubble_share(), 4)},
        "prefetch": engine.predictor.report() if engine.pipeline else {},
        "model": str(engine.model_dir),
        "config": c.to_json(),
    }


def summary(report: dict, out_path: Path) -> str:
    r, t = report["requests"], report["tokens"]
    lines = [
        f"requests  {r['ok']} ok, {r['failed']} failed" + (f", {r['skipped']} already done" if r["skipped"] else ""),
        f"tokens    {t['prompt']} prompt, {t['generated']} generated",
        f"speed     {report['tokens_per_s']:.1f} tok/s (prefill {report['prefill_s']:.2f} s, "
        f"decode {report['decode_s']:.2f} s)"
        + (f"; planner predicted {report['predicted_tokens_per_s']:.1f}" if report["predicted_tokens_per_s"] else ""),
        f"bubble    {report['bubble']['share']:.1%} of compute time waiting on transfers; "
        f"peak device {report['memory']['peak_device_bytes'] / 2**20:.1f} MiB",
        f"wall      {report['wall_s']:.1f} s",
        f"output    {out_path}",
    ]
    return "\n".join(lines)
