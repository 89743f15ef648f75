"""Resolve `--model` to a checkpoint directory: a local path, a built-in tiny model, or a
Hugging Face id / alias. A hub model is read from the local Hugging Face cache (HF_HUB_CACHE,
else HF_HOME/hub) without touching the network when the cache holds it whole; otherwise the
files a run reads are downloaded into that cache first, as transformers and vLLM do: the
size and the free disk checked and said in one line, huggingface_hub's own progress bars, a
rerun after an interruption fetching only the files not finished yet. `--no-download` or HF_HUB_OFFLINE=1 turn
downloads off (the refusal names `hf download`). Every failure is one line (ModelNotFound)."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from klotski.errors import ModelNotFound
from klotski.util.writes import describe, free_bytes, size_text

ALIASES = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "mixtral-8x7b-instruct": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "mixtral-8x22b-instruct": "mistralai/Mixtral-8x22B-Instruct-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-30b-a3b-instruct": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen1.5-moe-a2.7b": "Qwen/Qwen1.5-MoE-A2.7B",
    "qwen2-57b-a14b": "Qwen/Qwen2-57B-A14B",
    "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0924",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek-v2-lite-chat": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "glm-4.5-air": "zai-org/GLM-4.5-Air",
    "glm-4.5": "zai-org/GLM-4.5",
    "minimax-m2": "MiniMaxAI/MiniMax-M2",
    "ernie-4.5-21b-a3b": "baidu/ERNIE-4.5-21B-A3B-PT",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "qwen3.6-35b-a3b": "Qwen/Qwen3.6-35B-A3B",
    "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B",
}

# The files a run reads, as huggingface_hub's patterns (fnmatch, where `*` also matches `/`):
# the config, the tokenizer and chat template, the safetensors weights and their index.
# Top-level files only: repositories ship other formats in subfolders (Llama's original/
# consolidated.00.pth, gpt-oss's original/ and metal/), Mistral's consolidated*.safetensors
# (with params.json) beside the transformers shards, and .bin/.pth/.pt copies that no
# pattern here names.
CONFIG_FILES = ["config.json"]
RUN_FILES = [*CONFIG_FILES, "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "*.tiktoken",
             "chat_template.jinja", "chat_template.json"]
SKIPPED = ["*/*", "consolidated*"]

_downloads = {"allowed": True}


@contextmanager
def downloads(allowed: bool):
    """Within it, a hub model missing from the cache is downloaded only if `allowed` (the CLI's
    `--no-download` runs its command inside `downloads(False)`)."""
    before = _downloads["allowed"]
    _downloads["allowed"] = allowed
    try:
        yield
    finally:
        _downloads["allowed"] = before


def _downloads_off() -> str | None:
    """What turns downloads off, as the user wrote it, or None when they are on."""
    if not _downloads["allowed"]:
        return "--no-download"
    from huggingface_hub import constants
    if constants.is_offline_mode() or any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
                                          for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return "HF_HUB_OFFLINE=1"
    return None


def resolve(model: str, *, weights: bool = True) -> Path:
    """The directory (or GGUF file) `--model` names. For a hub id or alias: its snapshot in the
    local Hugging Face cache, downloaded first where missing; `weights=False` (a plan, a
    profile: shapes only) needs only its config.json."""
    from klotski.builtin import smollm, tiny

    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):  # a GGUF file is a checkpoint of its own
        return path
    if model in tiny.BUILTIN_MODELS:
        return tiny.ensure_builtin(model)
    if model in smollm.BUILTINS:
        return smollm.ensure(model)
    repo = ALIASES.get(model.lower(), model)
    if "/" not in repo or path.exists():
        raise ModelNotFound(
            f"--model {model!r}: not a directory, a built-in model "
            f"({', '.join([*tiny.BUILTIN_MODELS, *smollm.BUILTINS])}), "
            f"a Hugging Face id (org/name) or a known alias ({', '.join(ALIASES)})")
    if model.startswith(("/", ".", "~")) or repo.count("/") > 1:  # a path, not org/name
        raise ModelNotFound(f"--model {model!r}: no such directory or GGUF file (and not a Hugging Face id, "
                            f"org/name)")
    return hub_snapshot(model, repo, weights=weights)


def hub_snapshot(model: str, repo: str, *, weights: bool = True) -> Path:
    """`repo`'s snapshot folder in the local Hugging Face cache, holding the files a run reads
    (only config.json without `weights`): from the cache as it is when whole, no network;
    otherwise downloaded, unless downloads are off."""
    from huggingface_hub import constants
    cache = Path(constants.HF_HUB_CACHE)
    wanted = RUN_FILES if weights else CONFIG_FILES
    found = _cached(repo, wanted, weights)
    if found is not None:
        return found
    off = _downloads_off()
    if off:
        where = "only partly in" if _repo_folder(cache, repo).exists() else "not in"
        command = f"hf download {repo}" + ("" if weights else " config.json")
        undo = "drop --no-download" if off.startswith("--") else "unset HF_HUB_OFFLINE"
        raise ModelNotFound(
            f"{_head(model, repo)}: {where} the local Hugging Face cache ({cache}) and {off} turns "
            f"downloads off; download it with `{command}` (or {undo}, or pass the checkpoint directory)")
    return _download(model, repo, wanted, weights, cache)


def _repo_folder(cache: Path, repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name
    return cache / repo_folder_name(repo_id=repo, repo_type="model")


def _cached(repo: str, wanted: list[str], weights: bool) -> Path | None:
    """The cached snapshot of `repo` (refs/main) when it holds what a run reads, else None. No
    network: huggingface_hub answers from the cache, and says when its saved file listing shows
    a file missing (an interrupted download)."""
    from huggingface_hub import snapshot_download
    try:
        folder = Path(snapshot_download(repo, local_files_only=True, allow_patterns=wanted,
                                        ignore_patterns=SKIPPED))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), partly, or not a valid id
        return None
    return folder if _complete(folder, weights) else None


def _complete(folder: Path, weights: bool) -> bool:
    """Whether `folder` holds a config.json and, with `weights`, every shard its safetensors
    index names (or, without an index, a safetensors or GGUF file)."""
    if not (folder / "config.json").is_file():
        return False
    if not weights:
        return True
    for index in sorted(folder.glob("*.safetensors.index.json")):
        if index.name.startswith("consolidated"):
            continue
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.gguf"))


def _download(model: str, repo: str, wanted: list[str], weights: bool, cache: Path) -> Path:
    """Download what a run reads of `repo` into the cache: its size (less what an earlier
    download finished) and the free disk checked and said first; huggingface_hub's own progress
    bars; a rerun after an interruption fetches only the files not yet finished."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except Exception as e:
        raise ModelNotFound(_hub_error(model, repo, e, cache, started=False)) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    chosen = list(filter_repo_objects(list(siblings), allow_patterns=wanted, ignore_patterns=SKIPPED))
    if "config.json" not in chosen:
        raise ModelNotFound(f"{_head(model, repo)}: the repository has no config.json at its top level: not a "
                            f"transformers checkpoint klotski can read")
    if weights and not any(f.endswith(".safetensors") for f in chosen):
        ggufs = [f for f in siblings if f.endswith(".gguf")]
        hint = (f"; it ships GGUF files: download the one you want (`hf download {repo} {ggufs[0]}`) and pass "
                f"its path" if ggufs else "")
        raise ModelNotFound(f"{_head(model, repo)}: the repository ships no safetensors weights (klotski reads "
                            f"safetensors or a GGUF file){hint}")
    need, files = _still_needed(cache, repo, info.sha, [siblings[f] for f in chosen])
    free = free_bytes(cache)
    if free is not None and need > free:
        raise ModelNotFound(
            f"{_head(model, repo)}: the download needs {size_text(need)} ({_files(files)}) in the Hugging Face cache "
            f"{cache}, which has {size_text(free)} free; make room there, or point HF_HUB_CACHE (or HF_HOME) "
            f"at a disk with space, e.g. HF_HUB_CACHE=/big/disk/hub")
    if files:
        room = f", {size_text(free)} free" if free is not None else ""
        print(f"klotski: downloading {repo} ({size_text(need)} of {_files(files)}) into {cache}{room}",
              file=sys.stderr, flush=True)
    try:
        folder = Path(snapshot_download(repo, allow_patterns=wanted, ignore_patterns=SKIPPED))
    except OSError as e:
        if e.errno is not None:  # the disk (full, read-only, permissions): said as every failed write is
            raise ModelNotFound(_head(model, repo) + ": " + describe(
                e, cache, f"{repo}'s files", need=need, then="make room and rerun the same command (finished "
                "files are kept)")) from None
        raise ModelNotFound(_hub_error(model, repo, e, cache, started=True)) from None
    except Exception as e:
        raise ModelNotFound(_hub_error(model, repo, e, cache, started=True)) from None
    if not _complete(folder, weights):
        raise ModelNotFound(f"{_head(model, repo)}: downloaded into {folder} but not whole (no "
                            f"config.json, or a shard its safetensors index names is missing from the repository)")
    return folder


