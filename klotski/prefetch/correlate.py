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
import math
import re
import sys
from importlib import resources
from pathlib import Path

import torch

from klotski.util import cachedir
from klotski.prefetch.cooccurrence import CooccurrenceTable
from klotski.prefetch.predictors import CorrelationPredictor, CorrelationTable, SavedTable

# The exact-path table keeps a row of E counts per expert set it has seen, so it is bounded
# by C(E, k) rows per layer only where C(E, k) is small (Mixtral's 28, 16 experts top-4's
# 1820); beyond that it can gain a row per token per layer with every job, and it is
# rewritten after every group. Measured on 4-layer skewed test models
# (benchmarks/prefetch_fine.py, docs/benchmarks.md): learning cold from 32 prompts, from
# 64 experts top-6 on at most 1 lookup in 5 found the token's set and the two tables'
# hot-expert accuracy was within 0.01, while the exact table had grown to 7.6k-9.4k sets
# (2.6-6.3 MB of JSON) against co-occurrence's fixed E x E per layer (0.06-0.22 MB). Warm
# from 32 other prompts, exact paths did better at 128 top-8 (hot accuracy 0.42 against
# 0.38), from a table of 17.9k sets for 4 layers and still growing. They were clearly
# better at 16 top-4 (0.65 against 0.57), which stays below this limit, and at 32 top-4
# (0.51 against 0.44), which this limit gives up for a table that cannot outgrow E x E.
EXACT_PATH_MAX_SETS = 4096


def table_class(shape) -> type[SavedTable]:
    """Exact paths for coarse MoE (Mixtral's 8 experts top-2: 28 sets), per-expert
    co-occurrence for fine-grained MoE (64-128 experts top-6/8), by the model's `shape`."""
    fine = math.comb(shape.num_experts, shape.top_k) > EXACT_PATH_MAX_SETS
    return CooccurrenceTable if fine else CorrelationTable


def new_table(shape, path: int = 1) -> SavedTable:
    """An empty table of the kind a model of `shape` uses; `path` applies to exact-path tables only."""
    cls = table_class(shape)
    sizes = (shape.num_layers, shape.num_experts, shape.top_k)
    return CorrelationTable(*sizes, path=path) if cls is CorrelationTable else cls(*sizes)


def table_path(ckpt) -> Path:
    return cachedir.correlation_table(ckpt.key)


def load_table(ckpt) -> SavedTable | None:
    """The saved table of `ckpt`, or None when there is none or it does not fit the model
    (another version, another kind or another shape)."""
    path = table_path(ckpt)
    if not path.exists():
        return None
    try:
        return table_class(ckpt.spec.shape).load(path, ckpt.spec.shape)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"klotski: ignoring the expert-correlation table {path} ({e}); learning a new one",
              file=sys.stderr)
        return None


def learned_routing(ckpt) -> tuple[dict[int, list[int]], "torch.Tensor"] | None:
    """What the saved table of `ckpt` knows of its routing: each MoE layer's experts, most picked
    first (layers it has seen nothing of are left out), and the picks counted per MoE layer and
    expert ([moe layers, experts], in proportion); None without a table or with an empty one.
    The placement keeps the first of each ranking resident (planning.engine_placement) and the
    planner prices the counts (planning.routing_in_slot_order)."""
    path = table_path(ckpt)
    try:
        table = table_class(ckpt.spec.shape).load(path, ckpt.spec.shape) if path.exists() else None
    except (ValueError, KeyError, json.JSONDecodeError):
        return None  # an unusable table: the run's predictor says so, once (load_table)
    spec, ranking = ckpt.spec, {}
    if table is None or not any(spec.shape.experts_in(layer) for layer in range(spec.shape.num_layers)):
        return None
    counts = torch.stack([table.picks(spec.shape.moe_index(layer)) for layer in range(spec.shape.num_layers)
                          if spec.shape.experts_in(layer)])
    for layer in range(spec.shape.num_layers):
        if spec.shape.experts_in(layer) and (picks := counts[spec.shape.moe_index(layer)]).sum() > 0:
            ranking[layer] = torch.argsort(-picks, stable=True).tolist()
    return (ranking, counts) if ranking else None


def learning_predictor(ckpt) -> CorrelationPredictor:
    """A correlation predictor that starts from the saved table (or an empty one) and saves
    what it learns back to the cache after every group."""
    existed = table_path(ckpt).exists()  # an unusable one was already reported by load_table
    table = load_table(ckpt)
    if table is None:
        table = new_table(ckpt.spec.shape)
        if not existed:
            print(f"klotski: no expert-correlation table for this model yet; learning it from this job "
                  f"(saved to {table_path(ckpt)})", file=sys.stderr)
    return CorrelationPredictor(table, save_to=(table_path(ckpt), ckpt.key))


def warmup_prompts(count: int = 32, words: int = 48) -> list[str]:
    """Encyclopedic passages from the bundled corpus, so no job file or network is needed."""
    text = resources.files("klotski.builtin").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 8]
    return [" ".join(p.split()[:words]) for p in paragraphs[:count]]
