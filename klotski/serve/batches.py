"""A batch's life: validating -> in_progress -> finalizing -> completed (or failed; expired;
cancelling -> cancelled), each step saved before the next begins, so a restart picks it up
where it was.

* validating: the input file is read once. A line that is not JSON, or a custom_id given
  twice, fails the batch, as OpenAI's validation does (`errors.data` names each such line). A
  JSON line that is a bad
  request for this server (another url than the batch's endpoint, a `body.model` other than
  the served model, no `custom_id`) gets an error record in OpenAI's shape and a blank line
  in its place in `jobs.jsonl`, the file the run reads (blank lines keep the line numbers).
* in_progress: `jobs.jsonl` runs as a `klotski generate` job into `run.jsonl` (OpenAI
  records, resume on: a restart skips every custom_id already answered), on the server's one
  engine (klotski/serve/worker.py).
* finalizing: `run.jsonl` splits into the output file (answers) and the error file (error
  records, the rejected lines' first); their ids are derived from the batch's, so finalizing
  again after a crash writes the same files.
* A run that stops midway (a write the disk refuses, a failure of the engine) and a window
  that ends (`expires_at`) finalize too, as failed or expired: the answers made in the output
  file, every request not run in the error file (batch_failed, batch_expired), counts that
  add up to the total. A disk that refuses the output files leaves the batch finalizing until
  it takes them (the worker retries; the server says it is degraded meanwhile).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

from klotski.assemble import adopt_on_this_thread
from klotski.errors import RunStopped, UserError
from klotski.generate import Job
from klotski.schedule.stats import Stats
from klotski.serve.store import RETRY_S, Store
from klotski.serve.worker import GATHER_S, Halt, config_for_batch, log, not_served, now
from klotski.util.writes import WriteFailed, reason, replacing, writing

PROGRESS_EVERY_S = 1.0  # request_counts are saved at most this often while a batch runs


def validate(store: Store, batch_id: str, names: tuple[str, ...]) -> None:
    """validating -> in_progress (or failed), writing jobs.jsonl and rejected.jsonl first. A
    write the disk refuses fails the batch with a message saying so (its save is retried)."""
    batch = store.batches[batch_id]
    if batch["status"] != "validating":
        return
    try:
        bad, rejected, total = _copy_input(store, batch, names)
    except OSError as e:
        store.fault(e, f"batch {batch_id}'s input copy")
        _fail(store, batch_id, "storage_error", f"the server could not store this batch's input: {reason(e)}; "
                                                 "create the batch again later", only_if=("validating",))
        return
    counts = {"total": total, "completed": 0, "failed": len(rejected)}
    if bad or not total:
        data = bad[:100] or [{"code": "empty_file", "line": None, "param": None,
                        "message": "the input file has no requests; give one JSON request per line"}]
        store.update(batch_id, only_if=("validating",), status="failed", failed_at=now(),
                     errors={"object": "list", "data": data}, request_counts=counts)
        log(f"{batch_id}: failed validation: {data[0]['message']}")
        return
    # (a batch cancelled meanwhile stays cancelling: the worker finishes it)
    store.update(batch_id, only_if=("validating",), status="in_progress", in_progress_at=now(), request_counts=counts)
    log(f"{batch_id}: {total} requests accepted ({len(rejected)} refused)")


def _copy_input(store: Store, batch: dict, names: tuple[str, ...]) -> tuple[list, list, int]:
    """Read the input once: jobs.jsonl (what the run reads) and rejected.jsonl written; the
    lines that fail the batch (not JSON, a custom_id given twice), the rejected records and
    the number of requests returned."""
    d = store.batch_dir(batch["id"])
    bad, rejected, total, seen = [], [], 0, {}
    with open(store.content_path(batch["input_file_id"]), "rb") as f, replacing(d / "jobs.jsonl") as tmp, \
            open(tmp, "wb") as jobs:
        for line, raw in enumerate(f, start=1):
            runs = _screen(raw, line, batch, names, seen, bad, rejected)
            total += bool(raw.strip())
            # a line that does not run is a blank line in the run's copy: line numbers stay right
            data = raw if runs and raw.endswith(b"\n") else raw + b"\n" if runs else b"\n"
            store.faults.check(d / "jobs.jsonl.tmp", len(data))  # (the seam's name for the temporary)
            jobs.write(data)
    _write_lines(store, d / "rejected.jsonl", [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rejected])
    return bad, rejected, total


def _screen(raw: bytes, line: int, batch: dict, names: tuple[str, ...], seen: dict, bad: list, rejected: list) -> bool:
    """Whether input line `line` runs; if not, why is added to `bad` (the batch fails) or
    `rejected` (an error record); `seen` maps each custom_id to its line."""
    if not raw.strip():
        return False
    endpoint = batch["endpoint"]
    try:
        obj = json.loads(raw.decode("utf-8"))
        if not isinstance(obj, dict):
            raise ValueError("the line is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        bad.append({"code": "invalid_json_line", "line": line, "param": None, "message": (
            f"line {line} is not a JSON object ({e}); each line must be one request like "
            f'{{"custom_id": "r1", "method": "POST", "url": "{endpoint}", "body": {{...}}}}')})
        return False
    cid = obj.get("custom_id")
    if isinstance(cid, str) and cid:
        if cid in seen:  # as OpenAI: the file is refused, an answer must say which request it answers
            bad.append({"code": "duplicate_custom_id", "line": line, "param": "custom_id", "message": (
                f"line {line}: custom_id {json.dumps(cid)} is also line {seen[cid]}'s; give every request "
                "its own custom_id")})
            return False
        seen[cid] = line
    why = _refused(obj, endpoint, names)
    if why:
        code, message = why
        rejected.append({"id": _request_id(batch["id"], f"line{line}"), "custom_id": cid if isinstance(cid, str)
                         else None, "response": None, "error": {"code": code, "message": f"line {line}: {message}"}})
    return why is None


def _refused(obj: dict, endpoint: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(code, message) for a JSON line this server will not run; None if generate's own checks decide."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "invalid_request", "custom_id must be a non-empty string; give every request its own id"
    if obj.get("url") != endpoint:
        return "invalid_url", f"url is {json.dumps(obj.get('url'))} but this batch's endpoint is {endpoint}"
    body = obj.get("body")
    if isinstance(body, dict) and body.get("model") not in (None, *names):
        return "model_not_found", not_served(body.get("model"), names, "body.model")
    return None


def _request_id(batch_id: str, key: str) -> str:
    """A record's id that finalizing again (after a crash) makes the same."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{key}".encode()).hexdigest()[:32]


