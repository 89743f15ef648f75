"""Where Klotski keeps what it builds once and reuses: built-in models, quantized copies,
expert-correlation tables. All under $XDG_CACHE_HOME/klotski (default ~/.cache/klotski),
keyed by a checkpoint's fingerprint so a changed checkpoint never reuses a stale entry."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "klotski"


def fingerprint(model_dir: Path, store) -> str:
    """Identity of a checkpoint: its config and every tensor's name, shape and dtype."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for name in sorted(store.entries):
        e = store.entries[name]
        h.update(f"{name}:{e.shape}:{e.dtype}".encode())
    return h.hexdigest()[:16]


def profiles() -> Path:
    return root() / "profiles"


def models() -> Path:
    return root() / "models"


def correlation_table(key: str) -> Path:
    return root() / "correlation" / f"{key}.json"


def quantized_copy(key: str, tag: str) -> Path:
    return root() / "quantized" / f"{key}-{tag}"