def _still_needed(cache: Path, repo: str, sha: str | None, siblings: list) -> tuple[int, int]:
    """(bytes, files) of `siblings` still to download: a file in the snapshot, or whose blob an
    earlier download finished (blobs/ETAG: the LFS sha256, else the git blob id), is done.
    (huggingface_hub 2.x keeps each finished file; a file left part-way is fetched again whole,
    and a dropped connection within a run resumes where it stopped.)"""
    storage = _repo_folder(cache, repo)
    snapshot = storage / "snapshots" / sha if sha else None
    need = files = 0
    for s in siblings:
        etag = s.lfs.sha256 if s.lfs is not None else s.blob_id
        if (snapshot is not None and (snapshot / s.rfilename).is_file()) or (
                etag and (storage / "blobs" / etag).is_file()):
            continue
        need, files = need + (s.size or 0), files + 1
    return need, files


def _head(model: str, repo: str) -> str:
    """How a line about `--model` begins: the name as given, and the repository an alias names."""
    return f"--model {model!r}" if model == repo else f"--model {model!r} ({repo})"


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _hub_error(model: str, repo: str, e: Exception, cache: Path, *, started: bool) -> str:
    """The one line for a failed hub call: not found, gated or private, unreachable, or what
    the hub answered."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError)
    if isinstance(e, LocalEntryNotFoundError) and isinstance(e.__cause__, Exception):
        e = e.__cause__  # huggingface_hub's "cannot find the files locally" over the hub's own answer
    page = f"{constants.ENDPOINT}/{repo}"
    login = "log in with `hf auth login` (or set HF_TOKEN)"
    resume = "; rerun the same command to resume (finished files are kept)" if started else ""
    status = getattr(getattr(e, "response", None), "status_code", None)
    head = _head(model, repo)
    if isinstance(e, GatedRepoError):
        return f"{head}: gated on the Hugging Face hub ({status}): accept its licence on {page} and {login}"
    if isinstance(e, RepositoryNotFoundError) and status == 404:
        aliases = "" if model.lower() in ALIASES else f", or use an alias ({', '.join(ALIASES)})"
        return f"{head}: not a model on the Hugging Face hub ({constants.ENDPOINT}, 404); check the name{aliases}"
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return (f"{head}: the Hugging Face hub refused access ({status}): the repository is gated or private (or "
                f"does not exist); {login} and accept its licence on {page}")
    if isinstance(e, HfHubHTTPError):
        return f"{head}: the Hugging Face hub answered {status} ({_first_line(e)}); try again later{resume}"
    # httpx's TransportError (connection refused, DNS, timeouts, proxy, a dropped connection)
    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError, TimeoutError)) or any(
            c.__name__ == "TransportError" for c in type(e).__mro__):
        return (f"{head}: cannot reach the Hugging Face hub at {constants.ENDPOINT} ({_first_line(e)}); "
                f"check the network (or HTTPS_PROXY, HF_ENDPOINT), or download it with `hf download {repo}` "
                f"where there is one, into the cache {cache}{resume}")
    if isinstance(e, ValueError):  # huggingface_hub's checks of the id
        return f"{head}: not a valid Hugging Face id ({_first_line(e)})"
    return f"{head}: the download failed ({_first_line(e)}){resume}"


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
