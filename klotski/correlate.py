"""Building and finding the expert-correlation table (`klotski correlate`).

The table is made by a warm-up run (paper §8: small batches, so counts stay small enough
for online updates to matter) and stored as versioned JSON in the user cache, keyed by the
checkpoint's identity (config + tensor layout), so every model gets its own table and a
changed checkpoint gets a new one.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from importlib import resources
from pathlib import Path

from klotski.prefetch import CorrelationPredictor, CorrelationTable


def model_key(model_dir: Path, store) -> str:
    """Identity of a checkpoint: its config and every tensor's name, shape and dtype."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for name in sorted(store.entries):
        e = store.entries[name]
        h.update(f"{name}:{e.shape}:{e.dtype}".encode())
    return h.hexdigest()[:16]


def default_table_path(model_dir: Path, store) -> Path:
    from klotski.tiny import default_cache_dir
    return default_cache_dir() / "correlation" / f"{model_key(model_dir, store)}.json"


def warmup_prompts(count: int = 32, words: int = 48) -> list[str]:
    """Encyclopedic passages from the bundled corpus, so no job file or network is needed."""
    text = resources.files("klotski").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 8]
    return [" ".join(p.split()[:words]) for p in paragraphs[:count]]


def build_table(config, prompts: list[str], out: Path, *, path: int = 1, batch_size: int = 8,
                max_new_tokens: int = 16) -> CorrelationTable:
    """Run `prompts` through the engine, record every gate decision, save the table."""
    from klotski.engine import Engine
    from klotski.jobs import Request

    # One group of all the prompts: each weight pass serves all of them, which matters when
    # the model streams from disk (a bigger-than-RAM model pays one disk read per step).
    batches = -(-len(prompts) // batch_size)
    probe = Engine(config.replace(batch_size=batch_size, num_batches=batches, progress=False, trace=None))
    spec = probe.spec
    table = CorrelationTable(spec.num_layers, spec.num_experts, spec.top_k, path=path)
    engine = Engine(probe.config, predictor=CorrelationPredictor(table))
    probe.close()
    requests = [Request(id=str(i), line=i + 1, prompt=p, messages=None, max_new_tokens=max_new_tokens)
                for i, p in enumerate(prompts)]
    seqs, _ = engine.prepare(requests)
    for _ in engine.run(seqs):
        pass
    engine.close()
    table.save(Path(out), model_key(engine.model_dir, engine.store))
    return table


def load_or_build(engine) -> CorrelationTable:
    """The table for `engine`'s model: load it, or build it on first use (said on stderr)."""
    path = default_table_path(engine.model_dir, engine.store)
    if not path.exists():
        print(f"klotski: building the expert-correlation table for this model (first use) -> {path}",
              file=sys.stderr)
        build_table(engine.config, warmup_prompts(), path)
    try:
        return CorrelationTable.load(path, engine.spec)
    except (ValueError, KeyError, json.JSONDecodeError):
        print(f"klotski: {path} is unreadable or stale; rebuilding it", file=sys.stderr)
        build_table(engine.config, warmup_prompts(), path)
        return CorrelationTable.load(path, engine.spec)
