"""What the routes depend on: the server's shared state (`Served`), the API key check
(`authorized`), and the one error shape, OpenAI's `{"error": {"message", "type", "param",
"code"}}` (`error`, raised from a route as `Problem`)."""
from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from klotski.serve.store import Store


@dataclass
class Served:
    """What the routes share: the store, the engine's inbox and the server's settings."""
    store: Store
    names: tuple[str, ...]       # the model's names as clients send them; the first is the one answers carry
    config: object               # the run's RunConfig
    tokenizer: object
    spec: object
    inbox: object
    stats: object                # () -> the online requests' OnlineStats (a snapshot)
    worker: object               # the engine's thread (alive, or the server cannot answer online requests)
    api_key: str | None
    max_upload: int
    max_body: int
    batch_window_s: int
    started: int = field(default_factory=lambda: int(time.time()))
    tok_lock: threading.Lock = field(default_factory=threading.Lock)  # the HTTP threads' one tokenizer
    detokenizer: object = None   # the streams' own tokenizer (decoding, in the thread pool, only reads it)


def error(status: int, message: str, code: str | None = None, param: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"  # (OpenAI's, a 401 and a 429 too)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Problem(Exception):
    """An error reply raised from inside a route."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.reply = error(status, message, code, param, headers)


def served(request: Request) -> Served:
    """The routes' dependency on the server's shared state."""
    return request.app.state.served


def authorized(request: Request) -> None:
    """The routers' dependency: the API key, where the server has one."""
    key = request.app.state.served.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Problem(401, "missing API key: send the header 'Authorization: Bearer KEY'", "missing_api_key")
    if not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise Problem(401, "incorrect API key", "invalid_api_key")


LOOP_JSON = 64 * 1024  # a body larger than this is parsed in the thread pool, not on the event loop


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if len(raw) <= LOOP_JSON else await run_in_threadpool(json.loads, raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Problem(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
    if not isinstance(body, dict):
        raise Problem(400, "the request body must be a JSON object", "invalid_json")
    return body