def _write_lines(store: Store, path: Path, lines: list[bytes]) -> None:
    """`lines` as the file `path`, fsynced; OSError (through the fault seam too) if the disk refuses."""
    try:
        with open(path, "wb") as f:
            for raw in lines:
                store.faults.check(path, len(raw))
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        raise


def _fail(store: Store, batch_id: str, code: str, message: str, only_if: tuple = ()) -> None:
    """The batch fails with one `errors.data` entry (a batch in its run is finalized: see finalize)."""
    store.update(batch_id, only_if=only_if, status="failed", failed_at=now(), errors={"object": "list", "data": [
        {"code": code, "line": None, "param": None, "message": message}]})
    log(f"{batch_id}: failed: {message}")


class BatchJob(Job):
    """A generate Job on the server's engine and checkpoint, counting its records into the
    batch's request_counts as they are written. Its report counts this batch alone (the
    engine's statistics start afresh with it) and is kept when the batch is cancelled or
    expires too; a report the disk refuses costs the batch nothing."""

    def __init__(self, worker: "Worker", batch: dict):
        d = worker.store.batch_dir(batch["id"])
        super().__init__(config_for_batch(worker.config, str(d / "report.json"), worker.names[0]), d / "jobs.jsonl",
                         d / "run.jsonl", time.perf_counter())
        self.worker, self.batch_id = worker, batch["id"]
        self.check = worker.check_batch  # before every step: a cancel, an expiry or a stop ends its part
        self.crash_dir = worker.store.crashes_dir
        self.counts = dict(batch["request_counts"])
        self.saved_at = time.monotonic()

    def run(self) -> int:
        engine = self.worker.engine
        engine.stats = Stats()  # (read by reports alone)
        engine.trace.clear_counts()
        try:
            return super().run()
        except Halt:
            if not self.worker.stopping and getattr(self, "setup", None) is not None:
                self.save(self.report())  # cancelled or expired: what ran is reported
            raise

    def open_checkpoint(self):
        return self.worker.engine.ckpt  # the checkpoint the server's engine holds

    def read_resume_state(self) -> None:
        super().read_resume_state()
        if self.earlier:
            self.counts["completed"] = len(self.earlier.ok)

    def plan(self) -> None:
        self.setup = self.worker.setup  # planned once, when the server started

    def make_engine(self):
        return self.worker.engine

    def close_engine(self) -> None:
        pass  # the server's engine outlives its batches

    def emit(self, record, error=None, row=None) -> bool:
        with writing(self.out_path, "the batch's results", then=None):  # the seam tests fill the disk with
            self.worker.store.faults.check(self.out_path, len(json.dumps(record)))
        wrote = super().emit(record, error, row)
        if wrote:
            self.counts["failed" if record.get("error") else "completed"] += 1
            if time.monotonic() - self.saved_at > PROGRESS_EVERY_S:
                self.saved_at = time.monotonic()
                self.worker.store.update(self.batch_id, request_counts=dict(self.counts))
                c = self.counts
                log(f"{self.batch_id}: {c['completed'] + c['failed']}/{c['total']} done ({c['failed']} failed)")
        return wrote

    def save(self, report: dict) -> None:
        try:
            super().save(report)
        except WriteFailed as e:
            log(f"{self.batch_id}: no report: {e}")


