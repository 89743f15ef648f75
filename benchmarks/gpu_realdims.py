"""`klotski bench --preset gpu` (issue 46): the job Klotski exists for, measured at real layer
dimensions, a 24 GiB-equivalent budget and a PCIe 4 link, side by side with what users would
pick instead, within one GPU call (about 5 minutes on an H100/H200).

* Models (klotski/builtin/realdims.py): Mixtral-8x7B layers (hidden 4096, 8 experts 14336 wide,
  top-2, vocab 32000), Qwen3-30B-A3B layers (2048, 128 experts 768 wide, top-8) and, as time
  allows, Mixtral-8x22B (6144, 16384); --layers of them (4 on a GPU), random bfloat16 weights
  drawn on the device, skewed routing by default, written to /dev/shm (RAM) when it has room.
  On a CPU the same command runs with every width divided by --shrink (16): minutes, not GB.
* Budget: the device budget the planner gives a 24 GiB card (the `rtx3090-pcie4` profile's
  device memory, 22.56 GiB) for the FULL-depth model, scaled to the layers built: the ends
  (embedding, head) plus the same share of each layer the full model gets
  (budget = ends + (card - ends) / full_layers x layers, at the built widths). On CUDA every
  process's caching allocator is capped to it plus RUNTIME_HEADROOM (torch.cuda.set_per_process_memory_fraction,
  accelerate's process too; accelerate's own max_memory, which counts weights only, is 80% of
  it so its activations fit beside them).
* Link: --link-gbps (25, PCIe 4) held by Klotski's --emulate-link, which on CUDA holds each
  copy's completion to the emulated link's schedule (klotski/execute/cudacopies.py); no device
  or bus setting is changed. One row runs at the native link. accelerate cannot be throttled
  without patching it: it always runs at the native link (an advantage to it).
* Prompts: labelling-like, --prompt-tokens (500) tokens each (an instruction and numbered
  passages from jobs/wikitext.jsonl, cut to the length by the model's tokenizer), 32 new tokens.
* Rows, each system in its own process and from the same start (no expert-correlation table
  learned by an earlier row: it steers prefetching and which experts stay resident), in this order until --deadline (rows not started by
  then are listed as not run; --row-timeout caps each): Mixtral dims: klotski (the planner's bs
  and n, or forced by --batch-size/--num-batches), simple and accelerate at klotski's batch size
  (one batch of prompts); Qwen3 dims: klotski (host compute auto), simple; Mixtral dims: klotski
  with --host-attention on --host-experts on; then multibatch at klotski's bs and n, klotski at the native link, kernels per
  layer (klotski's bs and n, op_count.layer_ops on the device), Mixtral-8x22B klotski and simple.
* Per row: prefill tok/s (prompt tokens of prefill-only steps / their seconds) and decode tok/s
  (generated tokens after each prompt's first / decode seconds); the share of decode time the link is busy (decode
  host->device bytes / link rate / decode time; the rate is the emulated one, or the measured
  pinned copy at the native link); decode bubble; host compute seconds per layer-step beside
  link seconds per layer-step; kernels per layer; allocator peak against the budget; the
  planner's replayed tok/s against the measured; tok/s extrapolated to the full depth
  (x layers / full layers: the layers dominate the step) beside the Klotski paper's Table 3
  (3090) and MoE-Gen's published decode (A5000).

    klotski bench --preset gpu                       # CUDA when present, else CPU at shrink 16
    python benchmarks/gpu_realdims.py --device cpu --rows mixtral-8x7b:klotski,mixtral-8x7b:simple
"""
from __future__ import annotations

import argparse
import json
import runpy
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
import gpu  # noqa: E402  (benchmarks/gpu.py: launch, klotski_once, accelerate_run, the pinned copy)
from bench_runner import machine_info  # noqa: E402

