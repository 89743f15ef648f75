"""A batch's life: validating -> in_progress -> finalizing -> completed (or failed; cancelling
-> cancelled), each step saved before the next begins, so a restart picks it up where it was.

* validating: the input file is read once. A line that is not JSON fails the batch, as
  OpenAI's validation does (`errors.data` names each such line). A JSON line that is a bad
  request for this server (another url than the batch's endpoint, a `body.model` other than
  the served model, no `custom_id`) gets an error record in OpenAI's shape and a blank line
  in its place in `jobs.jsonl`, the file the run reads (blank lines keep the line numbers).
* in_progress: `jobs.jsonl` runs as a `klotski generate` job into `run.jsonl` (OpenAI
  records, resume on: a restart skips every custom_id already answered), on the server's one
  engine (klotski/serve/worker.py).
* finalizing: `run.jsonl` splits into the output file (answers) and the error file (error
  records, the rejected lines' first); their ids are derived from the batch's, so finalizing
  again after a crash writes the same files.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

from klotski.errors import RunStopped, UserError
from klotski.generate import Job
from klotski.serve.store import Store
from klotski.serve.worker import GATHER_S, Feed, Halt, config_for_batch, log, now

PROGRESS_EVERY_S = 1.0  # request_counts are saved at most this often while a batch runs


def validate(store: Store, batch_id: str, model: str) -> None:
    """validating -> in_progress (or failed), writing jobs.jsonl and rejected.jsonl first."""
    batch = store.batches[batch_id]
    if batch["status"] != "validating":
        return
    d, endpoint = store.batch_dir(batch_id), batch["endpoint"]
    bad, rejected, total = [], [], 0
    with open(store.content_path(batch["input_file_id"]), "rb") as f, open(d / "jobs.jsonl.tmp", "wb") as jobs:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                jobs.write(b"\n")
                continue
            total += 1
            try:
                obj = json.loads(raw.decode("utf-8"))
                if not isinstance(obj, dict):
                    raise ValueError("the line is not a JSON object")
            except (UnicodeDecodeError, ValueError) as e:
                if len(bad) < 100:  # the first hundred tell the user what to fix
                    bad.append({"code": "invalid_json_line", "line": line, "param": None,
                                "message": f"line {line} is not a JSON object ({e}); each line must be one "
                                           'request like {"custom_id": "r1", "method": "POST", "url": '
                                           f'"{endpoint}", "body": {{...}}}}'})
                jobs.write(b"\n")
                continue
            why = _refused(obj, endpoint, model)
            if why:
                code, message = why
                cid = obj.get("custom_id")
                rejected.append({"id": "batch_req_" + os.urandom(16).hex(), "custom_id": cid if isinstance(
                    cid, str) else None, "response": None, "error": {"code": code, "message": f"line {line}: {message}"}})
                jobs.write(b"\n")
            else:
                jobs.write(raw if raw.endswith(b"\n") else raw + b"\n")
        jobs.flush()
        os.fsync(jobs.fileno())
    os.replace(d / "jobs.jsonl.tmp", d / "jobs.jsonl")
    counts = {"total": total, "completed": 0, "failed": len(rejected)}
    if bad or not total:
        data = bad or [{"code": "empty_file", "line": None, "param": None,
                        "message": "the input file has no requests; give one JSON request per line"}]
        store.update(batch_id, only_if=("validating",), status="failed", failed_at=now(),
                     errors={"object": "list", "data": data}, request_counts=counts)
        log(f"{batch_id}: failed validation: {data[0]['message']}")
        return
    _write_lines(d / "rejected.jsonl", rejected)
    # (a batch cancelled meanwhile stays cancelling: the worker finishes it)
    store.update(batch_id, only_if=("validating",), status="in_progress", in_progress_at=now(), request_counts=counts)
    log(f"{batch_id}: {total} requests accepted ({len(rejected)} refused)")


def _refused(obj: dict, endpoint: str, model: str) -> tuple[str, str] | None:
    """(code, message) for a JSON line this server will not run; None if generate's own checks decide."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "invalid_request", "custom_id must be a non-empty string; give every request its own id"
    if obj.get("url") != endpoint:
        return "invalid_url", f"url is {json.dumps(obj.get('url'))} but this batch's endpoint is {endpoint}"
    body = obj.get("body")
    if isinstance(body, dict) and body.get("model") not in (None, model):
        return "model_not_found", f"body.model is {json.dumps(body.get('model'))}; this server serves {model}"
    return None


def _write_lines(path: Path, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())


