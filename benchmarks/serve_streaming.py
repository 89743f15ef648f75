"""`klotski serve`: time to first token of a streamed chat request, and a short call after
clients that hung up.

    python benchmarks/serve_streaming.py [--model tiny-mixtral] [--tokens 64] [--reps 3]

Starts `klotski serve` on a free port (its own data dir in a temp directory, `--threads 1`),
warms it with one call, then per repetition times a chat request of `--tokens` greedy tokens
answered whole and the same request streamed (the official `openai` client): the first content
chunk, the last, the number of content chunks, and whether the streamed text equals the whole.
Then four requests of `max_tokens` 1,000 whose clients disconnect after 1 s (raw sockets, not
streaming), and the time of a 2-token call after them against one alone. Prints everything and
the server's /health `online` counters.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_concurrency import health, start_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me about rivers in Europe"}]


def online(url: str) -> dict:
    return health(url)["online"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="klotski-serve-streaming-"))
    proc, url = start_server(data, a.model, "--device", "cpu", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        ask = dict(model=a.model, messages=MESSAGES, max_tokens=a.tokens, temperature=0)
        client.chat.completions.create(**{**ask, "max_tokens": 4})  # warm
        for rep in range(a.reps):
            t = time.perf_counter()
            whole = client.chat.completions.create(**ask)
            whole_s = time.perf_counter() - t
            t, first, chunks, text = time.perf_counter(), None, 0, ""
            for chunk in client.chat.completions.create(**ask, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - t
                    chunks += 1
                    text += chunk.choices[0].delta.content
            print(f"round {rep + 1}: whole {whole_s:.3f}s ({whole.usage.completion_tokens} tokens); streamed: first "
                  f"token {first:.3f}s, last {time.perf_counter() - t:.3f}s, {chunks} content chunks, same text "
                  f"{text == whole.choices[0].message.content}")
        short = dict(model=a.model, messages=MESSAGES, max_tokens=2)
        t = time.perf_counter()
        client.chat.completions.create(**short)
        alone = time.perf_counter() - t
        body = json.dumps({"model": a.model, "messages": MESSAGES, "max_tokens": 1000, "temperature": 0}).encode()
        socks = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(s)
        time.sleep(1.0)
        for s in socks:
            s.close()
        t = time.perf_counter()
        client.chat.completions.create(**short)
        print(f"2-token call alone {alone:.3f}s; after four abandoned 1,000-token requests "
              f"{time.perf_counter() - t:.3f}s")
        print("online:", online(url))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
