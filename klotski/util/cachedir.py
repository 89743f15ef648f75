"""Where Klotski keeps what it builds once and reuses: built-in models, quantized copies,
expert-correlation tables. All under $XDG_CACHE_HOME/klotski (default ~/.cache/klotski),
keyed by a checkpoint's fingerprint so a changed checkpoint never reuses a stale entry."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from klotski.util.writes import replacing, require_space, writing


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


def stamp_matches(stamp_file: Path, **expected) -> bool:
    """Whether a built model's stamp (JSON) records exactly the `expected` values: a model
    built by other code or from other settings is rebuilt, never reused."""
    try:
        stamp = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        return False
    return all(stamp.get(k) == v for k, v in expected.items())


def build_once(name: str, current: Callable[[Path], bool], build: Callable[[Path], object],
               need: int | None = None) -> Path:
    """models()/`name`, made by `build(directory)` unless `current(path)` says it is there.

    The build goes to a temporary sibling directory that is renamed into place
    (util.writes.replacing), so an interrupted build never leaves a half-written model
    behind, and two processes racing to build simply keep whichever finished first."""
    root = models()
    final = root / name
    if current(final):
        return final
    what = f"the built-in model {name}"
    if need:
        require_space(root, need, what, "free some space or point XDG_CACHE_HOME at a bigger disk")
    with writing(root, what, need=need, then="the partial build was removed; free some space or point "
                 "XDG_CACHE_HOME at a bigger disk, then rerun the same command"):
        root.mkdir(parents=True, exist_ok=True)
        _build(name, final, current, build)
    return final


def _build(name: str, final: Path, current, build) -> None:
    why = "out of date" if final.exists() else "first use"
    print(f"building {name} into {final} ({why})", file=sys.stderr, flush=True)
    with replacing(final, keep=current) as tmp:  # (a current one another process built meanwhile is kept)
        tmp.mkdir()
        build(tmp)
