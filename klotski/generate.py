"""`klotski generate`: job file in, one JSON line per prompt out, a summary and a report.

The order is what makes refusals cheap and runs resumable: the checkpoint is opened (nothing
loaded), the output's finished ids read (hashed), the job file's first window read and
tokenized, the run planned from that window's prompts — a budget that cannot work is refused
here, before any weight is read or the output file is created — and only then the tiers are
filled and generation starts. The job file streams: windows of `--window` lines are read,
validated and tokenized one after another (klotski/schedule/windows.py), each batched longest
prompt first (the engine's groups), so memory holds one window whatever the file's length and
the first record comes after the first window, not the whole file.
Output is written the moment each sequence finishes (flushed and fsynced by the writer), so
a crash, a kill or Ctrl-C loses at most the sequences in flight; rerunning resumes."""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from array import array
from pathlib import Path

from tqdm import tqdm

from klotski.assemble import build_engine, pipeline_cost, setup_run
from klotski.config import RunConfig
from klotski.errors import JobFileError, RunStopped, UserError
from klotski.io import progress
from klotski.io.checkpoint import Checkpoint
from klotski.io.dataset_files import is_dataset
from klotski.io.output import OutputWriter, read_output
from klotski.io.parquet_output import ParquetOutput, is_parquet
from klotski.io.records import error_record
from klotski import planning
from klotski.learning import Answers, learn_from_run
from klotski.planning import replayed_plan, routing_in_slot_order
from klotski.schedule import sequences as S
from klotski.schedule.report import build_report, replayed, save_report, summary
from klotski.util.signals import signals_held
from klotski.schedule.windows import Background, LineCount, drain, job_windows, read_ahead
from klotski.util.writes import WriteFailed, replace_atomically, writing


def default_output(jobs: Path) -> Path:
    return jobs.with_name(jobs.name.removesuffix(".jsonl") + ".out.jsonl")


def generate(config: RunConfig, jobs: Path, output: str | None) -> int:
    """Run the job; a run that stops (refused, a user mistake, a failure midway) still leaves a
    report saying so at --report, never an earlier run's numbers for a script to read."""
    try:
        t_start = time.perf_counter()
        out_path = Path(output) if output else default_output(jobs)
        if out_path.resolve() == jobs.resolve():
            raise UserError(f"{out_path}: the output would overwrite the job file; choose another -o path")
        if config.ray:  # the driver of actors, each an engine like the one below (klotski/ray.py)
            from klotski import ray as on_ray
            return on_ray.generate(config, jobs, out_path)
        return Job(config, jobs, out_path, t_start).run()
    except (UserError, RunStopped) as e:
        if config.report:
            try:
                save_report(config.report, {"error": str(e), "model": config.model, "config": config.to_json()})
            except OSError:
                pass  # the one-line error below is what the user needs
        raise


