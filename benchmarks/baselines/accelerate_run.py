"""The "Accelerate" baseline: a job file through transformers + accelerate offloading.

Run as its own process by the bench driver:

    python benchmarks/baselines/accelerate_run.py --model DIR --jobs JOBS.jsonl \\
        --out OUT.jsonl --report REPORT.json --batch-size B --max-new-tokens N \\
        --max-memory-device SIZE --max-memory-cpu SIZE --offload-folder DIR [--dtype float32]

    ... --find-max-batch [--batch-cap 64]   # largest batch within the budget (max_batch.py)

What this is on a machine without a GPU (read from accelerate 1.15 / transformers 5.23
sources and checked by experiment on the `tiny` and `medium` presets):

* `from_pretrained(device_map="auto", max_memory={"cpu": D}, offload_folder=F)` plans with
  `infer_auto_device_map`: modules are given to "cpu" in order while they fit in D, the
  rest to "disk". The planner keeps room in D for the largest offloaded layer, so with
  a 2 MB budget on the 3.6 MB tiny model only the embeddings and layer 0 stay on "cpu"
  (`{'model.embed_tokens': 'cpu', 'model.layers.0': 'cpu', 'model.layers.1': 'disk',
  ..., 'lm_head': 'disk'}`), and medium at 900MB keeps 0.55 GB (embeddings, layers 0-2);
  at 4 MB tiny fits, no hooks are attached and the model is plain transformers. Only
  weights are planned: activations and the KV cache are
  not, which is why `--find-max-batch` measures RSS instead of trusting D.
* `dispatch_model` picks the execution device from the non-cpu/disk entries; there are
  none, so it is "cpu". With main device "cpu" only "disk" counts as offloaded: "cpu"
  modules keep ordinary CPU tensors under a no-op `AlignDevicesHook(offload=False)`,
  "disk" modules get `AlignDevicesHook(offload=True)` whose `pre_forward` fetches every
  weight of the module through `OffloadedWeightsLoader.__getitem__` and whose
  `post_forward` sets it back to meta. Counted on tiny at 2 MB: 29 tensor fetches
  (2.6 MB) per forward, i.e. every disk weight, every decode step, and for an MoE layer
  all experts, not just the routed ones.
* A fetch is `safe_open(file).get_tensor(name)`, which in safetensors 0.8 returns a
  private copy-on-write memory map, not a copy: pages are faulted in from the page
  cache (or the SSD) when the matmul touches them and unmapped at post_forward (336 MB
  of fetched experts: +0 MB RSS until touched, +335 MB file-backed RSS after). Only a
  `--dtype` different from the file's adds an anonymous converted copy per fetch.
* Where the disk weights come from: tensors used as-is (attention, norms, lm_head) are
  read in place from the checkpoint's safetensors; Mixtral's experts are fused at load
  time by transformers' weight converter (w1/w3/w2 -> gate_up_proj/down_proj), so those
  are re-saved to `offload_folder` as one safetensors file per tensor during loading
  (counted in load_s, not in tokens/s). Hence the offload folder holds expert files only.
* The "cpu" part is not all private memory either: tensors used as-is stay views of
  the checkpoint's memory map (checked by data_ptr on `medium` at 900MB: embeddings and
  attention mmap-backed, fused experts anonymous), and after loading the whole
  checkpoint is mapped and touched (medium: 1.35 GB file-backed RSS, 0.55 GB of weights
  resident). RSS therefore over-states private memory; budget_used_bytes below
  subtracts the loaded process and charges the resident weights by their size.
* So the mapping of the paper's tiers is: device memory = the part kept as CPU tensors
  (`max_memory={"cpu": device budget}`), compute = CPU, and the host->device link
  becomes a synchronous memory-mapped read of every disk module at every forward. accelerate has no separate
  host tier on a CPU-only box (its "cpu" offload tier exists only when the execution
  device is an accelerator), so `--max-memory-cpu` cannot be handed to it; it is
  recorded and used as the rest of the RSS ceiling in `--find-max-batch`. When the
  model fits in RAM the "disk" reads are served by the page cache, which then plays the
  host tier for free (its pages count as RSS only while their module runs); bigger
  than RAM, they really hit the SSD.
* Link emulation: Klotski's `--emulate-link` throttles host->device copies; accelerate
  has no throttle, and its only transfer here is the disk fetch inside the hook. It
  could be emulated only by monkeypatching `OffloadedWeightsLoader.__getitem__` to sleep
  per byte, which would no longer be the stock system users have, so this script does not.

Reported like Klotski's `--report`: tokens/s = generated tokens / (prefill + decode
time), model loading excluded. Generated tokens are counted as Klotski counts them
(every token picked for a live sequence, EOS included); the padding steps HF still runs
for rows that already stopped are not counted, but their time is.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import sys
import time
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    ap.add_argument("--jobs", required=True, help="job file, one JSON object per line")
    ap.add_argument("--out", help="output JSONL (required unless --find-max-batch)")
    ap.add_argument("--report", help="report JSON")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="default for jobs without one")
    ap.add_argument("--max-memory-device", required=True,
                    help="weights kept resident as CPU tensors, e.g. 900MB (accelerate's max_memory['cpu'])")
    ap.add_argument("--max-memory-cpu", required=True,
                    help="host budget; no accelerate counterpart on CPU-only, used in the RSS ceiling")
    ap.add_argument("--offload-folder", required=True, help="accelerate's offload_folder")
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="compute dtype (auto = checkpoint's)")
    ap.add_argument("--threads", type=int,
                    help="torch intra-op threads (default: torch's). With a busy neighbour on a 2-core box, "
                         "all-core OpenMP can run 100x slower; pin it the same for every system")
    ap.add_argument("--max-batches", type=int, help="stop after this many batches (longest prompts first)")
    ap.add_argument("--find-max-batch", action="store_true",
                    help="search the largest batch size whose peak RSS stays within the budget")
    ap.add_argument("--batch-cap", type=int, default=64, help="largest batch --find-max-batch tries")
    ap.add_argument("--batch-candidates", help="comma list replacing powers of two, e.g. 4,8,12,16")
    a = ap.parse_args(argv)
    if not a.find_max_batch and not a.out:
        ap.error("--out is required unless --find-max-batch")
    if a.batch_size < 1 or a.max_new_tokens < 1:
        ap.error("--batch-size and --max-new-tokens must be at least 1")
    return a


# --------------------------------------------------------------------------- memory

def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def current_rss() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss()


def peak_rss() -> int:
    """The process's RSS high-water mark. VmHWM, not getrusage's ru_maxrss: the latter also
    keeps the peak recorded when any thread exited, which clear_refs does not reset, so a
    loader thread ending after the reset made generation's "peak" loading's (a flaky bench)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is KiB on Linux (bytes on macOS; this benchmark targets Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's RSS high-water mark, so generation's peak is not hidden by loading's.

    Writing 5 to clear_refs resets VmHWM (and with it ru_maxrss) on Linux >= 4.0.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------- jobs

def load_jobs(path, tokenizer, default_max_new: int, context: int):
    """Job file -> (work items, error records); same validation and ids as Klotski's reader."""
    from klotski.io.jobs import read_jobs
    from klotski.io.requests import LineError, prompt_too_long

    requests, bad = read_jobs(path)
    items, errors = [], [e.record() for e in bad]
    for r in requests:
        if r.messages is not None:
            ids = list(tokenizer.apply_chat_template(r.chat_messages(), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"])
        else:
            ids = list(tokenizer(r.prompt)["input_ids"])
        if not ids:
            errors.append(LineError(r.id, r.line, "prompt is empty after tokenization").record())
            continue
        if len(ids) >= context:
            errors.append(prompt_too_long(r, len(ids), context).record())
            continue
        # Clamped to the context like Klotski, so both stop at the same length.
        max_new = min(r.max_new_tokens or default_max_new, context - len(ids))
        items.append({"id": r.id, "ids": ids, "max_new": max_new})
    return items, errors


def make_batches(items: list[dict], batch_size: int) -> list[list[dict]]:
    # Klotski's order: stable sort, longest prompt first, so batches hold the same prompts.
    order = sorted(items, key=lambda it: -len(it["ids"]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# --------------------------------------------------------------------------- model

def load_model(model_dir, device_bytes: int, offload_folder, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    Path(offload_folder).mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, device_map="auto", max_memory={"cpu": device_bytes},
        offload_folder=str(offload_folder), dtype=torch_dtype)
    return model.eval()


def device_map_summary(model) -> dict:
    """Module entries and parameter bytes per device ("cpu" resident, "disk" offloaded)."""
    dmap = getattr(model, "hf_device_map", None) or {"": "cpu"}  # no map: everything fit
    keys = sorted(dmap, key=len, reverse=True)

    def device_of(name: str) -> str:
        for k in keys:
            if k == "" or name == k or name.startswith(k + "."):
                return str(dmap[k])
        return "cpu"

    nbytes = collections.Counter()
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights are stored once
            continue
        seen.add(id(p))
        nbytes[device_of(name)] += p.numel() * p.element_size()
    return {"modules": dict(collections.Counter(str(v) for v in dmap.values())),
            "param_bytes": dict(nbytes), "device_map": {k: str(v) for k, v in dmap.items()}}


def _folder_bytes(folder) -> tuple[int, int]:
    files = [f for f in Path(folder).rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


# --------------------------------------------------------------------------- generation

class StepClock:
    """A pass-through logits processor: HF calls it once per step, right after the forward.

    Its first call in a generate() marks the end of prefill, which gives time to first
    token without a second run.
    """

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def generate_batch(model, tokenizer, batch: list[dict], pad_id: int, eos: set[int]):
    """Greedy-generate one batch; return (records, generated tokens, prefill s, total s).

    The tokenizer pads on the left, so every row's last prompt token is at the same position.
    """
    import torch
    from transformers import LogitsProcessorList

    enc = tokenizer.pad([{"input_ids": it["ids"]} for it in batch], padding=True, return_tensors="pt")
    width = enc["input_ids"].shape[1]
    clock = StepClock()
    # One generate per batch, so rows share the longest limit; shorter limits are cut below.
    max_new = max(it["max_new"] for it in batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
    total = time.perf_counter() - t0
    records, generated = [], 0
    for it, row in zip(batch, out[:, width:].tolist()):
        ids, reason = [], "length"
        for t in row[: it["max_new"]]:
            generated += 1
            if t in eos:
                reason = "stop"
                break
            ids.append(t)
        records.append({"id": it["id"], "completion": tokenizer.decode(ids, skip_special_tokens=True),
                        "finish_reason": reason, "prompt_tokens": len(it["ids"]),
                        "completion_tokens": len(ids), "token_ids": ids})
    return records, generated, (clock.first or t0 + total) - t0, total


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def run(a) -> dict:
    from klotski.config import parse_size

    t_start = time.perf_counter()
    import torch  # the runtime's fixed cost belongs to the baseline RSS
    import transformers
    from transformers import AutoTokenizer
    import accelerate

    if a.threads:
        torch.set_num_threads(a.threads)
    device_bytes, cpu_bytes = parse_size(a.max_memory_device), parse_size(a.max_memory_cpu)
    baseline_rss = current_rss()

    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    t_load = time.perf_counter()
    model = load_model(a.model, device_bytes, a.offload_folder, a.dtype)
    load_s = time.perf_counter() - t_load
    peak_load, rss_loaded = peak_rss(), current_rss()
    hwm_reset = reset_peak_rss()

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    eos = _eos_ids(model, tokenizer)
    context = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    items, errors = load_jobs(a.jobs, tokenizer, a.max_new_tokens, context)
    batches = make_batches(items, a.batch_size)[: a.max_batches]

    generated, generate_s, prefill_s, ttft = 0, 0.0, 0.0, None
    prompt_tokens = 0
    with open(a.out, "w") as out:
        for rec in errors:
            out.write(json.dumps(rec) + "\n")
        for batch in batches:
            records, n, pre, total = generate_batch(model, tokenizer, batch, pad_id, eos)
            ttft = pre if ttft is None else ttft
            generated, generate_s, prefill_s = generated + n, generate_s + total, prefill_s + pre
            prompt_tokens += sum(r["prompt_tokens"] for r in records)
            for rec in records:
                out.write(json.dumps(rec) + "\n")
            out.flush()
    peak_gen = peak_rss()
    files, folder_bytes = _folder_bytes(a.offload_folder)
    placement = device_map_summary(model)
    resident = placement["param_bytes"].get("cpu", 0)
    return {
        "system": "accelerate",
        "tokens_per_s": round(generated / generate_s, 3) if generate_s else 0.0,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "generate_s": round(generate_s, 4),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(generate_s - prefill_s, 4),
        "time_to_first_token_s": round(ttft, 4) if ttft is not None else None,
        "load_s": round(load_s, 4),
        "wall_s": round(time.perf_counter() - t_start, 4),
        "peak_rss_bytes": max(peak_load, peak_gen),
        "peak_rss_load_bytes": peak_load,
        # Without the reset this is the whole process's peak again, and says so.
        "peak_rss_generate_bytes": peak_gen,
        "peak_rss_generate_is_phase_only": hwm_reset,
        "rss_after_imports_bytes": baseline_rss,
        "rss_after_load_bytes": rss_loaded,
        "resident_weight_bytes": resident,
        # What the budget is charged in --find-max-batch: weights kept in memory plus
        # everything generation adds on top of the loaded process (activations, KV cache,
        # disk weights fetched for the current module). The rest of RSS is the runtime
        # (interpreter, torch, modeling code, tokenizer), which every system pays.
        "budget_used_bytes": resident + max(0, peak_gen - rss_loaded),
        "requests": {"ok": sum(len(b) for b in batches), "failed": len(errors)},
        "batch_size": a.batch_size,
        "num_batches": len(batches),
        "max_new_tokens": a.max_new_tokens,
        "threads": torch.get_num_threads(),
        "max_memory": {"device": device_bytes, "cpu": cpu_bytes},
        "accelerate_max_memory": {"cpu": device_bytes},
        "device_map_summary": placement,
        "offload_folder": {"path": str(a.offload_folder), "files": files, "bytes": folder_bytes},
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__},
        "model": str(a.model),
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.find_max_batch:
        try:
            from . import max_batch
        except ImportError:  # run as a script: the sibling module is on sys.path[0]
            import max_batch
        result = max_batch.find_max_batch(a)
    else:
        result = run(a)
    text = json.dumps(result, indent=2) + "\n"
    if a.report:
        Path(a.report).parent.mkdir(parents=True, exist_ok=True)
        Path(a.report).write_text(text)
    else:
        sys.stdout.write(text)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