CARD = "rtx3090-pcie4"
MOEGEN_CARD = "a5000-pcie4-512g"
ACCELERATE_WEIGHT_SHARE = 0.8  # of the budget, as accelerate's max_memory (weights only)
# The allocator's cap is the budget plus what the CUDA runtime takes through the caching allocator
# outside klotski's accounts (a cuBLAS workspace, 32 MiB a handle, made before the accounts'
# baseline) and the allocator's rounding: a cap of the budget itself would stop a run that keeps
# within its budget, as it is meant to fill it.
RUNTIME_HEADROOM = 64 << 20
# host compute at bs x n prompts of 500 tokens is the row most likely to run long: last of the mandatory
MANDATORY = ("mixtral-8x7b:klotski", "mixtral-8x7b:simple", "mixtral-8x7b:accelerate", "qwen3-30b-a3b:klotski",
             "qwen3-30b-a3b:simple", "mixtral-8x7b:klotski-host")
AS_TIME_ALLOWS = ("mixtral-8x7b:multibatch", "mixtral-8x7b:klotski-native", "mixtral-8x7b:kernels",
                  "qwen3-30b-a3b:kernels", "mixtral-8x22b:klotski", "mixtral-8x22b:simple")
ROWS = MANDATORY + AS_TIME_ALLOWS
INSTRUCTION = ("Label the topic of each numbered passage as one of: history, science, geography, arts, sport, "
               "other. Answer with the labels only, one per line.\n\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--layers", type=int, help="layers built (default 4 on CUDA, 2 on CPU)")
    ap.add_argument("--shrink", type=int, help="widths divided by this (default 1 on CUDA, 16 on CPU)")
    ap.add_argument("--prompts", type=int, help="prompts of the klotski rows (default 512 on CUDA, 16 on CPU)")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, help="force Klotski's batch size (default: the planner's)")
    ap.add_argument("--num-batches", type=int, help="force Klotski's n (default: the planner's)")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="the emulated link (default 25: PCIe 4)")
    ap.add_argument("--routing", default="skewed", choices=("skewed", "uniform"))
    ap.add_argument("--rows", help=f"comma list of rows to run, in this order (default all): {','.join(ROWS)}")
    ap.add_argument("--deadline", type=float, default=270.0, help="seconds after which no row starts (default 270)")
    ap.add_argument("--row-timeout", type=float, default=150.0,
                    help="seconds one row may run (default 150), and never past the deadline + 30 s")
    ap.add_argument("--allocator-slack", type=float, default=0.0,
                    help="CUDA allocator cap = budget x (1 + this) + 64 MiB of runtime headroom (default 0)")
    ap.add_argument("--model-dir", type=Path, help="where the models are built (default /dev/shm when it has room)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/klotski-gpu-realdims"))
    ap.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/gpu-realdims-DEVICE.json)")
    return ap.parse_args(argv)