def finalize(store: Store, batch_id: str) -> None:
    """Split run.jsonl into the output and error files and end the batch: cancelled if a cancel
    came first, failed if its run failed (`errors` set), expired if its window passed, else
    completed. A failed or expired batch's error file also holds each request it did not run.
    OSError if the disk refuses: the batch stays finalizing and this runs again."""
    store.update(batch_id, only_if=("in_progress",), status="finalizing", finalizing_at=now())
    batch = store.batches[batch_id]
    status = ("cancelled" if batch["status"] == "cancelling" else "failed" if batch.get("errors")
              else "expired" if batch.get("expired_at") else "completed")
    d = store.batch_dir(batch_id)
    ok, errors, answered = [], [], set()
    for name in ("rejected.jsonl", "run.jsonl"):
        for raw in _lines(d / name):
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # a line a crash cut short: its request was not answered
            answered.add(rec.get("custom_id"))
            (errors if rec.get("error") else ok).append(raw if raw.endswith(b"\n") else raw + b"\n")
    if status in ("failed", "expired"):  # OpenAI's expired batch: each request not run is an error
        code = "batch_expired" if status == "expired" else "batch_failed"
        why = f"the batch {status} before this request ran" + ("" if status == "expired" else " (see its errors)")
        for raw in _lines(d / "jobs.jsonl"):
            cid = json.loads(raw)["custom_id"] if raw.strip() else None
            if cid is not None and cid not in answered:
                errors.append(json.dumps({"id": _request_id(batch_id, cid), "custom_id": cid, "response": None,
                                          "error": {"code": code, "message": why}}).encode() + b"\n")
    ids = {}
    for kind, lines in (("output", ok), ("error", errors)):
        fid = "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
        if lines and store.get_file(fid) is None:
            tmp = store.tmp_path()
            try:
                _write_lines(store, tmp, lines)
                store.add_file(tmp, f"{batch_id}_{kind}.jsonl", "batch_output", file_id=fid)
            finally:
                tmp.unlink(missing_ok=True)  # (a file refused midway gives its room back)
        ids[kind] = fid if lines else None
    counts = {"total": batch["request_counts"]["total"], "completed": len(ok), "failed": len(errors)}
    stamp = {"cancelled": "cancelled_at", "failed": "failed_at", "expired": "expired_at"}.get(status, "completed_at")
    store.update(batch_id, status=status, output_file_id=ids["output"], error_file_id=ids["error"],
                 request_counts=counts, **{stamp: batch.get(stamp) or now()})
    log(f"{batch_id}: {status}: {len(ok)} answered, {len(errors)} errors")


def _lines(path: Path):
    try:
        with open(path, "rb") as f:
            yield from f
    except FileNotFoundError:
        return


