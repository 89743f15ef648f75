"""The `klotski` command's flags: one parser for every subcommand, and `config_from_args`,
the one place flags become a RunConfig."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from klotski.config import BATCHINGS, ORDERS, DTYPES, EXPERT_SPLITS, HOST_COMPUTE, OUTPUT_FORMATS, PREFETCH, SCHEDULES, RunConfig, parse_size
from klotski.errors import ConfigError
from planner.shapes import FAMILY_FIELDS


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _num_batches(text: str):
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'auto'") from None


def _add_download_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-download", action="store_true",
                   help="use only what the local Hugging Face cache holds: a hub id or alias missing from it is "
                        "refused instead of downloaded (as HF_HUB_OFFLINE=1 does)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-mixtral",
                   help="checkpoint directory, Hugging Face id or alias (mixtral-8x7b, mixtral-8x22b; "
                        "downloaded into the HF cache when missing there: the files a run reads, with the size "
                        "and free disk checked first), or a built-in model (tiny-mixtral, small-mixtral, "
                        "medium-mixtral; built on first use). Default: tiny-mixtral")
    _add_download_flag(p)
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the planner's choice, else 8)")
    p.add_argument("--num-batches", type=_num_batches, default=None, metavar="N|auto",
                   help="batches per group sharing each loaded weight (default: auto)")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill pass (default: the planner's choice; the whole prompt "
                        "where it fits)")
    p.add_argument("--device-memory", "--gpu-memory", type=_size, metavar="SIZE",
                   help="budget of the compute device, e.g. 20GiB (default: detected)")
    p.add_argument("--host-memory", "--cpu-memory", type=_size, metavar="SIZE",
                   help="budget of host RAM for weights and KV cache (default: detected)")
    p.add_argument("--offload-dir", metavar="DIR", help="directory for re-laid-out or quantized weights")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--schedule", default="klotski", choices=SCHEDULES,
                   help="pipeline schedule; all give identical greedy output (default: klotski)")
    p.add_argument("--batching", default="continuous", choices=BATCHINGS,
                   help="continuous (default): a finished sequence's row takes the next prompt; static: a "
                        "batch keeps its rows until its longest sequence ends (same tokens either way)")
    p.add_argument("--order", default="length", choices=ORDERS,
                   help="how a window's lines wait: length (default: longest first) or routing (in groups of "
                        "n x bs whose prompts pick similar experts at the first MoE layer; same tokens)")
    p.add_argument("--prefetch", default="correlation", choices=PREFETCH,
                   help="how hot experts are predicted (default: correlation); pregate: a map from a "
                        "layer's input to the next layer's router fitted on the run")
    p.add_argument("--prefetch-compare", action="store_true",
                   help="with --prefetch pregate: also run next-gate speculation beside it and report the "
                        "precision and recall of both on the same layer-steps (costs the speculation's time)")
    p.add_argument("--attention", default="full", metavar="full|sink:S,window:W",
                   help="full (exact, default) or StreamingLLM-style: keep each sequence's first S and "
                        "last W tokens of the KV cache")
    p.add_argument("--quantize", default="none", choices=("none", "hqq4", "auto"),
                   help="hqq4: move attention and experts as HQQ 4-bit (g64, scale/zero g128), "
                        "dequantized on the device before use; the copy is made once in --offload-dir. "
                        "auto: the planner weighs each precision and takes 4-bit only where it predicts "
                        ">= 1.3x the exact plan's tokens/s (none, the default: exact)")
    _add_quality_bound_flags(p)
    p.add_argument("--quantize-optimize", action="store_true",
                   help="run HQQ's half-quadratic optimisation (~4%% less error, ~40x slower to quantize)")
    p.add_argument("--emulate-link", type=float, metavar="GBPS", dest="emulate_link_gbps",
                   help="throttle host->device transfers to GBPS GB/s to mimic a PCIe card on a CPU run")
    p.add_argument("--transfer-chunk-ms", type=float, default=RunConfig.transfer_chunk_ms, metavar="MS",
                   help="a speculative prefetch on the link yields to a demand load at its next chunk boundary, "
                        "a chunk being MS ms of the link (default: 0.25 on an emulated link, whole transfers on "
                        "CUDA until measured there; 0: whole transfers, first come first served)")
    p.add_argument("--expert-split", default=RunConfig.expert_split, choices=EXPERT_SPLITS,
                   help="how the device's resident experts are divided among layers: dp (default: by each "
                        "layer's hits in the learned routing, a dynamic program) or even")
    p.add_argument("--adaptive-gating", type=float, nargs="?", const=0.95, metavar="AGREEMENT",
                   help="AdapMoE's adaptive gating (approximate, off by default): a token whose top-1 gate weight "
                        "dominates skips its other experts (fewer loaded and computed), per-layer thresholds "
                        "calibrated on the first group so that at least AGREEMENT (default 0.95) of its greedy "
                        "tokens equal exact top-k's; saved beside the output for a resumed run")
    p.add_argument("--host-attention", default="off", choices=HOST_COMPUTE,
                   help="with the KV cache on the host, compute attention there (q down, output up) instead "
                        "of moving the KV prefix: auto = where the cost model says it finishes sooner")
    p.add_argument("--host-experts", default="off", choices=HOST_COMPUTE,
                   help="compute a cold expert that lives on the host there (tokens down, outputs up) instead "
                        "of moving it: auto = where the cost model says it finishes sooner")
    p.add_argument("--decoded-copies", default=RunConfig.decoded_copies, choices=("auto", "off"),
                   help="on a CPU, keep GGUF experts decoded once in the compute dtype in host RAM (charged to "
                        "--host-memory) where that is faster and fits (auto, the default), or off: decoded per use")
    p.add_argument("--reordered-weights", default=RunConfig.reordered_weights, choices=("auto", "off"),
                   help="on a CPU in bf16, hold the resident SwiGLU experts and projections reordered once for "
                        "oneDNN's products (auto, the default: the same bytes and outputs, fewer passes over them), "
                        "or off: as read")
    p.add_argument("--no-direct-io", action="store_true", help="read weights through the page cache")
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU compute threads (default: the cores no other process is using, looked at again "
                        "every few seconds; a busy core stalls every op split over it; a matmul's last bits depend "
                        "on its thread count)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every line whole, even the prompt prefix a window's lines share (by default "
                        "that prefix is prefilled once and every line starts from it)")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-mixtral",
                   help="alias (mixtral-8x7b, mixtral-8x22b), Hugging Face id (only its config.json is "
                        "downloaded), directory or built-in")
    _add_download_flag(p)
    p.add_argument("--hardware", default="auto",
                   help="auto (measure this machine), rtx3090-pcie4, h800-pcie5, a5000-pcie4-512g or a profile JSON")
    p.add_argument("--device-memory", "--gpu-memory", type=_size, metavar="SIZE")
    p.add_argument("--host-memory", "--cpu-memory", type=_size, metavar="SIZE")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--num-batches", type=_num_batches, default=None, metavar="N|auto")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS")
    p.add_argument("--schedule", default="klotski", choices=SCHEDULES)
    p.add_argument("--quantize", default="none", choices=("none", "hqq4", "auto"),
                   help="the precision to plan (every option is weighed and printed; auto takes 4-bit where it "
                        "predicts >= 1.3x the exact plan's tokens/s)")
    _add_quality_bound_flags(p)
    p.add_argument("--emulate-link", type=float, metavar="GBPS", dest="emulate_link_gbps")
    p.add_argument("--host-attention", default="off", choices=HOST_COMPUTE,
                   help="let the plan compute attention beside a host KV cache (auto: where it is faster)")
    p.add_argument("--host-experts", default="off", choices=HOST_COMPUTE,
                   help="let the plan compute off-device experts where they live (auto: where it is faster)")
    _add_profile_device_flag(p)


def _add_quality_bound_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-logprob-gap", type=float, metavar="NATS", dest="quality_max_gap",
                   help="--quantize auto takes only a precision whose measured mean log-prob gap (nats/token, "
                        "klotski plan shows it and the model it was measured on) is at most NATS")
    p.add_argument("--min-agreement", type=float, metavar="SHARE", dest="quality_min_agreement",
                   help="--quantize auto takes only a precision whose measured greedy agreement with the "
                        "exact model is at least SHARE (e.g. 0.95)")


def _add_profile_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="compute device a measured profile times (default: auto, the GPU where there is one)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """A request's defaults, where its line leaves them open (generate and serve)."""
    p.add_argument("--max-new-tokens", type=int, default=32, help="default per-request limit (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed; each request's stream is derived from "
                                                         "it and the request id, so results do not depend on batching")


