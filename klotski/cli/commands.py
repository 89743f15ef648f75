"""One handler per `klotski` subcommand: each builds what it needs from the parsed flags and
calls one function of the package. Each returns an exit status; user mistakes are raised as
user errors (klotski/errors.py) and printed as one line by klotski/cli/main.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from klotski import planning
from klotski.assemble import pipeline_cost
from klotski.config import RunConfig


def generate(a) -> int:
    from klotski.cli.parser import config_from_args
    from klotski.generate import generate as run
    return run(config_from_args(a), Path(a.jobs), a.output)


def serve(a) -> int:
    from klotski.cli.parser import api_key, config_from_args
    from klotski.serve.server import ServeOptions
    from klotski.serve.server import serve as run
    return run(config_from_args(a), ServeOptions(
        host=a.host, port=a.port, api_key=api_key(a), data_dir=a.data_dir, max_upload=a.max_upload_size,
        max_body=a.max_body_size, served_names=tuple(a.served_model_name or ()),
        batch_window_s=a.test_batch_window, fault_file=a.fault_file, max_waiting=a.max_waiting))


def _config(a) -> RunConfig:
    return RunConfig(model=a.model, batch_size=a.batch_size, num_batches=a.num_batches, schedule=a.schedule,
                     quantize=a.quantize, emulate_link_gbps=a.emulate_link_gbps, max_new_tokens=a.gen_len,
                     quality_max_gap=a.quality_max_gap, quality_min_agreement=a.quality_min_agreement,
                     host_attention=a.host_attention, host_experts=a.host_experts,
                     prefill_chunk=a.prefill_chunk, device=a.device)


def plan(a) -> int:
    from planner.precision import format_options
    from planner.solve import format_plan
    _, _, result = _plan(a)
    # each precision weighed first, then the plan of the one --quantize took
    print(result.to_json() if a.json else format_options(result.precision) + "\n\n" + format_plan(result))
    return 0


def _plan(a):
    """(shape, profile, the planner's Plan) for `klotski plan` and `klotski simulate`."""
    return planning.plan_from_flags(a.model, a.hardware, _config(a), device_memory=a.device_memory,
                                    host_memory=a.host_memory, prompt_len=a.prompt_len, gen_len=a.gen_len,
                                    pipeline_cost=pipeline_cost)


def simulate(a) -> int:
    shape, profile, chosen = _plan(a)
    rows, trace = planning.compare_schedules(shape, profile, chosen, _config(a), prompt_len=a.prompt_len,
                                             gen_len=a.gen_len, skew=a.skew, trace=bool(a.trace))
    if a.trace:
        Path(a.trace).write_text(json.dumps(trace))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'schedule':14s} {'bs':>4s} {'n':>4s} {'tokens/s':>10s} {'bubble':>7s}")
        for r in rows:
            print(f"{r['schedule']:14s} {r['batch_size']:4d} {r['num_batches']:4d} "
                  f"{r['tokens_per_s']:10.2f} {r['bubble_share']:7.1%}")
    return 0


def profile(a) -> int:
    config = RunConfig(model=a.model, device=a.device, emulate_link_gbps=a.emulate_link_gbps)
    result = planning.measure_here(planning.model_shape(config.model), device=config.device,
                                   link_gbps=config.emulate_link_gbps, refresh=a.refresh,
                                   pipeline_cost=pipeline_cost)
    if a.show:
        from planner.answer_lengths import summary
        from planner.calibrate import show
        print(show(result))
        print("\n".join(summary(planning.answer_lengths_of(config.model))))
    else:
        print(result.to_json())
    return 0


