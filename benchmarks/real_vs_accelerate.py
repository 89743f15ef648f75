"""Klotski vs transformers + accelerate offloading on a trained model (`smollm2-moe`, fp32).

One benchmark row: the same job (the first `--prompts` chat prompts of real_quality.py,
"Summarize this passage in one short sentence.\\n\\n<passage>", `--new-tokens` each, one
batch of `--batch-size`) through

* `klotski generate --dtype float32 --device-memory D --host-memory H --emulate-link L`
  (default D = 900MiB, about a third of the 2.77 GB checkpoint; L = 16 GB/s, a PCIe-4-x16-ish
  host->device figure; weights read through the page cache, `--no-direct-io`), and
* benchmarks/baselines/accelerate_run.py (`from_pretrained(device_map="auto",
  max_memory={"cpu": D}, offload_folder=...)`, `--dtype float32`).

Each system runs in its own process (bench_runner.run_process), warm-up of each first, then
`--reps` alternating repetitions (K, A, K, A); tokens/s is the median over the repetitions
(generated tokens / (prefill + decode), model loading excluded, as both reports define it).

Caveats, from accelerate_run.py's docstring: on this CPU-only machine accelerate's
"device" budget is the weights it keeps as ordinary CPU tensors (max_memory={"cpu": D});
everything else is "disk" and memory-mapped from the checkpoint / offload folder, every
module at every forward (all 8 experts of a layer, not just the routed ones), served by
the page cache here since the model fits in RAM. accelerate has no link throttle, so
`--emulate-link` slows only Klotski's host->device copies: the comparison is, if
anything, tilted toward accelerate. `--host-memory` has no accelerate counterpart and is
only recorded. All processes run with `--threads` intra-op threads (default 1).

    XDG_CACHE_HOME=/tmp/smolcache .venv/bin/python benchmarks/real_vs_accelerate.py \\
        --json benchmarks/results/real-vs-accelerate.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import (accelerate_cmd, accelerate_row, child_env, code_state, klotski_cmd,  # noqa: E402
                          klotski_row, machine_info, read_report, run_process, tail)
from real_quality import MODEL, read_tokens, write_chat_jobs  # noqa: E402


def compare(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    ids = sorted(a)
    diff = [i for i in ids if a[i] != b.get(i)]
    return {"identical_sequences": len(ids) - len(diff), "prompts": len(ids), "differing_ids": diff}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device-memory", default="900MiB")
    ap.add_argument("--host-memory", default="8GiB")
    ap.add_argument("--link", type=float, default=16.0, help="Klotski's --emulate-link, GB/s")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", help="folder for jobs, outputs and logs (default: a temporary one)")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    t_start = time.perf_counter()
    from klotski.builtin.smollm import ensure
    model_dir = ensure(MODEL)  # the built checkpoint; both systems read the same files
    env = child_env(a.threads)
    work = Path(a.work or tempfile.mkdtemp(prefix="real-vs-accelerate-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = write_chat_jobs(a.prompts, a.new_tokens, work / "jobs.jsonl")
    machine = machine_info()

    def run(system: str, tag: str) -> dict:
        out, report, log = (work / f"{system}-{tag}{s}" for s in (".out.jsonl", ".report.json", ".log"))
        if system == "klotski":
            cmd = klotski_cmd(model=model_dir, jobs=jobs, out=out, report=report, schedule="klotski",
                              batch_size=a.batch_size, max_new_tokens=a.new_tokens,
                              device_memory=a.device_memory, host_memory=a.host_memory,
                              link_gbps=a.link) + ["--dtype", "float32"]
        else:
            cmd = accelerate_cmd(model=model_dir, jobs=jobs, out=out, report=report, batch_size=a.batch_size,
                                 max_new_tokens=a.new_tokens, device_memory=a.device_memory,
                                 host_memory=a.host_memory, offload=work / "offload",
                                 threads=a.threads) + ["--dtype", "float32"]
        proc = run_process(cmd, env=env, log=log)
        if proc["returncode"] != 0:
            lines = tail(log).strip().splitlines()
            row = {"error": lines[-1] if lines else f"exit {proc['returncode']}", "log_tail": lines[-15:], **proc}
        else:
            rep = read_report(report)
            row = klotski_row(rep, proc) if system == "klotski" else accelerate_row(rep, proc)
            row["tokens"] = read_tokens(out)
        print(f"{system} {tag}: {row.get('error') or row['tokens_per_s']} tok/s "
              f"({proc['process_wall_s']:.1f} s process)", flush=True)
        return row

    runs = {"klotski": [], "accelerate": []}
    warmup = {s: run(s, "warmup") for s in runs}
    for r in range(a.reps):
        for s in runs:
            runs[s].append(run(s, f"rep{r}"))

    summary = {"model": MODEL, "model_dir": str(model_dir), "dtype": "float32", "prompts": a.prompts,
               "new_tokens": a.new_tokens, "batch_size": a.batch_size, "device_memory": a.device_memory,
               "host_memory": a.host_memory, "klotski_emulate_link_gbps": a.link, "threads": a.threads,
               "reps": a.reps, "systems": {}}
    for s, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        entry = {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                 "warmup": {k: v for k, v in warmup[s].items() if k != "tokens"}}
        if ok:
            entry.update({
                "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in ok), 3),
                "tokens_per_s_all": [r["tokens_per_s"] for r in ok],
                "prefill_s_median": round(statistics.median(r["prefill_s"] for r in ok), 3),
                "decode_s_median": round(statistics.median(r["decode_s"] for r in ok), 3),
                "process_wall_s_median": round(statistics.median(r["process_wall_s"] for r in ok), 1),
                "generated_tokens": ok[0]["generated_tokens"],
                "resident_or_peak_device_bytes": ok[0]["peak_device_bytes"],
                "placement": ok[0]["placement"],
                # repetitions agree with each other (greedy, same job)
                "reps_identical": all(r["tokens"] == ok[0]["tokens"] for r in ok),
            })
        summary["systems"][s] = entry
    k_ok = [r for r in runs["klotski"] if "error" not in r]
    a_ok = [r for r in runs["accelerate"] if "error" not in r]
    if k_ok and a_ok:
        summary["tokens_equal"] = compare(k_ok[0]["tokens"], a_ok[0]["tokens"])
        ks, as_ = summary["systems"]["klotski"], summary["systems"]["accelerate"]
        summary["speedup"] = round(ks["tokens_per_s_median"] / as_["tokens_per_s_median"], 2)
    summary["total_s"] = round(time.perf_counter() - t_start, 1)
    summary["machine"] = machine
    summary["code"] = code_state()

    head = ("| model | job | device budget | link | Klotski tok/s | accelerate tok/s | speedup | same tokens |\n"
            "|---|---|---|---|---|---|---|---|")
    ks, as_ = summary["systems"]["klotski"], summary["systems"]["accelerate"]
    eq = summary.get("tokens_equal")
    same = f"{eq['identical_sequences']}/{eq['prompts']}" if eq else "—"
    row = (f"| {MODEL} fp32 | {a.prompts} chat prompts × {a.new_tokens} tokens, batch {a.batch_size} | "
           f"{a.device_memory} | Klotski {a.link:g} GB/s emulated; accelerate unthrottled | "
           f"{ks.get('tokens_per_s_median', 'failed')} | {as_.get('tokens_per_s_median', 'failed')} | "
           f"{summary.get('speedup', '—')}× | "
           f"{same} |")
    summary["markdown"] = head + "\n" + row
    print(summary["markdown"])
    print(json.dumps({k: summary[k] for k in ("tokens_equal", "speedup", "total_s") if k in summary}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
