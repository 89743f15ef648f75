"""Klotski on Ray: one engine per GPU (per node without GPUs) as Ray actors, the job sharded
over them by the driver, one output file written by the driver alone.

The driver owns every guarantee a single-process run gives, by being that run's reader and
writer: it streams the job file (`jobs.stream_jobs`: ids claimed in file order, finished ids
skipped), cuts its requests into shards of `--shard` lines, hands each shard to an actor and
writes what comes back with the one `OutputWriter` (resume, error records, never an id
twice). An actor opens the checkpoint, tokenizes its shards and plans on its own hardware
(its first shard's prompts, its share of the node's RAM), then keeps its engine for every
later shard. A shard's records come back whole, so a shard is either written or not: an
actor that dies (kill -9, a lost node) loses its shards in flight, which go back to the front
of the queue for a fresh actor in its slot; a driver that dies loses its shards in flight,
and the rerun resumes from what was written, as a single-process run does.

`build_processor(config)` is the Ray Data face: a callable that maps a `ray.data.Dataset` of
prompt rows to one with completions, as `ray.data.llm.build_processor` users know.

Ray is optional (`pip install 'klotski[ray]'`); importing this module does not import it.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from klotski.config import RunConfig
from klotski.errors import RunStopped, UserError
from klotski.schedule.report import closing_lines, requests_line, save_report

INSTALL = "pip install 'klotski[ray]'"
IN_FLIGHT = 2        # shards queued per actor: the next is there the moment one finishes
MAX_DEATHS = 3       # per slot: an actor that keeps dying is a fault to report, not to retry forever


def require_ray():
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray needs Ray, which is not installed; install it with: {INSTALL}") from None
    return ray


# ---------------------------------------------------------------- the actor


class Worker:
    """One Klotski engine in a Ray actor. The engine is built on the first shard with prompts:
    the planner sizes it from that shard on this actor's own hardware and budgets."""

    def __init__(self, config: dict):
        self.config = RunConfig(**config)
        self.ckpt = self.engine = None

    def info(self) -> dict:
        import ray
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def open(self, host_share: float) -> str | None:
        """Open the checkpoint, with this actor's share of the node's RAM as its budget where the
        user gave none; a user mistake comes back as its one line (None: ready)."""
        from klotski.io.checkpoint import Checkpoint
        from klotski.errors import USER_ERRORS
        from klotski.planning import compute_device
        from placement.tiers import detect_budgets
        try:
            c = self.config
            if host_share < 1 and (c.host_memory is None or (compute_device(c.device) == "cpu"
                                                             and c.device_memory is None)):
                found = detect_budgets(compute_device(c.device), c.device_memory, c.host_memory)
                on_cpu = compute_device(c.device) == "cpu"
                self.config = c.replace(
                    host_memory=c.host_memory or int(found.host * host_share),
                    device_memory=c.device_memory or (int(found.device * host_share) if on_cpu else None))
            self.ckpt = Checkpoint.open(c.model, direct_io=c.direct_io)
        except USER_ERRORS as e:
            return str(e)
        return None

    def serve(self, shard: list) -> dict:
        """Records for every request of `shard` (results and error records), with counts."""
        from klotski.errors import USER_ERRORS
        from klotski.io.records import error_record
        from klotski.schedule.sequences import line_record, prepare
        c = self.config
        seqs, errors = prepare(shard, self.ckpt.tokenizer, self.ckpt.spec, c)
        records = [error_record(e, fmt=c.output_format) for e in errors]
        t0 = time.perf_counter()
        if seqs and self.engine is None:
            try:
                self.engine = _build(c, self.ckpt, seqs)
            except USER_ERRORS as e:
                return {"user_error": str(e)}
        before = self._done()
        for seq in self.engine.run(seqs) if seqs else ():
            done = line_record(seq, fmt=c.output_format, model=c.model, include_token_ids=c.include_token_ids)
            if done is not None:  # a line of n samples is one record, once all are done
                records.append(done[0])
        after = self._done()
        return {"records": records, "busy_s": time.perf_counter() - t0, "generated": after[0] - before[0],
                "gen_s": after[1] - before[1], "plan": _plan_summary(self.engine)}

    def _done(self) -> tuple[int, float]:
        """Tokens generated and seconds spent generating them (prefill + decode) so far."""
        s = self.engine.stats if self.engine else None
        return (s.generated_tokens, s.prefill_s + s.decode_s) if s else (0, 0.0)

    def close(self) -> None:
        if self.engine:
            self.engine.close()
            self.engine = None


