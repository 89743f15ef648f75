"""`klotski serve`: the port taken and the data dir locked first (a taken port is one line
before anything is built), the engine built once, the worker started, then uvicorn until
SIGTERM or Ctrl-C. On SIGTERM uvicorn stops taking connections and lets the requests in
flight finish (up to GRACE_S); then the worker stops at its next step, any online request
still waiting is answered 503, and every batch it had not finished stays on disk, to resume
on the next start."""
from __future__ import annotations

import copy
import dataclasses
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from klotski.assemble import build_engine, setup_run
from klotski.errors import UserError
from klotski.io.checkpoint import Checkpoint
from klotski.serve.batches import Worker
from klotski.serve.faults import Faults
from klotski.serve.store import Store
from klotski.serve.worker import MAX_WAITING, Inbox, log

PLAN_PROMPT_TOKENS = 256  # the prompt length the one engine is planned for; longer ones prefill in chunks
GRACE_S = 5  # on SIGTERM, how long requests in flight may take to finish


@dataclass(frozen=True)
class ServeOptions:
    """The HTTP server's own settings (the run's are the RunConfig; the key is kept out of it,
    since a RunConfig is echoed in every report)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_dir: str = "klotski-serve"
    max_upload: int = 200_000_000
    max_body: int = 16_000_000
    served_names: tuple[str, ...] = ()   # what clients call the model; none: its --model value
    batch_window_s: int = 24 * 3600      # a batch's completion window (OpenAI's 24h; shorter only in tests)
    fault_file: str | None = None        # the test seam in the store's writes (klotski/serve/faults.py)
    max_waiting: int = MAX_WAITING       # online requests waiting for the engine; past it a 429


def serve(config, options: ServeOptions) -> int:
    try:
        import uvicorn

        from klotski.serve.app import make_app
        from klotski.serve.deps import Served
        from klotski.serve.routes import start_validation
    except ImportError as e:
        raise UserError(f"klotski serve needs FastAPI, uvicorn, python-multipart and openai ({e.name} is missing): "
                        "pip install 'klotski[serve]'") from None
    if config.adaptive_gating is not None:
        # it calibrates on a run's first group: on a server that would probe live requests and
        # recalibrate with every batch
        raise UserError("--adaptive-gating calibrates on a job's first group; klotski serve does not take it: "
                        "run the job with klotski generate --adaptive-gating")
    o = options
    listener = _listen(o.host, o.port)
    store = engine = None
    try:
        store = Store(Path(o.data_dir), Faults(o.fault_file))
        if o.api_key is None and not _loopback(o.host):
            log(f"warning: serving on {o.host} without an API key: anyone who reaches the port can use it; "
                "set KLOTSKI_API_KEY or --api-key-file")
        ckpt = Checkpoint.open(config.model, direct_io=config.direct_io)
        planned = _planned(ckpt, config)
        # every row gets the slots planned for, so a request within them joins whatever runs
        setup = dataclasses.replace(setup_run(config, ckpt, planned).for_later_prompts(),
                                    row_slots=len(planned[0].prompt_ids) + planned[0].max_new_tokens)
        engine = build_engine(config, ckpt, setup)
        names = o.served_names or (config.model,)
        inbox = Inbox(engine, o.max_waiting)
        worker = Worker(store, config, engine, setup, inbox, names)
        state = Served(store=store, names=names, config=config, tokenizer=copy.deepcopy(ckpt.tokenizer),
                       detokenizer=copy.deepcopy(ckpt.tokenizer), spec=ckpt.spec, inbox=inbox,
                       stats=engine.waiting.online_stats, worker=worker,
                       api_key=o.api_key, max_upload=o.max_upload, max_body=o.max_body,
                       batch_window_s=o.batch_window_s)
        app = make_app(state)
        for batch in store.unfinished():  # accepted before a stop: validate and resume them
            if batch["status"] == "validating":
                start_validation(state, batch["id"])
        resumed = [b["id"] for b in store.unfinished()]
        worker.start()
        log(f"serving {config.model} as {', '.join(names)} on http://{o.host}:{o.port} (data in {store.root}"
            + (f"; resuming {len(resumed)} batches" if resumed else "") + ")")
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE_S))
        try:
            server.run(sockets=[listener])  # (uvicorn raises SIGTERM again once shut down: the finally still runs)
        finally:
            log("stopping: unfinished batches resume on the next start")
            worker.stop()  # at its next step: the engine is closed only once nothing runs on it
            worker.join()
        return 0
    finally:
        listener.close()
        if engine is not None:
            engine.close()
        if store is not None:
            store.close()


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, taken before anything is built: a taken port is one line at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UserError(f"--host {host}: not an address to listen on ({e.strerror or e}); "
                        "use 127.0.0.1, 0.0.0.0 or an address of this machine") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}: in use, or not an address of this "
                        "machine); choose another --port or --host") from None
    return sock


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _planned(ckpt, config) -> list:
    """What the engine is planned for, before any request is known: a window (--window) of
    prompts of PLAN_PROMPT_TOKENS (or what the context leaves) answered up to --max-new-tokens."""
    ctx = ckpt.spec.max_position_embeddings
    new = min(config.max_new_tokens, ctx // 2)
    prompt = max(1, min(PLAN_PROMPT_TOKENS, ctx - new - 1))
    return [SimpleNamespace(prompt_ids=[0] * prompt, max_new_tokens=new, temperature=config.temperature,
                            top_p=config.top_p, stop=(), sample=0)] * config.window
