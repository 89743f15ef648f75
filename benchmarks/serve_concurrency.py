"""`klotski serve`: the wall time of N concurrent chat completions against one alone.

    python benchmarks/serve_concurrency.py [--model tiny-mixtral] [--calls 16] [--tokens 16] [--reps 3]

Starts `klotski serve` on a free port (its own data dir in a temp directory), warms it with
one call, then per repetition times one call alone and `--calls` calls sent at once from as
many threads (the official `openai` client, distinct prompts, greedy, `--tokens` new tokens
each). Concurrent calls join one engine run (klotski/serve/worker.py), so their wall time
is far below `--calls` times one call's. Prints the medians and the server's /health
counters (engine steps that ran online requests, the most in one step) and writes
benchmarks/results/serve_concurrency.json.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["Paris", "rivers", "music", "Everest", "the sea", "bread", "trains", "winter", "cats", "stars", "gold",
          "rain", "paper", "glass", "salt", "wind"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


def start_server(data: Path, model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """`klotski serve` on a free port with its data in `data` (its log beside it), once /health
    answers: (the process, its URL). Exits with the log if it does not start."""
    port = free_port()
    log = Path(f"{data}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "klotski.cli", "serve", "--model", model, "--port", str(port),
                                 "--data-dir", str(data), *flags], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            health(url)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(log.read_text()) from None
            time.sleep(0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc, url = start_server(Path(tmp) / "data", a.model, "--device", a.device, "--max-new-tokens", str(a.tokens))
        try:
            startup = time.perf_counter() - t0
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
            model = client.models.list().data[0].id

            def call(i: int) -> None:
                topic = TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" {i}")
                r = client.chat.completions.create(model=model, max_tokens=a.tokens, messages=[
                    {"role": "user", "content": f"Tell me about {topic}"}])
                assert r.choices[0].message.content is not None

            call(0)  # warm-up: first-use costs (correlation table, caches) are not timed
            one, many = [], []
            for _ in range(a.reps):
                t = time.perf_counter()
                call(0)
                one.append(time.perf_counter() - t)
                threads = [threading.Thread(target=call, args=(i,)) for i in range(a.calls)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                many.append(time.perf_counter() - t)
            counters = health(url)["online"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    result = {"model": a.model, "calls": a.calls, "tokens": a.tokens, "reps": a.reps, "startup_s": round(startup, 2),
              "one_call_s": round(statistics.median(one), 3), "concurrent_s": round(statistics.median(many), 3),
              "serial_estimate_s": round(a.calls * statistics.median(one), 3), "online": counters}
    result["speedup_vs_serial"] = round(result["serial_estimate_s"] / result["concurrent_s"], 2)
    print(json.dumps(result, indent=1))
    out = ROOT / "benchmarks" / "results" / "serve_concurrency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
