"""The HTTP app: what every request goes through before its route (klotski/serve/routes.py,
klotski/serve/online.py), and the one shape of every error.

* `Guard`, the outermost layer: a body over its limit (--max-body-size; /v1/files
  --max-upload-size and room for the form) is refused with 413 by its Content-Length before a
  byte is read, or at the byte that passes the limit while it streams; an unexpected exception
  is a 500 of one line (its traceback under DIR/crashes/), the server goes on.
* `authorized`, the routers' dependency: 'Authorization: Bearer KEY' (the scheme in any case),
  compared in constant time; /health needs none.
* Every failure, ours or FastAPI's (unknown route, wrong method, a bad query parameter), is
  OpenAI's `{"error": {"message", "type", "param", "code"}}`, `param` naming the one field at
  fault where there is one.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from klotski.serve.deps import Problem, Served, error
from klotski.serve.online import router as online
from klotski.serve.routes import open_router, router
from klotski.serve.worker import log

FORM_ROOM = 64 * 1024  # an upload's form around its file: part headers, the purpose field


class Guard:
    """The body limit and the last word on unexpected exceptions (see the module doc); an
    ASGI layer, so a body is counted as it arrives and never gathered to be measured."""

    def __init__(self, app, served: Served):
        self.app, self.served = app, served

    def limit(self, path: str) -> tuple[int, str]:
        if path == "/v1/files":
            return self.served.max_upload + FORM_ROOM, "--max-upload-size"
        return self.served.max_body, "--max-body-size"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self.limit(scope["path"])
        too_big = (f"the request body is over this server's limit of {limit} bytes ({flag}); "
                   + ("split the file into smaller files" if flag == "--max-upload-size" else "send a smaller request"))
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:  # refused before a byte of it is read
            return await error(413, too_big, "request_too_large")(scope, receive, send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise Problem(413, too_big, "request_too_large")
            return message

        async def sending(message):
            nonlocal started
            started = True
            await send(message)
        try:
            await self.app(scope, counted, sending)
        except Problem as p:  # (raised while a route's body streamed, outside FastAPI's handlers)
            if not started:
                await p.reply(scope, receive, send)
        except Exception as e:  # our bug: one line in the log and the reply; the server goes on
            where = f"{scope.get('method')} {scope['path']}"
            saved = await run_in_threadpool(self.served.store.save_crash, e)  # (a disk write: off the event loop)
            log(f"internal error on {where}: {type(e).__name__}: {e}; {saved}")
            if not started:
                await error(500, f"internal error ({type(e).__name__}: {e}); retry, or tell the server's operator",
                            "internal_error")(scope, receive, send)


def make_app(state: Served) -> FastAPI:
    app = FastAPI(title="klotski serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = state
    app.add_middleware(Guard, served=state)

    @app.exception_handler(Problem)
    async def problem(request, exc: Problem):
        return exc.reply

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        return error(400, f"malformed request: {first.get('msg', 'invalid value')} at {'.'.join(where) or 'the body'}",
                     "invalid_request", ".".join(where) or None)

    @app.exception_handler(HTTPException)
    async def routing(request, exc: HTTPException):
        if exc.status_code == 404:
            return error(404, f"no route {request.method} {request.url.path}; this server has /v1/files, "
                              "/v1/batches, /v1/chat/completions, /v1/completions, /v1/models and /health",
                         "unknown_url")
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     "method_not_allowed" if exc.status_code == 405 else None)

    app.include_router(open_router)
    app.include_router(router)
    app.include_router(online)
    return app
