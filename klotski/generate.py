"""`klotski generate`: job file in, one JSON line per prompt out, a summary and a report.

The order is what makes refusals cheap and runs resumable: the checkpoint is opened (nothing
loaded), the output's finished ids read (hashed), the job file's first window read and
tokenized, the run planned from that window's prompts — a budget that cannot work is refused
here, before any weight is read or the output file is created — and only then the tiers are
filled and generation starts. The job file streams: windows of `--window` lines are read,
validated and tokenized one after another, each batched longest prompt first (the engine's
groups), so memory holds one window whatever the file's length and the first record comes
after the first window, not the whole file.
Output is written the moment each sequence finishes (flushed and fsynced by the writer), so
a crash, a kill or Ctrl-C loses at most the sequences in flight; rerunning resumes."""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from klotski.config import RunConfig
from klotski.errors import RunStopped, UserError
from klotski.util.writes import replace_atomically, writing


def default_output(jobs: Path) -> Path:
    return jobs.with_name(jobs.name.removesuffix(".jsonl") + ".out.jsonl")


def generate(config: RunConfig, jobs: Path, output: str | None) -> int:
    """Run the job; a run that stops (refused, a user mistake, a failure midway) still leaves a
    report saying so at --report, never an earlier run's numbers for a script to read."""
    try:
        return _generate(config, jobs, output)
    except (UserError, RunStopped) as e:
        if config.report:
            try:
                replace_atomically(Path(config.report), (json.dumps(
                    {"error": str(e), "model": config.model, "config": config.to_json()}, indent=2) + "\n").encode())
            except OSError:
                pass  # the one-line error below is what the user needs
        raise