def capped_cli(cap: int, args: list[str]) -> int:
    """`klotski ARGS` with this process's CUDA caching allocator capped to `cap` bytes."""
    gpu.cap_allocator(cap)
    sys.argv = ["klotski", *args]
    try:
        runpy.run_module("klotski.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code or 0
    return 0


def kernels_child(spec_path: Path) -> int:
    """Kernels per decode layer step of the klotski schedule at the spec's bs and n, on its device."""
    from klotski.assemble import open_engine
    from klotski.measure.op_count import layer_ops
    s = json.loads(spec_path.read_text())
    if s["device"] == "cuda":
        gpu.cap_allocator(s.get("cap"))
    ops = layer_ops(open_engine, s["model"], s["n"], s["bs"], dtype="bfloat16", device=s["device"],
                    device_memory=s["budget"], emulate_link_gbps=s["link_gbps"])
    Path(s["report"]).write_text(json.dumps({"kernels_per_layer": ops}))
    return 0


# --------------------------------------------------------------------------- setting up

def card_budget(name: str, layers: int, shrink: int) -> int:
    """The 24 GiB card's device budget for the full-depth model, scaled to `layers` at this shrink."""
    from klotski.builtin import realdims
    from planner.place import Budgets
    from planner.profile import load_profile
    card = Budgets.from_profile(load_profile(CARD)).device
    full_layers = realdims.SHAPES[name]["full_layers"]
    full, built = realdims.model_bytes(name, full_layers), realdims.model_bytes(name, layers, shrink)
    share = (card - full["ends"]) / (full_layers * full["layer"])  # of every layer, on the card
    return int(built["ends"] + share * layers * built["layer"])


def model_root(a, need: int) -> Path:
    if a.model_dir:
        return a.model_dir
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.2:
        return shm / "klotski-realdims"
    return a.work_dir / "models"


def labelling_jobs(model: Path, count: int, tokens: int, new: int, out: Path) -> Path:
    """`count` labelling prompts of exactly `tokens` tokens (by the model's tokenizer)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    passages = [json.loads(l)["prompt"] for l in (ROOT / "jobs" / "wikitext.jsonl").read_text().splitlines() if l]
    with open(out, "w") as f:
        for i in range(count):
            text, k = INSTRUCTION, 0
            while len(tok(text)["input_ids"]) < tokens:
                text += f"{k + 1}. {passages[(i * 7 + k) % len(passages)]}\n"
                k += 1
            ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
            f.write(json.dumps({"id": f"label-{i:04d}", "prompt": tok.decode(ids), "max_new_tokens": new}) + "\n")
    return out


def first_lines(src: Path, count: int, out: Path) -> Path:
    out.write_text("".join(src.read_text().splitlines(keepends=True)[:count]))
    return out


class Shape:
    """One model shape of the run: built on first use, its budget, jobs and klotski's choices."""

    def __init__(self, a, name: str):
        from klotski.builtin import realdims
        self.name, self.a = name, a
        self.full_layers = realdims.SHAPES[name]["full_layers"]
        b = realdims.model_bytes(name, a.layers, a.shrink)
        self.bytes = b["ends"] + a.layers * b["layer"]
        self.budget = card_budget(name, a.layers, a.shrink)
        self.cap = int(self.budget * (1 + a.allocator_slack)) + RUNTIME_HEADROOM if a.device == "cuda" else None
        self.dir = model_root(a, self.bytes) / f"{name}-{a.layers}l-s{a.shrink}-{a.routing}"
        self.work = a.work_dir / name
        self.model = self.jobs = None
        self.bs = self.n = None  # klotski's, once its row ran (or the planner's, where it failed)
        self.klotski_failed = None  # its row's error: not run again for the rows that need its choices
        self.table = None  # where klotski keeps the model's expert-correlation table
        self.build_s = None

    def ready(self) -> None:
        from klotski.builtin import realdims
        if self.model:
            return
        for d in ("logs", "runs"):
            (self.work / d).mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.model = realdims.build(self.dir, self.name, self.a.layers, device=self.a.device, shrink=self.a.shrink,
                                    routing=self.a.routing)
        self.build_s = round(time.perf_counter() - t0, 2)
        if self.a.device == "cuda":  # the rows' processes get the memory the build drew on
            import torch
            torch.cuda.empty_cache()
        self.jobs = labelling_jobs(self.model, self.a.prompts, self.a.prompt_tokens, self.a.max_new_tokens,
                                   self.work / "jobs.jsonl")
        print(f"{self.name}: {self.a.layers} layers, {self.bytes / 2**30:.2f} GiB at {self.model} (ready in "
              f"{self.build_s} s); device budget {self.budget / 2**30:.3f} GiB"
              + (f", allocator cap {self.cap / 2**30:.3f} GiB" if self.cap else ""), flush=True)

    def forget_routing(self) -> None:
        """Every row starts as the first does: without the expert-correlation table an earlier
        row learned (it steers prefetching and which experts stay resident: the rows would not
        run alike)."""
        from klotski.io.checkpoint import Checkpoint
        from klotski.prefetch.correlate import table_path
        if self.table is None:
            ckpt = Checkpoint.open(str(self.model))
            self.table = table_path(ckpt)
            ckpt.close()
        self.table.unlink(missing_ok=True)


# --------------------------------------------------------------------------- running rows

def _ns(a, shape: Shape, jobs: Path, timeout: float) -> argparse.Namespace:
    """The namespace gpu.py's launch/klotski_once/accelerate_run read."""
    return argparse.Namespace(work_dir=shape.work, timeout=timeout, budget=shape.budget, model=shape.model, jobs=jobs,
                              device=a.device, dtype="bfloat16", max_new_tokens=a.max_new_tokens,
                              allocator_cap=shape.cap)


def klotski_row(a, shape: Shape, tag: str, timeout: float) -> dict:
    schedule = "multibatch" if tag == "multibatch" else "simple" if tag == "simple" else "klotski"
    extra, jobs = [], shape.jobs
    if tag != "klotski-native":
        extra += ["--emulate-link", a.link_gbps]
    if tag == "klotski-host":
        extra += ["--host-attention", "on", "--host-experts", "on"]
    elif shape.name.startswith("qwen3") and tag == "klotski":
        extra += ["--host-attention", "auto", "--host-experts", "auto"]
    if tag == "klotski" and (a.batch_size or a.num_batches):
        extra += [*(["--batch-size", a.batch_size] if a.batch_size else []),
                  *(["--num-batches", a.num_batches] if a.num_batches else [])]
    elif tag == "multibatch":
        extra += ["--batch-size", shape.bs, "--num-batches", shape.n]
    elif tag == "simple":  # one batch at klotski's batch size
        extra += ["--batch-size", shape.bs, "--num-batches", 1]
        jobs = first_lines(shape.jobs, shape.bs, shape.work / f"jobs-{shape.bs}.jsonl")
    launcher = [sys.executable, __file__, "--capped", shape.cap] if shape.cap else None
    t0 = time.perf_counter()
    row = gpu.klotski_once(_ns(a, shape, jobs, timeout), schedule, tag, shape.budget, extra, launcher)

    def again(extra, launcher, then):  # a GPU session's time is scarce: the row says so (first_try)
        left = timeout - (time.perf_counter() - t0)
        rerun = gpu.klotski_once(_ns(a, shape, jobs, max(10.0, left)), schedule, tag, shape.budget, extra, launcher)
        return {**rerun, "first_try": {"error": row["error"], "then": then}}

    if not row["ok"] and "ran out" in str(row["error"]):
        # A budget overrun is a bug (this benchmark found one on CPU: newcomers' chunks sized
        # without the shared prefix's keys, since fixed): measured again without the prefix cache.
        row = again([*extra, "--no-prefix-cache"], launcher, "rerun with --no-prefix-cache")
    elif not row["ok"] and launcher and "out of memory" in str(row["error"]).lower():
        # the allocator's cap, not the budget, was short (memory outside klotski's accounts)
        cap = int(shape.cap * 1.25)
        row = again(extra, [*launcher[:-1], cap], f"rerun with the allocator cap raised to {cap} bytes")
    report = shape.work / "runs" / f"{schedule}-{tag}.report.json"
    r = json.loads(report.read_text()) if row["ok"] else {}
    return {**row, **figures(a, shape, r, native=tag == "klotski-native")}


def accelerate_row(a, shape: Shape, timeout: float) -> dict:
    jobs = first_lines(shape.jobs, shape.bs, shape.work / f"jobs-{shape.bs}.jsonl")
    ns = _ns(a, shape, jobs, timeout)
    ns.budget = int(shape.budget * ACCELERATE_WEIGHT_SHARE) if a.device == "cuda" else shape.budget
    row = gpu.accelerate_run(ns, "accelerate", shape.bs, ns.budget)
    report = shape.work / "runs" / "accelerate-accelerate.report.json"
    r = json.loads(report.read_text()) if row["ok"] else {}
    if r:
        gen, ok = r["generated_tokens"], r["requests"]["ok"]
        row.update(prefill_tok_s=gpu.per_s(ok * a.prompt_tokens, r["prefill_s"]),
                   decode_tok_s=gpu.per_s(gen - ok, r["decode_s"]), bs=shape.bs, n=1,
                   allocator_peak=row.get("peak_device_bytes"), budget=shape.budget)  # CPU: weights kept resident
    return row


def kernels_row(a, shape: Shape, timeout: float) -> dict:
    spec, report = shape.work / "runs" / "kernels.spec.json", shape.work / "runs" / "kernels.report.json"
    spec.write_text(json.dumps({"model": str(shape.model), "n": shape.n, "bs": shape.bs, "device": a.device,
                                "budget": shape.budget, "cap": shape.cap, "link_gbps": a.link_gbps,
                                "report": str(report)}))
    row, r = gpu.launch(_ns(a, shape, shape.jobs, timeout), "kernels", "kernels", shape.budget,
                        [sys.executable, __file__, "--kernels-child", spec], shape.work / "runs" / "kernels.out", report)
    return {**row, "kernels_per_layer": r and r["kernels_per_layer"], "bs": shape.bs, "n": shape.n}


def figures(a, shape: Shape, r: dict, native: bool) -> dict:
    """The per-row figures of the issue, from one klotski run report."""
    if not r:
        return {}
    io, mem, plan, host = r.get("io", {}), r.get("memory", {}), r.get("plan", {}), r.get("host_compute") or {}
    gen, ok = r["tokens"]["generated"], r["requests"]["ok"]
    # prompt tokens computed by prefill-only steps: continuous batching prefills newcomers inside decode steps
    prompt = r["tokens"]["prompt"] - (r.get("batching") or {}).get("prompt_tokens_in_decode_steps", 0)
    rate = (a.pinned_gbps if native else a.link_gbps) or None
    h2d_decode = io.get("decode_bytes", {}).get("host_to_device", 0)
    h2d_all = io.get("bytes", {}).get("host_to_device", 0)
    steps = (r.get("decode_steps") or 0) + (plan.get("prefill_passes") or 0)
    layer_steps = steps * a.layers or None
    host_s = sum((host.get(k) or {}).get("host_s", 0.0) for k in ("attention", "experts"))
    replayed = r.get("replayed_tokens_per_s")
    return {"bs": plan.get("batch_size"), "n": plan.get("num_batches"), "prefill_tok_s": gpu.per_s(prompt, r["prefill_s"]),
            "decode_tok_s": gpu.per_s(gen - ok, r["decode_s"]),
            "link_gbps": rate, "decode_h2d_bytes": h2d_decode,
            "link_busy_decode": round(h2d_decode / (rate * 1e9) / r["decode_s"], 4) if rate and r["decode_s"] else None,
            "decode_bubble": r.get("bubble", {}).get("decode_share"),
            "host_s_per_layer_step": round(host_s / layer_steps, 6) if layer_steps else None,
            "link_s_per_layer_step": round(h2d_all / (rate * 1e9) / layer_steps, 6) if layer_steps and rate else None,
            "allocator_peak": mem.get("allocator_peak_device_bytes", mem.get("peak_device_bytes")),
            "accounted_peak": mem.get("peak_device_bytes"), "budget": mem.get("budget_device_bytes"),
            "allocator_retries": mem.get("allocator_retries"),
            "predicted_tok_s": replayed or r.get("predicted_tokens_per_s"),
            "measured_over_predicted": round(r["tokens_per_s"] / replayed, 3) if replayed else None,
            "host_compute": {k: (host.get(k) or {}).get("mode") for k in ("attention", "experts")}}


def extrapolate(shape: Shape, row: dict, layers: int) -> dict:
    """Full-depth tok/s by the layers' share of a step, beside the published figures."""
    from planner.moegen import KLOTSKI, MOEGEN
    scale = layers / shape.full_layers
    out = {"full_layers": shape.full_layers,
           "tok_s_full": row.get("tok_s") and round(row["tok_s"] * scale, 3),
           "decode_tok_s_full": row.get("decode_tok_s") and round(row["decode_tok_s"] * scale, 3)}
    if (shape.name, CARD) in KLOTSKI:
        out["paper_table3_tok_s"] = KLOTSKI[(shape.name, CARD)]
    if (shape.name, MOEGEN_CARD) in MOEGEN:
        out["moegen_decode_tok_s"] = MOEGEN[(shape.name, MOEGEN_CARD)][1]
    return out


def run_row(a, shapes: dict, key: str, timeout: float) -> dict:
    name, tag = key.split(":")
    shape = shapes.setdefault(name, Shape(a, name))
    shape.ready()
    if tag != "klotski":
        error = baseline_choices(a, shapes, shape, timeout)
        if error:
            return {"row": key, "ok": False, "error": error}
    shape.forget_routing()
    row = (accelerate_row(a, shape, timeout) if tag == "accelerate" else kernels_row(a, shape, timeout)
           if tag == "kernels" else klotski_row(a, shape, tag, timeout))
    if tag == "klotski":
        shape.bs, shape.n = (row["bs"], row["n"]) if row.get("ok") else (None, None)
        shape.klotski_failed = None if row.get("ok") else row.get("error") or "failed"
    elif shape.klotski_failed and tag in ("simple", "accelerate", "multibatch", "kernels"):
        row["choices_from"] = "klotski plan (the klotski row failed)"
    row.update(row=key, model=name, system=tag, layers=a.layers, shrink=a.shrink)
    if row.get("ok") and tag != "kernels":
        row["extrapolated"] = extrapolate(shape, row, a.layers)
    return row


def baseline_choices(a, shapes: dict, shape: Shape, timeout: float) -> str | None:
    """Set the batch size and n a baseline row runs at, once per shape: forced by the flags (klotski's
    too), else klotski's row's (run first), else the plan's where klotski's row failed. An error
    where none is known."""
    if shape.bs:
        return None
    if a.batch_size and a.num_batches:
        shape.bs, shape.n = a.batch_size, a.num_batches
        return None
    if not shape.klotski_failed:
        a.results.append(run_row(a, shapes, f"{shape.name}:klotski", timeout))
        if shape.bs:
            return None
    shape.bs, shape.n = planned_choices(a, shape, min(timeout, 120.0))
    return None if shape.bs else f"{shape.name}:klotski failed and `klotski plan` gave no batch size"


def planned_choices(a, shape: Shape, timeout: float) -> tuple[int | None, int | None]:
    """The planner's batch size and n for this shape, budget and link (`klotski plan`, prompts of
    the job's length): what the baselines run at when klotski's own row failed."""
    cmd = [sys.executable, "-m", "klotski.cli", "plan", "--json", "--model", str(shape.model), "--device", a.device,
           "--device-memory", f"{shape.budget // 1024}KiB", "--prompt-len", str(a.prompt_tokens),
           "--gen-len", str(a.max_new_tokens), "--emulate-link", str(a.link_gbps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        plan = json.loads(out.stdout)
        return plan.get("batch_size"), plan.get("num_batches")
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None, None


def targets(rows: dict) -> list[dict]:
    """The issue's targets, each with its figure and whether it was met (None: not measured)."""
    def get(key, field):
        r = rows.get(key)
        return r.get(field) if r and r.get("ok") else None

    def ratio(x, y):
        return round(x / y, 3) if x and y else None

    k = "mixtral-8x7b:klotski"
    out = [("klotski / simple tok/s, Mixtral dims", ratio(get(k, "tok_s"), get("mixtral-8x7b:simple", "tok_s")), ">=", 4.0),
           ("klotski / accelerate tok/s, same bs", ratio(get(k, "tok_s"), get("mixtral-8x7b:accelerate", "tok_s")), ">=", 10.0),
           ("klotski / multibatch tok/s", ratio(get(k, "tok_s"), get("mixtral-8x7b:multibatch", "tok_s")), ">=", 1.2),
           ("link busy share of decode, Mixtral klotski", get(k, "link_busy_decode"), ">=", 0.85),
           ("decode bubble, Mixtral klotski", get(k, "decode_bubble"), "<=", 0.10),
           ("Qwen3 host s per layer-step / link s per layer-step",
            ratio(get("qwen3-30b-a3b:klotski", "host_s_per_layer_step"),
                  get("qwen3-30b-a3b:klotski", "link_s_per_layer_step")), "<=", 0.5)]
    for key in (k, "qwen3-30b-a3b:klotski"):
        m = get(key, "measured_over_predicted")
        out.append((f"planner replayed within 25%, {key} (measured / predicted)", m, "within", 0.25))
    res = []
    for what, value, op, goal in out:
        met = None if value is None else (value >= goal if op == ">=" else value <= goal if op == "<=" else
                                          abs(value - 1) <= goal)
        res.append({"target": f"{what} {op} {goal}", "value": value, "met": met})
    return res


def table(rows: list[dict]) -> str:
    def f(v, spec="{:.2f}"):
        return "-" if v is None else spec.format(v)

    head = ("row", "bs x n", "prefill tok/s", "decode tok/s", "tok/s", "link busy (dec)", "dec bubble",
            "host ms/layer", "link ms/layer", "kernels/layer", "alloc peak/budget MiB", "measured/predicted",
            "full-depth tok/s (dec)", "paper T3 / MoE-Gen dec")
    out = []
    for r in rows:
        if r.get("first_try"):
            r = {**r, "row": r["row"] + " (*)"}
        if not r.get("ok"):
            out.append((r["row"], "FAILED: " + str(r.get("error"))[:150], *[""] * (len(head) - 2)))
            continue
        ex, mib = r.get("extrapolated") or {}, lambda x: f(x and x / 2**20, "{:.0f}")
        published = " / ".join(str(ex[k]) for k in ("paper_table3_tok_s", "moegen_decode_tok_s") if k in ex) or "-"
        out.append((r["row"] + (" (partial: cut at its time limit)" if r.get("partial") else ""),
                    f"{r.get('bs')} x {r.get('n')}", f(r.get("prefill_tok_s"), "{:.1f}"),
                    f(r.get("decode_tok_s"), "{:.1f}"), f(r.get("tok_s"), "{:.1f}"),
                    f(r.get("link_busy_decode"), "{:.0%}"), f(r.get("decode_bubble"), "{:.1%}"),
                    f(r.get("host_s_per_layer_step") and r["host_s_per_layer_step"] * 1e3, "{:.2f}"),
                    f(r.get("link_s_per_layer_step") and r["link_s_per_layer_step"] * 1e3, "{:.2f}"),
                    f(r.get("kernels_per_layer"), "{:.0f}"),
                    f"{mib(r.get('allocator_peak'))}/{mib(r.get('budget'))}",
                    f"{f(r.get('tok_s'), '{:.1f}')}/{f(r.get('predicted_tok_s'), '{:.1f}')}",
                    f"{f(ex.get('tok_s_full'), '{:.2f}')} ({f(ex.get('decode_tok_s_full'), '{:.2f}')})", published))
    width = [max(len(x[i]) for x in [head, *out]) for i in range(len(head))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(x, width)).rstrip() for x in [head, *out])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--capped"]:  # internal: `--capped BYTES ARGS...` is klotski ARGS under the cap
        return capped_cli(int(argv[1]), argv[2:])
    if argv[:1] == ["--kernels-child"]:  # internal: `--kernels-child SPEC`
        return kernels_child(Path(argv[1]))
    a = parse_args(argv)
    import torch
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu_run = a.device == "cuda"
    a.layers = a.layers or (4 if gpu_run else 2)
    a.shrink = a.shrink or (1 if gpu_run else 16)
    a.prompts = a.prompts or (512 if gpu_run else 16)
    keys = [k.strip() for k in (a.rows or ",".join(ROWS)).split(",") if k.strip()]
    if bad := [k for k in keys if k not in ROWS]:
        sys.exit(f"gpu_realdims.py: unknown rows {bad}; choose from {','.join(ROWS)}")
    a.out = a.out or HERE / "results" / f"gpu-realdims-{a.device}.json"
    a.work_dir.mkdir(parents=True, exist_ok=True)
    t0, a.results = time.perf_counter(), []
    hard_end = t0 + a.deadline + 30  # a row started before the deadline gets until here
    rc, _, last = gpu.sh([sys.executable, "-c", gpu.PINNED, a.device], a.work_dir / "pinned.log", 120)
    pinned = json.loads(last) if rc == 0 and last.startswith("{") else {"gb_per_s": None, "error": last}
    a.pinned_gbps = pinned["gb_per_s"]
    print(f"device {a.device} ({pinned.get('gpu') or 'cpu'}), pinned host->device copy {a.pinned_gbps} GB/s; "
          f"link held to {a.link_gbps} GB/s; {a.layers} layers, widths / {a.shrink}; {a.prompts} prompts of "
          f"{a.prompt_tokens} tokens, {a.max_new_tokens} new; deadline {a.deadline:.0f} s", flush=True)
    shapes, not_run = {}, []
    for key in keys:
        if any(r["row"] == key for r in a.results):
            continue  # run already, ahead of a row that needed its choices
        if time.perf_counter() - t0 > a.deadline:
            not_run.append(key)
            continue
        row = run_row(a, shapes, key, max(10.0, min(a.row_timeout, hard_end - time.perf_counter())))
        a.results.append(row)
        done = (f"{row.get('kernels_per_layer')} kernels per layer" if key.endswith(":kernels")
                else f"{row.get('tok_s')} tok/s") + f", bs {row.get('bs')} x n {row.get('n')}"
        print(f"{key}: " + (done if row.get("ok")
                            else f"failed: {row.get('error')}") + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    by_key = {r["row"]: r for r in a.results}
    goals = targets(by_key)
    print(table(a.results))
    for r in a.results:
        if r.get("first_try"):
            print(f"(*) {r['row']}: first try failed ({r['first_try']['error'][:200]}); {r['first_try']['then']}")
    for g in goals:
        print(f"target {g['target']}: {g['value']} -> " + {True: "met", False: "NOT met", None: "not measured"}[g["met"]])
    if not_run:
        print(f"not run (deadline {a.deadline:.0f} s): {', '.join(not_run)}")
    result = {"command": shlex.join([sys.executable, *sys.argv]), "device": a.device, "gpu": pinned.get("gpu"),
              "torch": pinned.get("torch"), "machine": machine_info(), "pinned_copy": pinned,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                           if k != "results"},
              "card": CARD, "shapes": {n: {"bytes": s.bytes, "budget": s.budget, "allocator_cap": s.cap,
                                           "dir": str(s.dir), "build_s": s.build_s, "bs": s.bs, "n": s.n}
                                       for n, s in shapes.items()},
              "rows": a.results, "not_run": not_run, "targets": goals,
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"elapsed {result['elapsed_s']} s; wrote {a.out}")
    return 0 if all(r.get("ok") for r in a.results) else 1


if __name__ == "__main__":
    sys.exit(main())
