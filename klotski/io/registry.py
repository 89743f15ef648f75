"""Resolve `--model` to a checkpoint directory: a local path, a built-in tiny model, or a
Hugging Face id / alias already in the local HF cache (never downloaded at run time)."""
from __future__ import annotations

from pathlib import Path

from klotski.errors import ModelNotFound

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
}


def resolve(model: str) -> Path:
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
            f"({', '.join([*tiny.BUILTIN_MODELS, *smollm.BUILTINS])}) "
            f"or a known alias ({', '.join(ALIASES)})")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:
        raise ModelNotFound(
            f"--model {model!r}: {repo} is not in the local Hugging Face cache; download it first with "
            f"`huggingface-cli download {repo}` (or pass the checkpoint directory)") from None