def _generate(config: RunConfig, jobs: Path, output: str | None) -> int:
    from tqdm import tqdm

    from klotski.assemble import build_engine, setup_run
    from klotski.io.checkpoint import Checkpoint
    from klotski.io.jobs import JobFileError, model_error
    from klotski.io import progress
    from klotski.io.dataset_files import is_dataset
    from klotski.io.parquet_output import ParquetOutput, is_parquet
    from klotski.io.output import OutputWriter, error_record, read_output, result_record

    t_start = time.perf_counter()
    out_path = Path(output) if output else default_output(jobs)
    if out_path.resolve() == jobs.resolve():
        raise UserError(f"{out_path}: the output would overwrite the job file; choose another -o path")
    if config.ray:  # the driver of actors, each an engine like the one below (klotski/ray.py)
        from klotski import ray as on_ray
        return on_ray.generate(config, jobs, out_path)
    ckpt = Checkpoint.open(config.model, direct_io=config.direct_io)  # a bad model fails here
    # A valid progress sidecar: seek past the finished lines, read only the output's tail.
    dataset, parquet = is_dataset(jobs), is_parquet(out_path)
    # (a dataset input or a Parquet output resumes by the full pass over what was written)
    resume = progress.load(out_path, jobs) if config.resume and not dataset and not parquet else None
    if parquet:
        earlier = None  # the Parquet writer reads its finished ids itself, on opening
    else:
        earlier = resume.scan if resume else read_output(out_path) if config.resume else None
    done = earlier.ok if earlier else None
    if parquet and config.resume:
        done = ParquetOutput.finished(out_path)
    stream = job_windows(jobs, config, ckpt, done, start=resume.start if resume else None)
    ahead = _read_ahead(stream)  # a missing or unreadable job file fails here
    first = ahead[-1].seqs if ahead and ahead[-1].seqs else None
    setup = setup_run(config, ckpt, first) if first else None  # a refusal happens here
    first = None
    if setup and setup.plan and setup.prefill_chunk is None:
        # Planned from the first window: a longer prompt later is prefilled in chunks of what was planned.
        setup = dataclasses.replace(setup, prefill_chunk=setup.plan.prefill_chunk)
    progress.invalidate(out_path)  # before the writer repairs or rewrites the output
    try:
        writer = (ParquetOutput(out_path, resume=config.resume) if parquet
                  else OutputWriter(out_path, resume=config.resume, known=earlier))
    except OSError as e:
        raise UserError(f"{out_path}: cannot open the output file ({e.strerror}); choose another -o path") from None
    tracker = None
    if not dataset and not parquet:
        try:
            tracker = progress.Tracker(out_path, jobs, writer, resume)
        except OSError:
            pass  # no sidecar (a read-only directory...): a rerun takes the full pass
    stream = _Background(stream)  # the next window is read and tokenized while this one runs
    if resume:
        print(f"klotski: resuming {out_path}: lines 1-{resume.start.line} are done "
              f"(per {progress.sidecar(out_path).name})", file=sys.stderr)
    model_name = config.model
    lines = _LineCount(jobs, config)

    def emit(record, error=None, row=None) -> bool:
        then = (f"{len(writer)} whole records are in it; make room and rerun the same command to resume "
                "(or move the file to a bigger disk first and pass its new path with -o)")
        if row is not None and getattr(writer, "keeps_input", False):
            record = {**record, "input": row}
        with writing(out_path, "the output", then=then):
            wrote = writer.write(record)
        if wrote and error is not None and tracker:
            tracker.error(error.line, error.id, writer.last_span)
        return wrote

    with writer:
        failed = errored = ok = 0
        prompt_lens, gen_lens = array("I"), array("I")  # of the answers this run generated, for the replay
        # lines under a sidecar's watermark are done (but for the error lines run again)
        skipped = resume.start.line - len(resume.start.replay) if resume else 0
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        # initial: the lines under a sidecar's watermark count as done, so the ETA is the rest's
        bar = tqdm(total=None, unit="line", desc="generate", disable=None if config.progress else True,
                   file=sys.stderr, mininterval=0.5, initial=skipped)
        engine = None
        try:
            engine = build_engine(config, ckpt, setup) if setup else None
            with bar:
                for window in _drain(ahead, stream):
                    if lines.total is not None and bar.total is None:
                        bar.total = lines.total
                        bar.refresh()
                    if window.skipped and not skipped and not resume:
                        # (through the bar: a plain print would leave a torn bar line behind)
                        bar.write(f"klotski: resuming {out_path}: skipping lines already done", file=sys.stderr)
                    skipped += window.skipped
                    # a record already in the file (from before the rerun's window reached it) is not an error
                    seqs = [s for s in window.seqs if s.request.id not in writer]
                    skipped += len(window.seqs) - len(seqs)
                    failed += sum(emit(error_record(err, fmt=config.output_format), err, err.row)
                                  for err in window.errors)
                    bar.update(window.skipped + len(window.errors) + len(window.seqs) - len(seqs))
                    for seq in engine.run(seqs) if seqs else ():
                        if seq.error:
                            err = model_error(seq)
                            errored += emit(error_record(err, fmt=config.output_format), err, err.row)
                        else:
                            prompt_lens.append(len(seq.prompt_ids))
                            gen_lens.append(len(seq.out))
                            ok += emit(result_record(seq, fmt="klotski" if parquet else config.output_format,
                                                     model=model_name, include_token_ids=config.include_token_ids),
                                       row=seq.request.row)
                        bar.update(1)
                        gen_s = engine.stats.prefill_s + engine.stats.decode_s
                        if gen_s > 0:
                            bar.set_postfix_str(f"{engine.stats.generated_tokens / gen_s:.1f} tok/s")
                    if tracker and window.mark:
                        tracker.window_done(window.mark)
        except (KeyboardInterrupt, UserError, RunStopped):
            raise
        except JobFileError as e:  # the job file became unreadable midway
            raise RunStopped(f"the run stopped: {e}; {len(writer)} records are in {out_path}; "
                             "rerun the same command to resume") from None
        except Exception as e:  # the run stopped: say so in one line; what is written stays
            raise RunStopped(_stopped(e, out_path, len(writer))) from None
        finally:
            stream.close()
            if engine:
                engine.close()
            if tracker:
                with writing(progress.sidecar(out_path), "the progress sidecar",
                             then="every record is in the output; a rerun reads it all again"):
                    tracker.close()
        if skipped:
            print(f"klotski: resumed {out_path}: {skipped} requests were already done", file=sys.stderr)
        report = build_report(engine, setup, ok=ok, failed=failed + errored, skipped=skipped,
                              wall_s=time.perf_counter() - t_start, config=config, model_dir=ckpt.directory)
        report.update(_replayed(config, ckpt, setup, prompt_lens, gen_lens))
        report["resume"] = {"sidecar": resume is not None,
                            "skipped_by_watermark": resume.start.line if resume else 0,
                            "replayed_errors": len(resume.start.replay) if resume else 0}
    print(summary(report, out_path), file=sys.stderr)
    done = f"every record is in {out_path}; only this file is missing"
    if config.trace and engine:
        with writing(config.trace, "the trace", then=done):
            replace_atomically(Path(config.trace), json.dumps(engine.trace.to_chrome()).encode())
    if config.report:
        with writing(config.report, "the run report", then=done):
            replace_atomically(Path(config.report), (json.dumps(report, indent=2) + "\n").encode())
    return 1 if failed or errored else 0