API_KEY_ENV = "KLOTSKI_API_KEY"


def api_key(a) -> str | None:
    """`klotski serve`'s key: --api-key, else --api-key-file's first line, else $KLOTSKI_API_KEY."""
    if a.api_key:
        return a.api_key
    if a.api_key_file:
        try:
            key = Path(a.api_key_file).read_text(encoding="utf-8").splitlines()[:1]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {a.api_key_file}: cannot read it ({e}); give a readable file "
                              "whose first line is the key") from None
        if not key or not key[0].strip():
            raise ConfigError(f"--api-key-file {a.api_key_file}: its first line is empty; put the key there")
        return key[0].strip()
    return os.environ.get(API_KEY_ENV) or None


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI Batch API (and chat/completions) over HTTP, durably",
                       description="Serve /v1/files, /v1/batches, /v1/chat/completions, /v1/completions and "
                                   "/v1/models on one engine. Accepted batches survive a crash or a restart: "
                                   "start the server again on the same --data-dir and they resume. A full disk "
                                   "fails the batch it hits with the answers made delivered; /health says "
                                   f"'degraded' until space returns. The key: --api-key, --api-key-file or "
                                   f"${API_KEY_ENV}.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (visible to ps: prefer "
                        f"the {API_KEY_ENV} environment variable or --api-key-file)")
    s.add_argument("--api-key-file", metavar="PATH", help="read the API key from this file (its first line)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the name(s) clients give as 'model' (default: the --model value); answers carry the first")
    s.add_argument("--data-dir", default="klotski-serve", metavar="DIR",
                   help="where files and batches are kept (default: ./klotski-serve)")
    s.add_argument("--max-upload-size", type=_size, default=parse_size("200MB"), metavar="SIZE",
                   help="largest file /v1/files accepts, its form included (default: 200MB)")
    s.add_argument("--max-body-size", type=_size, default=parse_size("16MB"), metavar="SIZE",
                   help="largest body of any other request (default: 16MB)")
    s.add_argument("--max-waiting", type=_positive, default=1024, metavar="REQUESTS",
                   help="online requests that may wait for the engine; past them a request gets 429 with "
                        "Retry-After (default: 1024)")
    # for tests: a batch's window in seconds (OpenAI's is 24h), and the store's write-fault seam
    s.add_argument("--test-batch-window", type=int, default=24 * 3600, help=argparse.SUPPRESS)
    s.add_argument("--fault-file", help=argparse.SUPPRESS)
    _add_sampling_flags(s)
    _add_model_flags(s)
    s.add_argument("--window", type=int, default=RunConfig.window, metavar="LINES",
                   help=f"batch lines read and tokenized together (default: {RunConfig.window})")
    s.set_defaults(no_resume=False, include_token_ids=False, output_format="openai", report=None, trace=None,
                   no_progress=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="klotski",
        description="Offline, throughput-first generation for Mixture-of-Experts models bigger than your GPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for every line of a JSONL job file",
                       description="Generate a completion for every line of JOBS.jsonl and append one JSON "
                                   "line per prompt to the output. Rerunning the same command resumes.")
    g.add_argument("jobs", metavar="JOBS.jsonl")
    g.add_argument("-o", "--output", metavar="OUT.jsonl", help="output file (default: JOBS.out.jsonl)")
    _add_sampling_flags(g)
    _add_model_flags(g)
    g.add_argument("--report", metavar="PATH", help="write the run report as JSON")
    g.add_argument("--trace", metavar="PATH", help="write a Chrome-trace JSON (open in Perfetto)")
    g.add_argument("--time-every", type=int, default=RunConfig.time_every, metavar="N",
                   help="time one step in N of each phase for the report's busy seconds and bubble "
                        f"(default {RunConfig.time_every}; --trace times every step)")
    g.add_argument("--no-resume", action="store_true", help="start the output file afresh")
    g.add_argument("--include-token-ids", action="store_true", help="add token_ids to each output line")
    g.add_argument("--output-format", default="auto", choices=OUTPUT_FORMATS,
                   help="auto (default): each line in its input line's form (OpenAI Batch output for OpenAI "
                        "Batch requests); klotski or openai: every line in that form")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--window", type=int, default=RunConfig.window, metavar="LINES",
                   help="job lines read, tokenized and ordered by length together; memory holds one window "
                        f"whatever the file's length (default: {RunConfig.window})")
    g.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="run on a Ray cluster: one engine per GPU (per node without GPUs) as Ray actors, the job "
                        "sharded over them, one output file; ADDRESS: auto (default: join the running cluster), "
                        "local (start one here) or host:port. Needs: pip install 'klotski[ray]'")
    g.add_argument("--workers", type=int, metavar="N", help="with --ray: number of actors (engines)")
    g.add_argument("--shard", type=int, default=RunConfig.shard, metavar="LINES",
                   help=f"with --ray: job lines handed to an actor at a time, rerun whole if the actor dies "
                        f"(default: {RunConfig.shard})")
    g.add_argument("--prompt-field", default=RunConfig.prompt_field, metavar="COLUMN",
                   help="for a dataset input (.parquet, .csv, .json, .arrow, a save_to_disk directory): the prompt "
                        f"column (default: {RunConfig.prompt_field})")
    g.add_argument("--messages-field", default=RunConfig.messages_field, metavar="COLUMN",
                   help=f"the chat messages column of a dataset input (default: {RunConfig.messages_field})")
    g.add_argument("--id-field", default=RunConfig.id_field, metavar="COLUMN",
                   help=f"the id column of a dataset input; a row without one gets its row number "
                        f"(default: {RunConfig.id_field})")

    _add_serve_parser(sub)

    pl = sub.add_parser("plan", help="choose batch size, n and placement; predict throughput (no weights needed)",
                        description="Plan a run: batch size, batches per group, hot experts, placement per tier, "
                                    "the binding inequality and predicted tokens/s. Works for aliases "
                                    "(mixtral-8x7b, mixtral-8x22b) without their weights.")
    _add_plan_flags(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    sm = sub.add_parser("simulate", help="discrete-event replay of the schedules on a hardware profile")
    _add_plan_flags(sm)
    sm.add_argument("--skew", type=float, default=1.0, help="Zipf skew of synthetic routing (0 = uniform)")
    sm.add_argument("--trace", metavar="PATH", help="write the klotski schedule's Chrome trace")
    sm.add_argument("--json", action="store_true")

    pf = sub.add_parser("profile", help="measure this machine for a model's shapes (cached)")
    pf.add_argument("--model", default="tiny-mixtral")
    _add_download_flag(pf)
    pf.add_argument("--emulate-link", type=float, metavar="GBPS", dest="emulate_link_gbps")
    pf.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    pf.add_argument("--show", action="store_true",
                    help="print each term of the cost model: its factor, where it came from (measured, refitted "
                         "from N runs) and its drift, and how the measure was judged (instead of the JSON)")
    _add_profile_device_flag(pf)

    co = sub.add_parser("correlate", help="build the expert-correlation table from a warm-up run")
    co.add_argument("jobs", nargs="?", metavar="JOBS.jsonl", help="prompts (default: the bundled corpus)")
    co.add_argument("--model", default="tiny-mixtral")
    _add_download_flag(co)
    co.add_argument("-o", "--output", metavar="TABLE.json", help="default: the user cache, where generate looks")
    co.add_argument("--path-length", type=int, default=1, help="layers of expert history per lookup, for exact-path tables (default 1)")
    co.add_argument("--batch-size", type=int, help="default: the planner's choice")
    co.add_argument("--count", type=int, default=64, help="prompts to sample (default 64)")
    co.add_argument("--max-new-tokens", type=int, default=16)
    co.add_argument("--device-memory", "--gpu-memory", type=_size, metavar="SIZE")
    co.add_argument("--host-memory", "--cpu-memory", type=_size, metavar="SIZE")

    q = sub.add_parser("quantize", help="write the HQQ 4-bit copy of a checkpoint (what --quantize hqq4 uses)")
    q.add_argument("--model", default="tiny-mixtral")
    _add_download_flag(q)
    q.add_argument("-o", "--output", metavar="DIR", help="default: the user cache, where generate looks")
    q.add_argument("--optimize", action="store_true", help="HQQ half-quadratic optimisation (slow on CPU)")

    t = sub.add_parser("make-tiny", help="write a deterministic small checkpoint (HF format)")
    t.add_argument("output", metavar="DIR")
    t.add_argument("--preset", default="tiny", help="tiny, small or medium (default: tiny)")
    t.add_argument("--family", default="mixtral", choices=tuple(FAMILY_FIELDS),
                   help="model family; other than mixtral, built with transformers' own classes (random)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    t.add_argument("--fused-experts", action="store_true", help="write transformers-v5 fused expert tensors")
    t.add_argument("--routing", default="uniform", choices=("uniform", "skewed"),
                   help="skewed: Zipf-like expert popularity correlated across layers, like real Mixtral")

    from klotski.bench import driver as bench
    bench.add_parser(sub)

    sh = sub.add_parser("show", help="print some results of an output file beside their prompts")
    sh.add_argument("output", metavar="OUT.jsonl")
    sh.add_argument("--jobs", metavar="JOBS.jsonl", help="the job file, to print each prompt's start")
    sh.add_argument("--count", type=int, default=5, help="records to print (default 5)")

    ck = sub.add_parser("check", help="check a checkpoint: headers, config, tokenizer, NaN/Inf in every tensor",
                        description="Print one line per problem of a checkpoint (exit status 1 if any): "
                                    "safetensors headers, config.json fields, the tokenizer, shapes, and every "
                                    "tensor scanned for NaN and infinite values in pieces within --host-memory.")
    ck.add_argument("--model", default="tiny-mixtral", help="checkpoint directory, alias or built-in model")
    _add_download_flag(ck)
    ck.add_argument("--host-memory", "--cpu-memory", type=_size, metavar="SIZE",
                    help="memory the scan may use (default: 1 GiB)")
    ck.add_argument("--no-progress", action="store_true", help="no progress bar")

    j = sub.add_parser("jobs", help="export example job files")
    j.add_argument("dataset", choices=("wikitext",))
    j.add_argument("-o", "--output", default="wikitext103.jsonl")
    j.add_argument("-n", "--count", type=int, default=256)
    j.add_argument("--seed", type=int, default=0)
    return parser


def config_from_args(a: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model=a.model, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
        seed=a.seed, batch_size=a.batch_size, num_batches=a.num_batches, prefill_chunk=a.prefill_chunk,
        device_memory=a.device_memory,
        host_memory=a.host_memory, offload_dir=a.offload_dir, device=a.device, dtype=a.dtype,
        schedule=a.schedule, batching=a.batching, order=a.order, prefetch=a.prefetch,
        prefetch_compare=getattr(a, "prefetch_compare", False), attention=a.attention, quantize=a.quantize, quantize_optimize=a.quantize_optimize,
        quality_max_gap=a.quality_max_gap, quality_min_agreement=a.quality_min_agreement,
        emulate_link_gbps=a.emulate_link_gbps,
        transfer_chunk_ms=getattr(a, "transfer_chunk_ms", RunConfig.transfer_chunk_ms),
        expert_split=getattr(a, "expert_split", RunConfig.expert_split),
        adaptive_gating=getattr(a, "adaptive_gating", None),
        host_attention=getattr(a, "host_attention", RunConfig.host_attention),
        host_experts=getattr(a, "host_experts", RunConfig.host_experts),
        decoded_copies=getattr(a, "decoded_copies", RunConfig.decoded_copies),
        reordered_weights=getattr(a, "reordered_weights", RunConfig.reordered_weights),
        direct_io=not a.no_direct_io, threads=getattr(a, "threads", None), prefix_cache=not getattr(a, "no_prefix_cache", False), resume=not a.no_resume, include_token_ids=a.include_token_ids,
        output_format=a.output_format,
        report=a.report, trace=a.trace, time_every=getattr(a, "time_every", RunConfig.time_every),
        progress=not a.no_progress,
        window=getattr(a, "window", RunConfig.window), ray=getattr(a, "ray", None),
        workers=getattr(a, "workers", None), shard=getattr(a, "shard", RunConfig.shard),
        prompt_field=getattr(a, "prompt_field", RunConfig.prompt_field),
        messages_field=getattr(a, "messages_field", RunConfig.messages_field),
        id_field=getattr(a, "id_field", RunConfig.id_field))
