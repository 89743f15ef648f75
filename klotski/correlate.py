"""The expert-correlation table of a checkpoint: where it lives, loading it, and learning it.

There is no hidden warm-up run. A run with `--prefetch correlation` loads the table of its
checkpoint from the user cache (keyed by the checkpoint's fingerprint), or starts from an
empty one; either way every gate decision of the job updates it online, and it is saved
back atomically after every batch group, so the next run starts warm and a killed run
loses nothing it had learned. `klotski correlate` fills it ahead of a big job, from the
bundled corpus or a job file, with one engine under the same budgets as `generate`.
"""
from __future__ import annotations

import json
import re
import sys
from importlib import resources
from pathlib import Path

from klotski import cachedir
from klotski.prefetch import CorrelationPredictor, CorrelationTable


def table_path(ckpt) -> Path:
    return cachedir.correlation_table(ckpt.key)


def load_table(ckpt) -> CorrelationTable | None:
    """The saved table of `ckpt`, or None when there is none or it does not fit the model."""
    path = table_path(ckpt)
    if not path.exists():
        return None
    try:
        return CorrelationTable.load(path, ckpt.spec)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"klotski: ignoring the expert-correlation table {path} ({e}); learning a new one",
              file=sys.stderr)
        return None


def learning_predictor(ckpt) -> CorrelationPredictor:
    """A correlation predictor that starts from the saved table (or an empty one) and saves
    what it learns back to the cache after every group."""
    spec = ckpt.spec
    table = load_table(ckpt)
    if table is None:
        table = CorrelationTable(spec.num_layers, spec.num_experts, spec.top_k)
        print(f"klotski: no expert-correlation table for this model yet; learning it from this job "
              f"(saved to {table_path(ckpt)})", file=sys.stderr)
    return CorrelationPredictor(table, save_to=(table_path(ckpt), ckpt.key))


def warmup_prompts(count: int = 32, words: int = 48) -> list[str]:
    """Encyclopedic passages from the bundled corpus, so no job file or network is needed."""
    text = resources.files("klotski").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 8]
    return [" ".join(p.split()[:words]) for p in paragraphs[:count]]
