"""`klotski serve`: how long an online request waits while a large Batch API batch runs.

    python benchmarks/serve_latency.py [--model tiny-mixtral] [--lines 1000] [--reps 3]

Starts `klotski serve` on a free port (its own data dir in a temp directory), warms it, then
times (the official `openai` client, greedy): a 2-token chat request alone (median of
`--reps`), a 64-token one alone; then submits a batch of `--lines` chat lines (16 tokens
each) and, once it is writing answers, the same requests again, a streamed one (time to its
first content chunk and to its end), noting whether the batch was still running when each
answered. The batch's report gives one decode step's time (decode seconds / decode steps).
Writes benchmarks/results/serve_latency.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_concurrency import health, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def chat(client, model, tokens, topic="Paris", stream=False):
    """Seconds to the answer (and, streamed, to its first content chunk)."""
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": f"Tell me about {topic}"}]
    if not stream:
        client.chat.completions.create(model=model, messages=messages, max_tokens=tokens)
        return time.perf_counter() - t0, None
    first = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, stream=True):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    out: dict = {"model": a.model, "lines": a.lines}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        proc, url = start_server(data, a.model, "--device", a.device, "--max-new-tokens", "64")
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
            model = client.models.list().data[0].id
            chat(client, model, 4)  # warm
            out["short_alone_s"] = statistics.median(chat(client, model, 2)[0] for _ in range(a.reps))
            out["long_alone_s"] = chat(client, model, 64)[0]
            lines = Path(tmp) / "batch.jsonl"
            lines.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                                 "body": {"model": model, "max_tokens": 16, "messages": [
                                                     {"role": "user", "content": f"Tell me about topic {i}"}]}}) + "\n"
                                     for i in range(a.lines)))
            f = client.files.create(file=lines.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            t_batch = time.perf_counter()
            run = data / "batches" / batch.id / "run.jsonl"
            while not (run.exists() and run.stat().st_size):
                time.sleep(0.05)

            def running() -> bool:
                return client.batches.retrieve(batch.id).status == "in_progress"
            shorts = []
            for _ in range(a.reps):
                shorts.append(chat(client, model, 2)[0])
            out["short_during_batch_s"] = statistics.median(shorts)
            out["short_during_batch_all_s"] = shorts
            out["batch_running_after_short"] = running()
            out["long_during_batch_s"] = chat(client, model, 64)[0]
            out["batch_running_after_long"] = running()
            total, first = chat(client, model, 16, stream=True)
            out["stream_during_batch_s"], out["stream_first_token_s"] = total, first
            out["batch_running_after_stream"] = running()
            out["online"] = health(url)["online"]
            while client.batches.retrieve(batch.id).status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.5)
            out["batch_s"] = time.perf_counter() - t_batch
            report = json.loads((data / "batches" / batch.id / "report.json").read_text())
            steps = report.get("decode_steps") or 0
            out["decode_step_s"] = report["decode_s"] / steps if steps else None
            out["report_prefix"] = report.get("prefix_cache", {}).get("status")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    bound = 2 * out["short_alone_s"] + (out["decode_step_s"] or 0)
    out["short_bound_s"] = bound
    print(json.dumps(out, indent=1))
    print(f"short request: {out['short_during_batch_s']:.3f} s during the batch vs {out['short_alone_s']:.3f} s alone "
          f"(bound 2x + one decode step = {bound:.3f} s); 64 tokens: {out['long_during_batch_s']:.2f} s, batch still "
          f"running: {out['batch_running_after_long']}; streamed first token {out['stream_first_token_s']}")
    dest = ROOT / "benchmarks" / "results" / "serve_latency.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