class Worker(threading.Thread):
    """Runs accepted batches one after another, and online requests whenever they wait. Nothing
    stops it but `stop`: a batch whose run fails ends failed with what it finished; an
    unexpected failure is logged (its traceback under DIR/crashes/) and the loop goes on; while
    the data dir refuses writes it runs online requests only, and takes batches again once
    `Store.recover` succeeds. An engine run that fails also ends the online requests that
    waited through it, and is counted for /health until a run succeeds."""

    def __init__(self, store: Store, config, engine, setup, inbox, names: tuple[str, ...]):
        super().__init__(name="klotski-serve-worker", daemon=True)
        self.store, self.config, self.setup, self.inbox, self.names = store, config, setup, inbox, names
        self.engine = engine
        self.stopping = False
        self.cancelled = lambda: False  # set per batch by run_batch
        self.failed_runs = 0  # engine runs failed since the last that did not (for /health)
        self.last_failure: str | None = None

    def engine_ran(self, failure: str | None) -> None:
        """An engine run ended: normally (None), or failing with `failure`."""
        self.failed_runs = self.failed_runs + 1 if failure else 0
        self.last_failure = failure or self.last_failure

    def engine_trouble(self) -> str | None:
        """What /health says of the engine: None while its last run did not fail."""
        if not self.failed_runs:
            return None
        runs = "run" if self.failed_runs == 1 else f"{self.failed_runs} runs in a row"
        return f"the engine's last {runs} failed ({self.last_failure}); tracebacks in {self.store.crashes_dir}"

    def stop(self) -> None:
        self.stopping = True
        self.inbox.notify()

    def run(self) -> None:
        try:
            try:
                adopt_on_this_thread(self.engine)  # built on the server's thread, run on this one
            except Exception as e:  # the runtime's bytes are then counted as the engine's: a report's figure
                log(f"internal error in the worker ({type(e).__name__}: {e}); {self.store.save_crash(e)}")
            while not self.stopping:
                try:
                    self.step()
                except Halt:
                    raise
                except Exception as e:  # our bug: one line (the traceback in the data dir); the worker goes on
                    log(f"internal error in the worker ({type(e).__name__}: {e}); {self.store.save_crash(e)}")
                    self.inbox.wait(1.0)
        except Halt:
            pass
        finally:
            self.inbox.close("the server is stopping")

    def step(self) -> None:
        if self.engine.has_work():
            if self.engine.idle():
                time.sleep(GATHER_S)  # those arriving together start together
            waited = self.engine.waiting.online_now()
            try:
                for _ in self.engine.run([], check=self.check):
                    pass
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                self.engine_ran(why)
                # a run that fails takes its rows with it (failed by the engine); those that
                # waited through it end too, rather than wait on an engine that may fail again
                self.inbox.fail(waited, f"the engine failed ({why}); retry")
                raise
            self.engine_ran(None)
            return
        if self.store.trouble is not None and not self.store.recover():
            self.inbox.wait(RETRY_S)  # the disk is still full: online requests only
            return
        self.expire()
        batch = next((b for b in self.store.unfinished() if b["status"] != "validating"), None)
        if batch is None:
            self.inbox.wait(0.5)
            return
        self.run_batch(batch)

    def check(self) -> None:
        """Before every engine step: the server stopping ends the run (Halt)."""
        if self.stopping:
            raise Halt()
        self.store.faults.engine_step()  # (tests: an engine failing at every step)

    def check_batch(self) -> None:
        """Before every step of a batch's run: stopping, cancelled or expired ends its part."""
        self.check()
        if self.cancelled():
            raise Halt()

    def expire(self) -> None:
        """A batch past its window (`expires_at`) ends expired, with what it finished."""
        for b in self.store.unfinished():
            if b["status"] in ("validating", "in_progress") and b.get("expires_at") and now() >= b["expires_at"] \
                    and not b.get("expired_at"):
                self.store.update(b["id"], expired_at=now())
                log(f"{b['id']}: expired (its window ended)")

    def run_batch(self, batch: dict) -> None:
        bid = batch["id"]
        if batch["status"] == "in_progress" and not batch.get("expired_at"):
            ends = batch.get("expires_at") or float("inf")
            self.cancelled = lambda: self.store.batches[bid]["status"] == "cancelling" or now() >= ends
            log(f"{bid}: running")
            try:
                BatchJob(self, batch).run()
                self.engine_ran(None)
            except Halt:
                if self.stopping:
                    raise
                if now() >= ends and self.store.batches[bid]["status"] == "in_progress":
                    self.store.update(bid, expired_at=now())
                    log(f"{bid}: expired (its window ended)")
            except (UserError, RunStopped) as e:
                self.run_failed(bid, e)
            finally:
                self.cancelled = lambda: False
        try:
            finalize(self.store, bid)
        except OSError as e:  # the batch stays finalizing, to finish once the disk takes writes
            self.store.fault(e, f"batch {bid}'s output")

    def run_failed(self, bid: str, e: Exception) -> None:
        """The batch's run stopped midway: it fails, with what it finished (see finalize)."""
        cause = e.error if isinstance(e, WriteFailed) and e.error is not None else \
            e.__context__ if isinstance(e.__context__, Exception) else e
        if isinstance(cause, OSError):  # the output, its sidecar or a report: the disk refused a write
            self.store.fault(cause, f"batch {bid}'s results")
            code, message = "storage_error", f"the server could not store this batch's results: {reason(cause)}"
        else:
            code, message = "server_error", (f"the server failed while running this batch ({type(cause).__name__}: "
                                             f"{cause}; its operator finds the details in {self.store.crashes_dir})")
            self.engine_ran(f"{type(cause).__name__}: {cause}")
        message += ("; the answers it made are in the output file, the requests it did not run in the error file "
                    "(code batch_failed): submit those again")
        self.store.update(bid, only_if=("in_progress", "cancelling"), errors={"object": "list", "data": [
            {"code": code, "line": None, "param": None, "message": message}]})
        log(f"{bid}: failed: {message}")
