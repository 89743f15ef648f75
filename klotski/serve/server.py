"""`klotski serve`: the data dir locked, the engine built once, the worker started, then
uvicorn until SIGTERM or Ctrl-C; then the worker stops at its next step and every batch it
had not finished stays on disk, to resume on the next start."""
from __future__ import annotations

import copy
import threading
from pathlib import Path
from types import SimpleNamespace

from klotski.assemble import build_engine, setup_run
from klotski.errors import UserError
from klotski.io.checkpoint import Checkpoint
from klotski.serve.batches import Worker
from klotski.serve.store import Store
from klotski.serve.worker import Inbox, log

PLAN_PROMPT_TOKENS = 256  # the prompt length the one engine is planned for; longer ones prefill in chunks


def serve(config, *, host: str, port: int, api_key: str | None, data_dir: str, max_upload: int) -> int:
    try:
        import uvicorn

        from klotski.serve.app import make_app
    except ImportError as e:
        raise UserError(f"klotski serve needs FastAPI, uvicorn, python-multipart and openai ({e.name} is missing): "
                        "pip install 'klotski[serve]'") from None
    store = Store(Path(data_dir))
    engine = None
    try:
        ckpt = Checkpoint.open(config.model, direct_io=config.direct_io)
        setup = setup_run(config, ckpt, _planned(ckpt, config)).for_later_prompts()
        engine = build_engine(config, ckpt, setup)
        inbox = Inbox()
        worker = Worker(store, config, engine, setup, inbox)
        app = make_app(store, model=config.model, config=config, tokenizer=copy.deepcopy(ckpt.tokenizer),
                       spec=ckpt.spec, inbox=inbox, stats=worker.feed.online_stats, api_key=api_key,
                       max_upload=max_upload)
        for batch in store.unfinished():  # accepted before a stop: validate and resume them
            if batch["status"] == "validating":
                threading.Thread(target=app.state.validate, args=(batch["id"],), daemon=True).start()
        resumed = [b["id"] for b in store.unfinished()]
        worker.start()
        log(f"serving {config.model} on http://{host}:{port} (data in {store.root}"
            + (f"; resuming {len(resumed)} batches" if resumed else "") + ")")
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        try:
            server.run()  # (uvicorn raises SIGTERM again once it has shut down: the finally below still runs)
        finally:
            log("stopping: unfinished batches resume on the next start")
            worker.stop()  # at its next step: the engine is closed only once nothing runs on it
            worker.join()
        if not server.started:
            raise UserError(f"cannot listen on {host}:{port} (in use, or not an address of this machine); "
                            "choose another --port or --host")
        return 0
    finally:
        if engine is not None:
            engine.close()
        store.close()


def _planned(ckpt, config) -> list:
    """What the engine is planned for, before any request is known: a window (--window) of
    prompts of PLAN_PROMPT_TOKENS (or what the context leaves) answered up to --max-new-tokens."""
    ctx = ckpt.spec.max_position_embeddings
    new = min(config.max_new_tokens, ctx // 2)
    prompt = max(1, min(PLAN_PROMPT_TOKENS, ctx - new - 1))
    return [SimpleNamespace(prompt_ids=[0] * prompt, max_new_tokens=new)] * config.window