@dataclass
class Window:
    """One window of the job file, ready to run: its sequences (tokenized, not yet done),
    its lines that cannot be served, how many of its lines an earlier run finished, and
    where the reader stood after its last line (for the progress sidecar)."""
    seqs: list
    errors: list
    skipped: int
    mark: object = None  # klotski.io.jobs.Mark


def job_windows(jobs: Path, config, ckpt, done, start=None) -> Iterator[Window]:
    """The job file as a stream of windows of `config.window` lines, each read, validated and
    tokenized only when the one before it has been handed over: memory holds a window (and
    the hashed ids seen so far), never the file. Lines whose id is in `done` are skipped
    without tokenizing them; `start` (klotski.io.jobs.Start) skips the lines a sidecar vouches
    for without reading them."""
    import copy

    from klotski.io.dataset_files import is_dataset, job_rows
    from klotski.io.jobs import Cursor, LineError, stream_jobs, windows
    from klotski.runtime.sequences import prepare
    cursor = Cursor()
    tokenizer = ckpt.tokenizer
    if is_dataset(jobs):  # the same checks, ids and windows, over a dataset's rows
        items = job_rows(jobs, (config.prompt_field, config.messages_field, config.id_field), done, cursor)
    else:
        items = stream_jobs(jobs, done, start=start, cursor=cursor)
    for items in windows(items, config.window):
        mark = cursor.take()
        errors = [x for x in items if isinstance(x, LineError)]
        todo = [x for x in items if x is not None and not isinstance(x, LineError)]
        seqs, too_long = prepare(todo, tokenizer, ckpt.spec, config)
        yield Window(seqs, errors + too_long, len(items) - len(errors) - len(todo), mark)
        if seqs and tokenizer is ckpt.tokenizer:
            # Later windows are tokenized in the read-ahead thread while the engine decodes
            # with the original: a copy of its own, so the two never share a Rust tokenizer.
            tokenizer = copy.deepcopy(tokenizer)


def _read_ahead(stream: Iterator[Window]) -> deque[Window]:
    """Windows up to the first with something to generate (the planner sizes the run from its
    prompts): those before it have only errors and finished lines."""
    ahead = deque()
    for window in stream:
        ahead.append(window)
        if window.seqs:
            break
    return ahead


def _drain(ahead: deque[Window], stream) -> Iterator[Window]:
    """The windows read ahead, then the rest; each is let go of once handed over."""
    while ahead:
        yield ahead.popleft()
    yield from stream


class _Background:
    """Iterates `stream` in a thread, at most one item ahead of the caller: the next window
    is read and tokenized while the current one runs, and memory holds two windows at most.
    Order is the stream's; an exception in the thread is raised in the caller."""

    _END = object()

    def __init__(self, stream: Iterator):
        import queue
        self._stream = stream
        self._box = queue.Queue()  # never holds more than one: the semaphore paces the thread
        self._go = threading.Semaphore(1)  # released when the caller takes an item
        self._stop = False
        threading.Thread(target=self._run, daemon=True, name="klotski-read-ahead").start()

    def _run(self) -> None:
        try:
            while True:
                self._go.acquire()
                if self._stop:
                    self._stream.close()
                    return
                try:
                    item = next(self._stream)
                except StopIteration:
                    self._box.put((self._END, None))
                    return
                self._box.put((item, None))
        except BaseException as e:  # handed to the caller, which says it in one line
            self._box.put((self._END, e))

    def __iter__(self):
        while True:
            item, error = self._box.get()
            if error is not None:
                raise error
            if item is self._END:
                return
            self._go.release()
            yield item

    def close(self) -> None:
        """Stop reading ahead (the run ended early); the thread finishes its window and exits."""
        self._stop = True
        self._go.release()