class Job:
    """One run in this process; `run` is its steps in the order the module's docstring gives,
    each leaving on the job what the next one needs."""

    crash_dir: Path | None = None  # where a crash's traceback goes (None: the system's temp directory)
    check = None  # called before every engine step; what it raises stops the run (klotski serve: a cancel)

    def __init__(self, config: RunConfig, jobs: Path, out_path: Path, t_start: float):
        self.config, self.jobs, self.out_path, self.t_start = config, jobs, out_path, t_start
        self.engine = self.tracker = None
        self.ok = self.failed = self.skipped = 0
        self.prompt_lens, self.gen_lens = array("I"), array("I")  # of the answers this run generated, for the replay
        self.longest = 1  # the longest prompt, shared prefixes included
        # the answers, for the lengths the model's next plans take (learning.Answers): the planned
        # window's sequences by (line, sample), each one's answer length; every answer and its cap
        self.planned, self.answers = {}, Answers(None, [], array("I"), array("I"))

    def run(self) -> int:
        self.ckpt = self.open_checkpoint()  # a bad model fails here
        self.read_resume_state()
        self.stream = job_windows(self.jobs, self.config, self.ckpt, self.done,
                                  start=self.resume.start if self.resume else None)
        self.ahead = read_ahead(self.stream)  # a missing or unreadable job file fails here
        self.plan()
        self.open_output()
        with self.writer:
            try:
                self.run_windows()
            except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the report covers what ran (a rerun resumes)
                self.save_stopped("interrupted")
                raise
            report = self.report()
            if self.engine is not None and self.setup is not None:
                report["profile"] = self.learn()
        self.save(report)
        return 1 if self.failed else 0

    def save_stopped(self, why: str) -> None:
        """The report of the part that ran, marked `stopped`, where one was asked for; one line
        on stderr where it cannot be written, never in the way of the line that says the run stopped."""
        if self.config.report and self.engine is not None:
            try:
                save_report(self.config.report, {**self.report(), "stopped": why})
            except Exception as e:  # one line, and the stop itself stays the news
                print(f"klotski: --report {self.config.report}: the part that ran was not reported "
                      f"({type(e).__name__}: {e})", file=sys.stderr)

    def open_checkpoint(self) -> Checkpoint:
        """The checkpoint the job runs (`klotski serve` hands in its engine's)."""
        return Checkpoint.open(self.config.model, direct_io=self.config.direct_io)

    def read_resume_state(self) -> None:
        """The ids an earlier run finished. A valid progress sidecar: seek past the finished
        lines, read only the output's tail; a dataset input or a Parquet output resumes by the
        full pass over what was written."""
        c, out = self.config, self.out_path
        self.dataset, self.parquet = is_dataset(self.jobs), is_parquet(out)
        self.resume = progress.load(out, self.jobs) if c.resume and not self.dataset and not self.parquet else None
        if self.parquet:
            self.earlier = None  # the Parquet writer reads its finished ids itself, on opening
            self.done = ParquetOutput.finished(out) if c.resume else None
        else:
            self.earlier = self.resume.scan if self.resume else read_output(out) if c.resume else None
            self.done = self.earlier.ok if self.earlier else None

    def plan(self) -> None:
        """Plan from the first window with prompts; a refusal happens here."""
        first = self.ahead[-1].seqs if self.ahead and self.ahead[-1].seqs else None
        self.setup = setup_run(self.config, self.ckpt, first).for_later_prompts() if first else None
        if first:  # the sequences the plan priced, as planning.plan_job keyed them
            self.planned = {(s.request.line, s.sample): i for i, s in enumerate(first)}
            self.answers = Answers(planning.answer_key(first), [None] * len(first), array("I"), array("I"))

    def open_output(self) -> None:
        """The output's writer and, for a JSON-lines job and output, the progress sidecar."""
        out = self.out_path
        progress.invalidate(out)  # before the writer repairs or rewrites the output
        try:
            self.writer = (ParquetOutput(out, resume=self.config.resume) if self.parquet
                           else OutputWriter(out, resume=self.config.resume, known=self.earlier))
        except OSError as e:
            raise UserError(f"{out}: cannot open the output file ({e.strerror}); choose another -o path") from None
        if not self.dataset and not self.parquet:
            try:
                self.tracker = progress.Tracker(out, self.jobs, self.writer, self.resume)
            except OSError:
                pass  # no sidecar (a read-only directory...): a rerun takes the full pass

    def run_windows(self) -> None:
        """Build the engine and run every window; a run that stops midway says so in one line
        and keeps what is written."""
        stream = Background(self.stream)  # the next window is read and tokenized while this one runs
        resume, out = self.resume, self.out_path
        if resume:
            print(f"klotski: resuming {out}: lines 1-{resume.start.line} are done "
                  f"(per {progress.sidecar(out).name})", file=sys.stderr)
        lines = LineCount(self.jobs)
        # lines under a sidecar's watermark are done (but for the error lines run again)
        self.skipped = resume.start.line - len(resume.start.replay) if resume else 0
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI)
        # initial: the lines under a sidecar's watermark count as done, so the ETA is the rest's
        bar = tqdm(total=None, unit="line", desc="generate", disable=None if self.config.progress else True,
                   file=sys.stderr, mininterval=0.5, initial=self.skipped)
        try:
            self.engine = self.make_engine() if self.setup else None
            if self.engine is not None and self.config.adaptive_gating is not None:
                self.calibrate_gating()
            with bar:
                for window in drain(self.ahead, stream):
                    if lines.total is not None and bar.total is None:
                        bar.total = lines.total
                        bar.refresh()
                    self.run_window(window, bar)
        except (KeyboardInterrupt, UserError, RunStopped):
            raise
        except JobFileError as e:  # the job file became unreadable midway
            raise RunStopped(f"the run stopped: {e}; {len(self.writer)} records are in {out}; "
                             "rerun the same command to resume") from None
        except Exception as e:  # the run stopped: say so in one line; what is written stays
            raise RunStopped(_stopped(e, out, len(self.writer), self.crash_dir)) from None
        finally:
            stream.close()
            if self.engine:
                self.close_engine()
            if self.tracker:
                with writing(progress.sidecar(out), "the progress sidecar",
                             then="every record is in the output; a rerun reads it all again"):
                    self.tracker.close()
        if self.skipped:
            print(f"klotski: resumed {out}: {self.skipped} requests were already done", file=sys.stderr)

    def calibrate_gating(self) -> None:
        """--adaptive-gating: the thresholds an earlier run of this output saved, else calibrated on
        the first group, at least CALIBRATION_LINES lines of the first window (a group of a few
        lines has too few tokens to tell agreements apart), before any line is generated
        (klotski/schedule/gating.py)."""
        from klotski.schedule import gating
        first = self.ahead[-1].seqs if self.ahead and self.ahead[-1].seqs else []
        group = max(self.setup.batch_size * self.setup.num_batches, gating.CALIBRATION_LINES)
        gating.prepare(self.engine, first[:group], self.config.adaptive_gating, self.out_path, self.gating_key(),
                       reuse=self.config.resume)

    def gating_key(self) -> str:
        """What saved thresholds must have been calibrated for to be reused: the model, the compute
        dtype, the quantization and the job (its file's size and head, as the progress sidecar
        checks it; a dataset by name)."""
        try:
            job = progress.job_identity(self.jobs)
            job = f"{job['size']}:{job['head']}"
        except OSError:
            job = str(self.jobs)
        return f"{self.ckpt.key}:{self.setup.dtype}:{self.config.quantize}:{job}"

    def make_engine(self):
        """The engine the windows run on (`klotski serve` hands in its one long-lived engine)."""
        return build_engine(self.config, self.ckpt, self.setup)

    def close_engine(self) -> None:
        self.engine.close()

    def run_window(self, window, bar) -> None:
        if window.skipped and not self.skipped and not self.resume:
            # (through the bar: a plain print would leave a torn bar line behind)
            bar.write(f"klotski: resuming {self.out_path}: skipping lines already done", file=sys.stderr)
        self.skipped += window.skipped
        # a record already in the file (from before the rerun's window reached it) is not an error
        seqs = [s for s in window.seqs if s.request.id not in self.writer]
        dropped = sum(s.sample == 0 for s in window.seqs) - sum(s.sample == 0 for s in seqs)  # lines, not samples
        self.skipped += dropped
        self.failed += sum(self.emit(error_record(err, fmt=self.config.output_format), err, err.row)
                           for err in window.errors)
        bar.update(window.skipped + len(window.errors) + dropped)
        results = self.engine.run(seqs, check=self.check) if seqs else iter(())
        try:
            for seq in results:
                bar.update(self.emit_sequence(seq))
                gen_s = self.engine.stats.prefill_s + self.engine.stats.decode_s
                if gen_s > 0:
                    bar.set_postfix_str(f"{self.engine.stats.generated_tokens / gen_s:.1f} tok/s")
        finally:  # a run cut short (a failed write) gives its KV caches back now, not whenever it is
            if hasattr(results, "close"):  # collected: `klotski serve` runs its next batch on the same engine
                results.close()
        if self.tracker and window.mark:
            self.tracker.window_done(window.mark)

    def emit_sequence(self, seq) -> int:
        """Write the record of `seq`'s line once all its samples are done: 1 line answered, else 0."""
        c = self.config
        done = S.line_record(seq, fmt="klotski" if self.parquet else c.output_format, model=c.model,
                             include_token_ids=c.include_token_ids)
        if done is None:
            return 0  # its line's other samples are still running: the line is written whole or not at all
        record, err = done
        if err is not None:
            with signals_held():
                self.failed += self.emit(error_record(err, fmt=c.output_format), err, err.row)
            return 1
        for s in S.gather(seq):  # the answers the plan priced
            at = self.planned.get((s.request.line, s.sample))
            if at is not None:
                self.answers.planned[at] = len(s.out)
            self.answers.lengths.append(len(s.out))
            self.answers.caps.append(s.max_new_tokens)
        for s in [*S.gather(seq), *(seq.scorers or ())]:  # each a sequence the engine ran, for the replay
            self.prompt_lens.append(len(s.prompt_ids) - s.shared)  # what it prefilled itself
            self.longest = max(self.longest, len(s.prompt_ids))
            self.gen_lens.append(len(s.out))
        with signals_held():  # a Ctrl-C or SIGTERM lands after the record is written and counted
            self.ok += self.emit(record, row=seq.request.row)
        return 1

    def emit(self, record, error=None, row=None) -> bool:
        """Write one record (the sidecar notes an error record's place); False: already there."""
        then = (f"{len(self.writer)} whole records are in it; make room and rerun the same command to resume "
                "(or move the file to a bigger disk first and pass its new path with -o)")
        if row is not None and getattr(self.writer, "keeps_input", False):
            record = {**record, "input": row}
        with writing(self.out_path, "the output", then=then):
            wrote = self.writer.write(record)
        if wrote and error is not None and self.tracker:
            self.tracker.error(error.line, error.id, self.writer.last_span)
        return wrote

    def report(self) -> dict:
        resume = self.resume
        report = build_report(self.engine, self.setup, ok=self.ok, failed=self.failed, skipped=self.skipped,
                              wall_s=time.perf_counter() - self.t_start, config=self.config,
                              model_dir=self.ckpt.directory)
        report.update(replayed(self.prompt_lens, self.gen_lens, self._replan if self.setup else None))
        report["resume"] = {"sidecar": resume is not None,
                            "skipped_by_watermark": resume.start.line if resume else 0,
                            "replayed_errors": len(resume.start.replay) if resume else 0}
        return report

    def learn(self) -> dict:
        """This run as evidence for the machine's profile (learning.learn_from_run): the report's
        `profile` section. A figure, never the run's failure: a profile that cannot be read or
        written again only means the next plan starts from the measurement."""
        from klotski.util.threads import cores, machine_busy
        s, threads = self.engine.stats, self.engine.threads
        # busy: other processes took cores at some point (the governor gave threads up) or hold them now
        busy = (threads is not None and not threads.fixed and any(n < cores() for _, n in threads.history[1:])) \
            or machine_busy() is not None
        routing = routing_in_slot_order(self.engine.pipeline.routed, self.ckpt.spec, self.setup.expert_ranking)
        try:
            return learn_from_run(self.config, self.ckpt, self.setup, self.prompt_lens, self.gen_lens,
                                  {"prefill": s.prefill_s, "decode": s.decode_s}, busy=busy,
                                  pipeline_cost=pipeline_cost, popularity=routing, segments=self.segments(),
                                  longest=self.longest, answers=self.answers)
        except (UserError, WriteFailed) as e:
            return {"corrected": False, "why": str(e)}

    def segments(self) -> list[tuple[int, int]]:
        """The shared prompt segments the run prefilled, (end, tokens) each, once a prefill."""
        if not self.engine:
            return []
        return [(start + tokens, tokens) for start, tokens, _, prefills in self.engine.stats.prefixes.values()
                for _ in range(prefills)]

    def _replan(self, prompt_lens, gen_lens):
        routing = (routing_in_slot_order(self.engine.pipeline.routed, self.ckpt.spec, self.setup.expert_ranking)
                   if self.engine else None)
        return replayed_plan(self.config, self.ckpt, self.setup, prompt_lens, gen_lens, pipeline_cost, routing,
                             segments=self.segments(), longest=self.longest)

    def save(self, report: dict) -> None:
        """The summary on stderr, then the trace and the report where asked."""
        c, out = self.config, self.out_path
        print(summary(report, out), file=sys.stderr)
        done = f"every record is in {out}; only this file is missing"
        if c.trace and self.engine:
            with writing(c.trace, "the trace", then=done):
                replace_atomically(Path(c.trace), json.dumps(self.engine.trace.to_chrome()).encode())
        if c.report:
            with writing(c.report, "the run report", then=done):
                save_report(c.report, report)


def _stopped(e: Exception, out_path: Path, written: int, crash_dir: Path | None = None) -> str:
    """One line for a run that stopped midway; the traceback goes to a file it names."""
    from placement.tiers import OverBudget
    keep = f"{written} records are in {out_path}; rerun the same command to resume"
    if isinstance(e, OverBudget):
        return f"the run stopped: {e}; {keep}"
    try:
        with tempfile.NamedTemporaryFile("w", prefix="klotski-crash-", suffix=".txt", delete=False,
                                         dir=crash_dir) as f:
            traceback.print_exception(e, file=f)
        details = f"details in {f.name}"
    except OSError as why:  # the temp directory may be on the disk that is full
        details = f"the details could not be saved ({why.strerror})"
    return f"internal error ({type(e).__name__}: {e}); {keep}; {details}"