def correlate(a) -> int:
    """Fill the expert-correlation table ahead of a big job: one engine, the budgets and
    planner of `generate`, the table learned as it runs and saved where `generate` looks."""
    from klotski.assemble import build_engine, setup_run
    from klotski.io.checkpoint import Checkpoint
    from klotski.prefetch.correlate import new_table, table_path, warmup_prompts
    from klotski.io.jobs import read_jobs
    from klotski.io.requests import Request
    from klotski.prefetch.predictors import CorrelationPredictor
    from klotski.schedule.sequences import prepare
    if a.jobs:
        requests, _ = read_jobs(Path(a.jobs))
        requests = requests[: a.count]
    else:
        requests = [Request(id=str(i), line=i + 1, prompt=p, messages=None)
                    for i, p in enumerate(warmup_prompts(a.count))]
    config = RunConfig(model=a.model, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                       device_memory=a.device_memory, host_memory=a.host_memory, progress=False)
    ckpt = Checkpoint.open(config.model)
    out = Path(a.output) if a.output else table_path(ckpt)
    spec = ckpt.spec
    table = new_table(spec.shape, path=a.path_length)
    seqs, _ = prepare(requests, ckpt.tokenizer, spec, config)
    engine = build_engine(config, ckpt, setup_run(config, ckpt, seqs),
                          predictor=CorrelationPredictor(table, save_to=(out, ckpt.key)))
    from tqdm import tqdm
    for _ in tqdm(engine.run(seqs), total=len(seqs), unit="req", desc="correlate", file=sys.stderr, disable=None):
        pass
    engine.close()
    from klotski.util.writes import writing
    with writing(out, "the expert-correlation table", then="make room and rerun (or pass -o on another disk)"):
        table.save(out, ckpt.key)
    print(f"wrote the {table.describe()} ({len(seqs)} prompts) to {out}",
          file=sys.stderr)
    return 0


def quantize(a) -> int:
    from klotski.io.checkpoint import Checkpoint
    from klotski.compress.quantized import check_room, ensure_quantized
    ckpt = Checkpoint.open(a.model)
    check_room(ckpt, ckpt.spec.dtype, a.output, optimize=a.optimize)
    out = ensure_quantized(ckpt, ckpt.spec.dtype, a.output, optimize=a.optimize)
    ckpt.close()
    print(f"quantized checkpoint: {out}")
    return 0


def show(a) -> int:
    """A few output records, in file order, each under the start of its prompt."""
    import shutil
    import textwrap

    from klotski.io.records import is_error, record_key
    prompts = {}
    if a.jobs:
        from klotski.io.jobs import read_jobs
        requests, _ = read_jobs(Path(a.jobs))
        # the last paragraph of the prompt (or of the last message): where a passage to label is
        prompts = {r.id: (r.prompt if r.prompt is not None else r.messages[-1][1]).split("\n\n")[-1]
                   for r in requests if isinstance(r.prompt, str) or r.messages is not None}
    width = min(100, shutil.get_terminal_size().columns)
    try:
        lines = Path(a.output).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        from klotski.errors import UserError
        raise UserError(f"{a.output}: cannot read ({e.strerror})") from None
    for line in lines[: a.count]:
        rec = json.loads(line)
        key = record_key(rec)
        if is_error(rec):
            text = "error: " + (rec["error"].get("message", "") if isinstance(rec["error"], dict) else "")
        elif "custom_id" in rec:
            choice = rec["response"]["body"]["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
        else:  # (a line of n samples: its first)
            text = rec["completion"] if "completion" in rec else rec["choices"][0]["completion"]
        prompt = " ".join(prompts.get(key, "").split())
        print(f"[{key}] " + textwrap.shorten(prompt, width - len(key) - 3) if prompt else f"[{key}]")
        print(textwrap.fill(text.strip() or "(empty)", width, initial_indent="  -> ", subsequent_indent="     "))
    return 0


def check(a) -> int:
    from klotski.io import check as checker
    return checker.main(a)


def bench(a) -> int:
    from klotski.bench import driver
    return driver.main(a)


def make_tiny(a) -> int:
    from klotski.util.writes import writing
    with writing(a.output, "the checkpoint"):
        if a.family != "mixtral":
            from klotski.builtin.families import build_family
            path, what = build_family(a.output, a.family, seed=a.seed), a.family
        else:
            from klotski.builtin import tiny
            path, what = tiny.build_checkpoint(a.output, a.preset, seed=a.seed, num_shards=a.shards,
                                               fused_experts=a.fused_experts, routing=a.routing), a.preset
    print(f"wrote {what} checkpoint to {path}")
    return 0


def jobs(a) -> int:
    from klotski.io.wikitext import export_wikitext
    from klotski.util.writes import writing
    with writing(a.output, "the job file"):
        n = export_wikitext(a.output, a.count, a.seed)
    print(f"wrote {n} prompts to {a.output}")
    return 0


COMMANDS = {"generate": generate, "plan": plan, "simulate": simulate, "profile": profile, "correlate": correlate,
            "quantize": quantize, "show": show, "check": check, "bench": bench, "make-tiny": make_tiny, "jobs": jobs,
            "serve": serve}