class _LineCount:
    """The job file's line count, for the progress bar's total and ETA, counted in a thread
    (newline bytes only) so the first window never waits for it."""

    def __init__(self, path: Path, config=None):
        self.total = None
        threading.Thread(target=self._count, args=(path,), daemon=True, name="klotski-count-lines").start()

    def _count(self, path: Path) -> None:
        from klotski.io.dataset_files import count_rows, is_dataset
        from klotski.io.jobs import count_lines
        try:
            self.total = count_rows(path) if is_dataset(path) else count_lines(path)
        except Exception:
            pass  # the bar counts without a total


def _stopped(e: Exception, out_path: Path, written: int) -> str:
    """One line for a run that stopped midway; the traceback goes to a file it names."""
    from placement.tiers import OverBudget
    keep = f"{written} records are in {out_path}; rerun the same command to resume"
    if isinstance(e, OverBudget):
        return f"the run stopped: {e}; {keep}"
    try:
        with tempfile.NamedTemporaryFile("w", prefix="klotski-crash-", suffix=".txt", delete=False) as f:
            traceback.print_exception(e, file=f)
        details = f"details in {f.name}"
    except OSError as why:  # the temp directory may be on the disk that is full
        details = f"the details could not be saved ({why.strerror})"
    return f"internal error ({type(e).__name__}: {e}); {keep}; {details}"


REPLAY_SAMPLE = 65536  # answers the replay prices at most (it walks every batch and slot)


def _replayed(config, ckpt, setup, prompt_lens, gen_lens) -> dict:
    """The plan over the lengths the answers had (planning.replayed_plan): its tokens/s, and
    its prefill and decode seconds for the whole job, to set beside the measured ones."""
    from klotski.assemble import pipeline_cost
    from klotski.planning import replayed_plan
    none = {"replayed_tokens_per_s": None}
    if not setup or not gen_lens:
        return none
    scale = 1.0
    if len(gen_lens) > REPLAY_SAMPLE:  # a rate: an even sample of a long job's answers tells it
        step = len(gen_lens) / REPLAY_SAMPLE
        pick = [int(i * step) for i in range(REPLAY_SAMPLE)]
        prompt_lens, gen_lens = [prompt_lens[i] for i in pick], [gen_lens[i] for i in pick]
        scale = step
    try:
        plan = replayed_plan(config, ckpt, setup, prompt_lens, gen_lens, pipeline_cost)
    except (UserError, ValueError):  # the plan's budgets were refused for these lengths: no replay, not no report
        return none
    if not plan or not plan.predicted_tokens_per_s:
        return none
    return {"replayed_tokens_per_s": round(plan.predicted_tokens_per_s, 3),
            "replayed_prefill_s": round(plan.job_prefill_s * scale, 4),
            "replayed_decode_s": round(plan.job_decode_s * scale, 4)}


