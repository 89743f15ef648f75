"""`klotski check --model DIR`: everything that can be wrong with a checkpoint, one line per
problem, before a night's run finds it. Headers, config and tokenizer are checked as
`generate` checks them; then every floating-point tensor is read in pieces of bounded size
(never more than a quarter of the host budget at once) and counted for NaN and infinity."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from placement.store import CheckpointError, TensorStore

MAX_PIECE_BYTES = 256 << 20


def scan(model: str, *, host_memory: int | None = None, progress: bool = False):
    """Yield one line per problem of checkpoint `model` (a directory, alias or built-in)."""
    from klotski.io.checkpoint import load_tokenizer
    from klotski.io import registry
    from klotski.models.spec import ModelSpec

    directory = Path(registry.resolve(model))
    piece = max(1, min(MAX_PIECE_BYTES, (host_memory or MAX_PIECE_BYTES * 4) // 4))
    from klotski.io import gguf
    if gguf.is_gguf(directory):
        yield from gguf.scan(directory, piece)
        return
    try:
        store = TensorStore(directory)
    except CheckpointError as e:
        yield str(e)  # no readable tensor index: nothing more can be checked
        return
    try:
        try:
            spec = ModelSpec.from_dir(directory, store.names())
            store.validate(spec.expected_shapes())
            tokenizer = load_tokenizer(directory, spec)
            if len(tokenizer) > spec.shape.vocab_size:
                yield (f"{directory}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is "
                       f"{spec.shape.vocab_size}; prompts that use the extra tokens will fail")
        except CheckpointError as e:
            yield str(e)
        yield from _non_finite(store, piece, progress)
    finally:
        store.close()


def _non_finite(store: TensorStore, piece_bytes: int, progress: bool):
    from tqdm import tqdm
    floats = [(n, e) for n, e in store.entries.items() if e.dtype.is_floating_point and e.nbytes]
    floats.sort(key=lambda item: (str(item[1].file), item[1].offset))  # read each file front to back
    with tqdm(total=sum(e.nbytes for _, e in floats), unit="B", unit_scale=True, desc="check",
              disable=None if progress else True, file=sys.stderr) as bar:
        for name, entry in floats:
            numel = entry.nbytes // entry.dtype.itemsize
            step = max(1, piece_bytes // entry.dtype.itemsize)
            nan = inf = 0
            for start in range(0, numel, step):
                values = store.read_flat(name, start, min(step, numel - start))
                nan += int(torch.isnan(values).sum())
                inf += int(torch.isinf(values).sum())
                bar.update(values.numel() * entry.dtype.itemsize)
                del values
            if nan or inf:
                yield (f"{entry.file}: tensor {name} has {nan} NaN and {inf} infinite values "
                       f"(of {numel}); the weights are corrupt: re-download this shard")


def main(a) -> int:
    problems = 0
    for line in scan(a.model, host_memory=a.host_memory, progress=not a.no_progress):
        print(line)
        problems += 1
    print(f"klotski check: {problems} problem{'s' if problems != 1 else ''} found in {a.model}"
          + ("" if problems else " (headers, config, tokenizer and every tensor's values)"))
    return 1 if problems else 0