def _build(config, ckpt, seqs):
    from klotski.assemble import build_engine, setup_run
    return build_engine(config, ckpt, setup_run(config, ckpt, seqs).for_later_prompts())


def _plan_summary(engine) -> dict | None:
    if engine is None:
        return None
    plan = engine.plan
    return {"batch_size": engine.batch_size, "num_batches": engine.num_batches, "device": str(engine.device),
            "budget_device_bytes": engine.budgets.device, "budget_host_bytes": engine.budgets.host,
            "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 3) if plan else None}


# ---------------------------------------------------------------- the driver


@dataclass
class Slot:
    """One place in the pool: its actor (replaced when it dies) and what it served."""
    index: int
    actor: object = None
    generation: int = 0
    info: dict = field(default_factory=dict)
    records: int = 0
    shards: int = 0
    generated: int = 0
    busy_s: float = 0.0
    gen_s: float = 0.0
    deaths: int = 0
    plan: dict | None = None
    in_flight: int = 0

    def report(self) -> dict:
        return {"actor": self.index, "records": self.records, "shards": self.shards, "generated_tokens":
                self.generated, "busy_s": round(self.busy_s, 3),
                "gen_s": round(self.gen_s, 3),
                "tokens_per_s": round(self.generated / self.gen_s, 3) if self.gen_s else 0.0,
                "deaths": self.deaths, "plan": self.plan, **{k: self.info.get(k) for k in ("pid", "host", "gpus")}}


class RayRun:
    """The driver of one `generate --ray` run. `slots` (pids, records served) can be read while
    `run()` goes, which is how a test finds an actor's process to kill."""

    def __init__(self, config: RunConfig, jobs: Path, output: Path, *, address: str = "auto",
                 workers: int | None = None, shard: int = 512):
        self.config, self.jobs, self.output = config, Path(jobs), Path(output)
        self.address, self.workers, self.shard = address, workers, shard
        self.slots: list[Slot] = []
        self.reruns = 0  # shards given back by an actor that died, and served again
        self.ready = False  # every actor has started and opened the checkpoint

    # -- the pool

    def _connect(self):
        ray = require_ray()
        self._started = False
        if not ray.is_initialized():
            try:
                if self.address == "local":
                    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
                else:
                    ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
            except ConnectionError as e:
                why = str(e).splitlines()[0].split(". ")[0].rstrip(".")  # Ray's own advice names its flags, not ours
                raise UserError(f"--ray {self.address}: cannot join a Ray cluster ({why}); "
                                "start one with `ray start --head`, or pass --ray local to start one here") from None
            self._started = True
        return ray

    def _pool_size(self, ray) -> tuple[int, dict]:
        """Actors and what each asks for: one per GPU, else one per node, unless --workers."""
        total = ray.cluster_resources()
        gpus = int(total.get("GPU", 0))
        if gpus and self.config.device != "cpu":
            n = self.workers or gpus
            return n, {"num_gpus": 1, "num_cpus": 1}
        nodes = sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU"))
        n = self.workers or max(nodes, 1)
        cpus = max(1, int(total.get("CPU", 1)) // n)  # torch in the actor uses as many threads (OMP_NUM_THREADS)
        return n, {"num_cpus": cpus}

    def _start(self, ray, slots: list[Slot]) -> None:
        """Fresh actors for `slots`, started together (each imports torch and klotski: seconds)."""
        for slot in slots:
            slot.actor = ray.remote(Worker).options(scheduling_strategy="SPREAD", max_restarts=0,
                                                    **self._resources).remote(self.config.to_json())
            slot.generation += 1
        for slot, info in zip(slots, ray.get([slot.actor.info.remote() for slot in slots])):
            slot.info = info

    def _open_all(self, ray) -> None:
        """Each actor opens the checkpoint with its share of its node's RAM (actors per node)."""
        per_node = {}
        for s in self.slots:
            per_node[s.info["node"]] = per_node.get(s.info["node"], 0) + 1
        answers = ray.get([s.actor.open.remote(1 / per_node[s.info["node"]]) for s in self.slots])
        for answer in answers:
            if answer:
                raise UserError(answer)
        self.ready = True

    # -- the run

    def run(self) -> dict:
        from klotski.errors import JobFileError
        from klotski.io.jobs import stream_jobs
        from klotski.io.output import OutputWriter, read_output
        from klotski.io.records import error_record, is_error
        from klotski.io.requests import LineError
        import itertools
        earlier = read_output(self.output) if self.config.resume else None
        items = stream_jobs(self.jobs, earlier.ok if earlier else None)
        items = itertools.chain(list(itertools.islice(items, 1)), items)  # a missing job file fails here
        ray = self._connect()
        try:
            t_start = time.perf_counter()
            n, self._resources = self._pool_size(ray)
            self.slots = [Slot(i) for i in range(n)]
            try:
                self._start(ray, self.slots)
                self._open_all(ray)
            except ray.exceptions.RayTaskError as e:
                raise RunStopped(_actor_failed(e, "nothing was written")) from None
            t_ready = time.perf_counter()
            counts = {"ok": 0, "failed": 0, "skipped": 0}
            try:
                writer = OutputWriter(self.output, resume=self.config.resume, known=earlier)
            except OSError as e:
                raise UserError(f"{self.output}: cannot open the output file ({e.strerror}); choose another -o path")
            retry: deque[list] = deque()
            in_flight: dict = {}  # object ref -> (shard, slot, the slot's generation)

            def next_shard() -> list | None:
                if retry:
                    return retry.popleft()
                shard = []
                for item in items:
                    if item is None:
                        counts["skipped"] += 1
                    elif isinstance(item, LineError):
                        counts["failed"] += writer.write(error_record(item, fmt=self.config.output_format))
                    elif item.id in writer:
                        counts["skipped"] += 1
                    else:
                        shard.append(item)
                        if len(shard) >= self.shard:
                            break
                return shard or None

            with writer:
                try:
                    while True:
                        for s in sorted(self.slots, key=lambda s: s.in_flight):
                            while s.in_flight < IN_FLIGHT and (shard := next_shard()):
                                in_flight[s.actor.serve.remote(shard)] = (shard, s, s.generation)
                                s.in_flight += 1
                        if not in_flight:
                            break
                        [ref], _ = ray.wait(list(in_flight), num_returns=1)
                        shard, s, generation = in_flight.pop(ref)
                        if generation == s.generation:
                            s.in_flight -= 1
                        try:
                            result = ray.get(ref)
                        except ray.exceptions.RayActorError:  # died: kill -9, OOM, a lost node
                            retry.appendleft(shard)
                            self.reruns += 1
                            if generation == s.generation:
                                self._replace(ray, s)
                            continue
                        if "user_error" in result:
                            raise UserError(result["user_error"])
                        for record in result["records"]:
                            if writer.write(record):
                                counts["failed" if is_error(record) else "ok"] += 1
                                s.records += 1
                        s.shards += 1
                        s.generated += result["generated"]
                        s.busy_s += result["busy_s"]
                        s.gen_s += result["gen_s"]
                        s.plan = result["plan"] or s.plan
                except JobFileError as e:
                    raise RunStopped(f"the run stopped: {e}; {len(writer)} records are in {self.output}; "
                                     "rerun the same command to resume") from None
                except ray.exceptions.RayTaskError as e:  # a bug inside an actor: one line, what is written stays
                    raise RunStopped(_actor_failed(e, f"{len(writer)} records are in {self.output}")) from None
            for s in self.slots:
                try:
                    ray.get(s.actor.close.remote())
                except ray.exceptions.RayActorError:
                    pass
            t_end = time.perf_counter()
            return self._report(counts, wall_s=t_end - t_start, serve_s=t_end - t_ready)
        finally:
            for s in self.slots:
                if s.actor is not None:
                    ray.kill(s.actor)
            if self._started:
                ray.shutdown()

    def _replace(self, ray, s: Slot) -> None:
        s.deaths += 1
        if s.deaths > MAX_DEATHS:
            raise RunStopped(f"the Ray actor in slot {s.index} died {s.deaths} times (last on {s.info.get('host')}); "
                             f"records written so far are in {self.output}; rerun the same command to resume")
        print(f"klotski: actor {s.index} (pid {s.info.get('pid')} on {s.info.get('host')}) died; "
              "its shards go to a fresh actor", file=sys.stderr)
        ray.kill(s.actor)
        s.in_flight = 0  # its shards in flight come back as errors and are queued again
        self._start(ray, [s])
        per_node = sum(1 for o in self.slots if o.info.get("node") == s.info["node"])
        answer = ray.get(s.actor.open.remote(1 / per_node))
        if answer:
            raise UserError(answer)

    def _report(self, counts: dict, *, wall_s: float, serve_s: float) -> dict:
        """tokens_per_s: the pool's throughput once its actors are up (serve_s: from every actor
        ready to the last record; the engines are built on their first shard, inside it)."""
        generated = sum(s.generated for s in self.slots)
        return {"tokens_per_s": round(generated / serve_s, 3) if serve_s else 0.0, "wall_s": round(wall_s, 4),
                "serve_s": round(serve_s, 4),
                "requests": counts, "tokens": {"generated": generated},
                "predicted_tokens_per_s": _sum_predicted(self.slots),
                "ray": {"address": self.address, "actors": len(self.slots), "shard_lines": self.shard,
                        "shards_rerun": self.reruns, "per_actor": [s.report() for s in self.slots]},
                "order": (f"the job file streams in shards of {self.shard} lines dealt to the actors as they free "
                          "up; each actor sorts a shard's prompts longest first; records are written as shards "
                          "finish"),
                "config": self.config.to_json()}


def _actor_failed(e, kept: str) -> str:
    """One line for an exception inside an actor (our bug); Ray keeps the traceback in its logs."""
    cause = e.cause if getattr(e, "cause", None) is not None else e
    last = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
    return (f"internal error in a Ray actor ({type(cause).__name__}: {last}); {kept}; rerun the same command "
            "to resume (the traceback is in the Ray logs, /tmp/ray/session_latest/logs on the actor's node)")


def _sum_predicted(slots) -> float | None:
    each = [s.plan.get("predicted_tokens_per_s") for s in slots if s.plan]
    return round(sum(each), 3) if each and None not in each else None


def generate(config: RunConfig, jobs: Path, output: Path) -> int:
    """`klotski generate --ray`: the run, its summary on stderr, its report at --report."""
    from klotski.util.writes import writing
    report = RayRun(config, jobs, output, address=config.ray, workers=config.workers,
                    shard=config.shard).run()
    print(summary(report, output), file=sys.stderr)
    if config.report:
        with writing(config.report, "the run report", then=f"every record is in {output}; only this file is missing"):
            save_report(config.report, report)
    return 1 if report["requests"]["failed"] else 0


def summary(report: dict, out_path: Path) -> str:
    ray_ = report["ray"]
    lines = [requests_line(report["requests"]),
             f"speed     {report['tokens_per_s']:.1f} tok/s from {ray_['actors']} Ray actors "
             f"({report['serve_s']:.1f} s serving, after {report['wall_s'] - report['serve_s']:.1f} s starting them)"
             + (f"; planner predicted {report['predicted_tokens_per_s']:.1f} (sum over actors)"
                if report["predicted_tokens_per_s"] else "")]
    for a in ray_["per_actor"]:
        lines.append(f"actor {a['actor']}   {a['records']} records in {a['shards']} shards, {a['tokens_per_s']:.1f} tok/s "
                     f"while generating, on {a['host']}" + (f", died {a['deaths']}x" if a["deaths"] else ""))
    if ray_["shards_rerun"]:
        lines.append(f"reruns    {ray_['shards_rerun']} shards of actors that died were served again")
    return "\n".join(lines + closing_lines(report, out_path))


# ---------------------------------------------------------------- Ray Data


class Generator:
    """A `map_batches` class holding one engine: each batch of prompt rows comes back with its
    columns plus `completion`, `finish_reason`, `prompt_tokens`, `completion_tokens` and
    `error` (None, or why the row could not be served). Rows are validated as job lines are
    (a `messages` column for chat, optional per-row `max_new_tokens`, `temperature`, `top_p`,
    `stop`, `seed`); give an id column for sampling that does not depend on batching."""

    FIELDS = ("completion", "finish_reason", "prompt_tokens", "completion_tokens")  # a klotski record's
    OUTPUTS = (*FIELDS, "error")

    def __init__(self, config: dict, prompt_field: str = "prompt", messages_field: str = "messages",
                 id_field: str = "id"):
        from klotski.io.checkpoint import Checkpoint
        self.config = RunConfig(**config)
        self.fields = prompt_field, messages_field, id_field
        self.ckpt = Checkpoint.open(self.config.model, direct_io=self.config.direct_io)
        self.engine = None

    def __call__(self, batch: dict) -> dict:
        from klotski.io.requests import InvalidLine, Request, line_fields
        from klotski.schedule.sequences import line_record, prepare
        columns = {k: _py(v) for k, v in batch.items()}
        rows = len(next(iter(columns.values()), []))
        out = {k: [None] * rows for k in self.OUTPUTS}
        requests = []
        for i in range(rows):
            obj, (pf, mf, idf) = {k: v[i] for k, v in columns.items()}, self.fields
            obj = {**{k: v for k, v in obj.items() if k not in (pf, mf, idf)},
                   "prompt": obj.get(pf), "messages": obj.get(mf)}
            rid = columns[idf][i] if idf in columns and columns[idf][i] is not None else f"row{i}"
            try:  # the job file's own validation of a line's fields (klotski/io/requests.py)
                req = Request(id=str(rid), line=i + 1, **line_fields(obj))
            except InvalidLine as e:
                out["error"][i] = str(e)
                continue
            if req.n > 1 or req.logprobs is not None or len(req.prompts()) > 1:  # no column holds them: refused
                out["error"][i] = ("n > 1, a list of prompts and logprobs have no column here; use klotski "
                                   "generate (with --ray) for them")
                continue
            requests.append(req)
        seqs, errors = prepare(requests, self.ckpt.tokenizer, self.ckpt.spec, self.config)
        for e in errors:
            out["error"][e.line - 1] = e.message
        if seqs and self.engine is None:
            self.engine = _build(self.config, self.ckpt, seqs)
        for seq in self.engine.run(seqs) if seqs else ():
            # the line's klotski record (one sample: its fields are the columns), as every writer's
            if (done := line_record(seq, fmt="klotski", model=self.config.model)) is None:
                continue
            (record, failed), i = done, seq.request.line - 1
            if failed is not None:
                out["error"][i] = failed.message
                continue
            for k in self.FIELDS:
                out[k][i] = record[k]
        return {**batch, **out}


@dataclass
class Processor:
    """`processor(ds)`: the dataset with completions (lazy, as Ray Data is)."""
    config: RunConfig
    concurrency: int = 1
    batch_size: int = 64
    num_gpus: float = 0
    num_cpus: float = 1
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    id_field: str = "id"
    preprocess: object = None
    postprocess: object = None

    def __call__(self, ds):
        if self.preprocess:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(Generator, batch_size=self.batch_size, concurrency=self.concurrency,
                            num_gpus=self.num_gpus, num_cpus=self.num_cpus,
                            fn_constructor_kwargs={"config": self.config.to_json(), "prompt_field": self.prompt_field,
                                                   "messages_field": self.messages_field, "id_field": self.id_field})
        return ds.map(self.postprocess) if self.postprocess else ds


def build_processor(config: RunConfig, **options) -> Processor:
    """The Ray Data API, shaped like `ray.data.llm.build_processor`: `processor(ds)` maps a
    Dataset of prompt rows to one with completions, with `concurrency` engines (actors) of
    `num_gpus`/`num_cpus` each, `batch_size` rows per engine call (the planner sizes an engine
    from its first batch), optional row-wise `preprocess`/`postprocess`."""
    require_ray()
    return Processor(config, **options)


def _py(value):
    """Ray Data hands numpy arrays and scalars; the job-line validation wants plain Python."""
    import numpy as np
    if isinstance(value, np.ndarray):
        return [_py(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _py(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_py(v) for v in value]
    return value