def build_report(engine, setup, *, ok: int, failed: int, skipped: int, wall_s: float, config,
                 model_dir) -> dict:
    report = {"tokens_per_s": 0.0, "predicted_tokens_per_s": None, "prefill_s": 0.0, "decode_s": 0.0,
              "wall_s": round(wall_s, 4), "requests": {"ok": ok, "failed": failed, "skipped": skipped},
              "tokens": {"prompt": 0, "generated": 0}, "model": str(model_dir),
              "order": (f"the job file streams in windows of {config.window} lines; in each window prompts are "
                        "sorted longest first and batched in that order (similar lengths share a batch and pad "
                        "little); records are keyed by id and written as they finish"),
              "config": config.to_json()}
    if engine is None:
        return report
    s, plan = engine.stats, setup.plan
    gen_s = s.prefill_s + s.decode_s
    report.update({
        "tokens_per_s": round(s.generated_tokens / gen_s, 3) if gen_s else 0.0,
        "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 3) if plan else None,
        "prefill_s": round(s.prefill_s, 4),
        "decode_s": round(s.decode_s, 4),
        "tokens": {"prompt": s.prompt_tokens, "generated": s.generated_tokens},
        "plan": {"batch_size": setup.batch_size, "num_batches": setup.num_batches,
                 "prefill_chunk": setup.prefill_chunk, "prefill_passes": s.prefill_passes,
                 "hot_experts": engine.pipeline.K, "schedule": config.schedule,
                 "placement": setup.placement.summary(),
                 "buffers": plan.buffers if plan else None, "binding": plan.binding if plan else None},
        "memory": {"peak_device_bytes": engine.memory.peak, "budget_device_bytes": engine.memory.budget,
                   "peak_host_bytes": engine.host_memory.peak, "budget_host_bytes": engine.host_memory.budget,
                   **_allocator(engine)},
        "io": {"bytes": dict(engine.trace.bytes),
               "busy_s": {k: round(v, 4) for k, v in engine.trace.busy.items()},
               "experts_loaded": engine.pipeline.experts_loaded,
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
        "bubble": {"seconds": round(engine.trace.bubble_s, 4), "share": round(engine.trace.bubble_share(), 4),
                   "decode_share": round(engine.trace.bubble_share(decode_only=True), 4)},
        "prefetch": engine.predictor.report(),
        "host_compute": engine.pipeline.host.report(),
    })
    return report


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


def summary(report: dict, out_path: Path) -> str:
    r, t = report["requests"], report["tokens"]
    lines = [
        f"requests  {r['ok']} ok, {r['failed']} failed" + (f", {r['skipped']} already done" if r["skipped"] else ""),
        f"tokens    {t['prompt']} prompt, {t['generated']} generated",
    ]
    if "memory" in report:
        mem, plan = report["memory"], report["plan"]
        lines += [
            f"speed     {report['tokens_per_s']:.1f} tok/s (prefill {report['prefill_s']:.2f} s, "
            f"decode {report['decode_s']:.2f} s)"
            + (f"; planner predicted {report['predicted_tokens_per_s']:.1f}" if report["predicted_tokens_per_s"] else "")
            + (f" ({report['replayed_tokens_per_s']:.1f} for the answers' actual lengths: prefill "
               f"{report['replayed_prefill_s']:.2f} s, decode {report['replayed_decode_s']:.2f} s)"
               if report.get("replayed_tokens_per_s") else ""),
            f"plan      batch size {plan['batch_size']} x {plan['num_batches']} batches"
            + (f", prefill in chunks of {plan['prefill_chunk']} tokens" if plan["prefill_chunk"] else ""),
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
            *_host_line(report.get("host_compute")),
            f"memory    peak device {mem['peak_device_bytes'] / 2**20:.1f} of {mem['budget_device_bytes'] / 2**20:.1f} MiB, "
            f"host {mem['peak_host_bytes'] / 2**20:.1f} of {mem['budget_host_bytes'] / 2**20:.1f} MiB",
        ]
    lines += [f"wall      {report['wall_s']:.1f} s", f"output    {out_path}"]
    return "\n".join(lines)


def _host_line(host: dict | None) -> list[str]:
    """What host compute did (attention beside a host KV cache, experts where they live)."""
    if not host or host["attention"]["mode"] == host["experts"]["mode"] == "off":
        return []
    a, e = host["attention"], host["experts"]
    return [f"host      attention on the host in {a['batches_layers_on_host']} batch-layers "
            f"({a['kv_bytes_not_moved'] / 2**20:.1f} MiB of KV not moved, {a['host_s']:.2f} s; {a['mode']}), "
            f"{e['experts_on_host']} experts on the host ({e['bytes_not_moved'] / 2**20:.1f} MiB not moved, "
            f"{e['host_s']:.2f} s; {e['mode']})"]


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