class BatchJob(Job):
    """A generate Job on the server's engine and checkpoint, counting its records into the
    batch's request_counts as they are written."""

    def __init__(self, worker: "Worker", batch: dict):
        d = worker.store.batch_dir(batch["id"])
        super().__init__(config_for_batch(worker.config, str(d / "report.json")), d / "jobs.jsonl",
                         d / "run.jsonl", time.perf_counter())
        self.worker, self.batch_id = worker, batch["id"]
        self.counts = dict(batch["request_counts"])
        self.saved_at = time.monotonic()

    def open_checkpoint(self):
        return self.worker.feed.ckpt  # the checkpoint the server's engine holds

    def read_resume_state(self) -> None:
        super().read_resume_state()
        if self.earlier:
            self.counts["completed"] = len(self.earlier.ok)

    def plan(self) -> None:
        self.setup = self.worker.setup  # planned once, when the server started

    def make_engine(self):
        return self.worker.feed

    def close_engine(self) -> None:
        pass  # the server's engine outlives its batches

    def emit(self, record, error=None, row=None) -> bool:
        wrote = super().emit(record, error, row)
        if wrote:
            self.counts["failed" if record.get("error") else "completed"] += 1
            if time.monotonic() - self.saved_at > PROGRESS_EVERY_S:
                self.saved_at = time.monotonic()
                self.worker.store.update(self.batch_id, request_counts=dict(self.counts))
                c = self.counts
                log(f"{self.batch_id}: {c['completed'] + c['failed']}/{c['total']} done ({c['failed']} failed)")
        return wrote


def finalize(store: Store, batch_id: str) -> None:
    """Split run.jsonl into the output and error files; the batch is completed, or cancelled
    if a cancel came first."""
    store.update(batch_id, only_if=("in_progress",), status="finalizing", finalizing_at=now())
    batch = store.batches[batch_id]
    status = "cancelled" if batch["status"] == "cancelling" else "completed"
    d = store.batch_dir(batch_id)
    ok, errors = [], []
    for name in ("rejected.jsonl", "run.jsonl"):
        try:
            with open(d / name, "rb") as f:
                for raw in f:
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        continue  # a line a crash cut short: its request was not answered
                    (errors if rec.get("error") else ok).append(raw if raw.endswith(b"\n") else raw + b"\n")
        except FileNotFoundError:
            pass
    ids = {}
    for kind, lines in (("output", ok), ("error", errors)):
        if lines:
            fid = "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
            tmp = store.tmp_path()
            with open(tmp, "wb") as f:
                f.writelines(lines)
                f.flush()
                os.fsync(f.fileno())
            store.add_file(tmp, f"{batch_id}_{kind}.jsonl", "batch_output", file_id=fid)
            ids[kind] = fid
    counts = {"total": batch["request_counts"]["total"], "completed": len(ok), "failed": len(errors)}
    stamp = "cancelled_at" if status == "cancelled" else "completed_at"
    store.update(batch_id, status=status, output_file_id=ids.get("output"), error_file_id=ids.get("error"),
                 request_counts=counts, **{stamp: now()})
    log(f"{batch_id}: {status}: {len(ok)} answered, {len(errors)} errors")


class Worker(threading.Thread):
    """Runs accepted batches one after another, and online requests whenever they wait."""

    def __init__(self, store: Store, config, engine, setup, inbox):
        super().__init__(name="klotski-serve-worker", daemon=True)
        self.store, self.config, self.setup, self.inbox = store, config, setup, inbox
        self.feed = Feed(engine, inbox)
        self.model = config.model

    def stop(self) -> None:
        self.feed.stopping = True
        self.inbox.notify()

    def run(self) -> None:
        try:
            while not self.feed.stopping:
                if self.inbox.waiting:
                    time.sleep(GATHER_S)  # those arriving together start together
                    for _ in self.feed.run([]):
                        pass
                    continue
                batch = next((b for b in self.store.unfinished() if b["status"] != "validating"), None)
                if batch is None:
                    self.inbox.wait(0.5)
                    continue
                try:
                    self.run_batch(batch)
                except Halt:
                    raise
                except Exception as e:  # our bug, or the data dir's disk: this batch fails, the server goes on
                    log(f"{batch['id']}: failed: {type(e).__name__}: {e}")
                    try:
                        self.store.update(batch["id"], status="failed", failed_at=now(), errors={
                            "object": "list", "data": [{"code": "internal_error", "line": None, "param": None,
                                                        "message": f"{type(e).__name__}: {e}"}]})
                    except OSError:
                        self.stop()  # the data dir cannot be written: nothing more can be kept
        except Halt:
            pass
        finally:
            self.inbox.fail_all("the server is stopping")

    def run_batch(self, batch: dict) -> None:
        bid = batch["id"]
        if batch["status"] == "in_progress":
            self.feed.cancelled = lambda: self.store.batches[bid]["status"] == "cancelling"
            log(f"{bid}: running")
            try:
                BatchJob(self, batch).run()
            except Halt:
                if self.feed.stopping:
                    raise
            except (UserError, RunStopped) as e:
                self.store.update(bid, status="failed", failed_at=now(), errors={"object": "list", "data": [
                    {"code": "run_stopped", "line": None, "param": None, "message": str(e)}]})
                log(f"{bid}: failed: {e}")
                return
            finally:
                self.feed.cancelled = lambda: False
        finalize(self.store, bid)

