"""`--model` names a hub model that the local Hugging Face cache does not hold: downloaded into
that cache (only the files a run reads, the size and the free disk said first), or refused in
one line (offline, --no-download, a full disk, 404, 401/403, no network). No network here: a
directory laid out as the hub cache, and a small hub of our own on 127.0.0.1 that answers the
calls huggingface_hub makes (model info, the file tree, HEAD and GET of each file)."""
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from klotski.errors import ModelNotFound
from klotski.io import registry

CONFIG = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64}
INDEX = {"metadata": {"total_size": 200},
         "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}

# What a Mistral repository ships (Mixtral-8x22B-v0.1's kinds of files): the transformers shards and
# their index, the tokenizer, and beside them the same weights again for other tools. (Each file's
# bytes differ: huggingface_hub fetches a blob once, whichever names share it.)
REPO_FILES = {
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "README.md": b"# a model\n",
    "config.json": json.dumps(CONFIG).encode(),
    "generation_config.json": b'{"bos_token_id": 1}',
    "model.safetensors.index.json": json.dumps(INDEX).encode(),
    "model-00001-of-00002.safetensors": b"1" * 100,
    "model-00002-of-00002.safetensors": b"2" * 100,
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b'{"model_max_length": 64}',
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
    "tokenizer.model": b"spm",
    "tokenizer.model.v3": b"mistral-common's",
    "params.json": b"{}",
    "consolidated.safetensors": b"c" * 5000,
    "consolidated.safetensors.index.json": b"{}",
    "consolidated.00.pt": b"p" * 5000,
    "pytorch_model-00001-of-00002.bin": b"b" * 5000,
    "original/params.json": b"{}",
    "original/consolidated.00.pth": b"o" * 5000,
    "metal/model.bin": b"m" * 5000,
}
WANTED = {"config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model"}


def _sha(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


class FakeHub:
    """The hub's model API for `repos` ({repo: {path: bytes}}), on 127.0.0.1; `errors` answers a
    repo's every call with (status, X-Error-Code or None); `log` lists (method, path)."""

    def __init__(self, repos: dict, errors: dict | None = None):
        self.repos, self.errors, self.log = repos, errors or {}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept-alive connections, as the hub's

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def entry(path: str, data: bytes) -> dict:
        """A file's size, git blob id and (weights) LFS sha256, as the hub lists them."""
        lfs = path.endswith((".safetensors", ".bin", ".pt", ".pth"))
        return {"path": path, "size": len(data),
                "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                **({"sha256": hashlib.sha256(data).hexdigest()} if lfs else {})}

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.log.append((h.command, path))
        api = path.startswith("/api/models/")
        parts = path[len("/api/models/"):].split("/") if api else path.lstrip("/").split("/")
        repo = "/".join(parts[:2])
        if repo not in self.repos and repo not in self.errors:
            return self.send(h, 404, b'{"error": "Repository not found"}', body, code="RepoNotFound")
        if repo in self.errors:
            status, code = self.errors[repo]
            return self.send(h, status, b'{"error": "no"}', body, code=code)
        files, sha = self.repos[repo], _sha(repo)
        entries = [self.entry(p, d) for p, d in files.items()]
        if api and (len(parts) == 2 or parts[2] == "revision"):  # model_info / repo_info
            siblings = [{"rfilename": e["path"], "size": e["size"], "blobId": e["oid"],
                         **({"lfs": {"sha256": e["sha256"], "size": e["size"], "pointerSize": 134}}
                            if "sha256" in e else {})} for e in entries]
            return self.send(h, 200, json.dumps({"id": repo, "sha": sha, "siblings": siblings}).encode(), body)
        if api and len(parts) > 3 and parts[2] == "tree":  # list_repo_tree, recursive
            tree = [{"type": "file", "path": e["path"], "size": e["size"], "oid": e["oid"],
                     **({"lfs": {"oid": e["sha256"], "size": e["size"], "pointerSize": 134}} if "sha256" in e else {})}
                    for e in entries]
            return self.send(h, 200, json.dumps(tree).encode(), body)
        if not api and len(parts) > 4 and parts[2] == "resolve":  # HEAD / GET of a file
            name = "/".join(parts[4:])
            if name not in files:
                return self.send(h, 404, b"", body, code="EntryNotFound", sha=sha)
            e = self.entry(name, files[name])
            return self.send(h, 200, files[name], body, sha=sha, etag=e.get("sha256", e["oid"]))
        return self.send(h, 404, b"", body)

    @staticmethod
    def send(h, status, data, body, code=None, sha=None, etag=None):
        h.send_response(status)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/json")
        for k, v in (("X-Error-Code", code), ("X-Repo-Commit", sha), ("ETag", f'"{etag}"' if etag else None)):
            if v:
                h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def downloads(self) -> set:
        """The files fetched with GET."""
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.log if m == "GET" and "/resolve/" in p}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of the test's own, downloads on, no hub reachable (port 9)."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    _endpoint(monkeypatch, "http://127.0.0.1:9")
    return cache


def _endpoint(monkeypatch, url):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def fake_hub(hub_cache, monkeypatch):
    hub = FakeHub({"org/moe": REPO_FILES, "org/ggufs": {"config.json": b"{}", "m-Q4_K_M.gguf": b"g" * 10}},
                  errors={"org/private": (401, None), "org/gated": (403, "GatedRepo")})
    _endpoint(monkeypatch, hub.url)
    yield hub
    hub.close()


def _lay_out_cache(cache: Path, repo: str, files: dict) -> Path:
    """`repo` as huggingface_hub leaves it in the cache: blobs, a snapshot of links, refs/main."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / _sha(repo)
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(_sha(repo))
    return snapshot


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ---- (a) the cache alone: no network ------------------------------------------------------------
def test_a_cached_model_resolves_without_the_network(hub_cache, monkeypatch):
    snapshot = _lay_out_cache(hub_cache, "org/moe", {n: REPO_FILES[n] for n in WANTED})

    def no_network(*a, **kw):
        raise AssertionError("the network was asked")
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", no_network)
    assert registry.resolve("org/moe") == snapshot
    assert registry.resolve("org/moe", weights=False) == snapshot
    with registry.downloads(False):  # also with downloads off
        assert registry.resolve("org/moe") == snapshot


def test_an_alias_resolves_from_the_cache(hub_cache):
    snapshot = _lay_out_cache(hub_cache, "mistralai/Mixtral-8x22B-v0.1", {n: REPO_FILES[n] for n in WANTED})
    assert registry.resolve("mixtral-8x22b") == snapshot
    assert registry.resolve("Mixtral-8x22B") == snapshot


def test_a_cache_missing_a_shard_is_not_taken_for_whole(hub_cache):
    _lay_out_cache(hub_cache, "org/moe", {n: REPO_FILES[n] for n in WANTED - {"model-00002-of-00002.safetensors"}})
    with registry.downloads(False), pytest.raises(ModelNotFound) as e:
        registry.resolve("org/moe")
    assert "only partly in the local Hugging Face cache" in _one_line(e) and "`hf download org/moe`" in str(e.value)


def test_new_families_have_aliases():
    for alias, repo in {"glm-4.5-air": "zai-org/GLM-4.5-Air", "glm-4.5": "zai-org/GLM-4.5",
                        "minimax-m2": "MiniMaxAI/MiniMax-M2", "ernie-4.5-21b-a3b": "baidu/ERNIE-4.5-21B-A3B-PT",
                        "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct"}.items():
        assert registry.ALIASES[alias] == repo


# ---- (b) a download through a hub of our own ----------------------------------------------------
def test_b_download_fetches_only_what_a_run_reads(fake_hub, hub_cache, capsys):
    folder = registry.resolve("org/moe")
    assert folder == hub_cache / "models--org--moe" / "snapshots" / _sha("org/moe")
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == WANTED
    assert all((folder / n).read_bytes() == REPO_FILES[n] for n in WANTED)
    assert fake_hub.downloads() == WANTED  # no consolidated copy, .bin, .pt, original/ or metal/ asked for
    err = capsys.readouterr().err
    size = sum(len(REPO_FILES[n]) for n in WANTED)
    lines = [line for line in err.splitlines() if "downloading" in line]
    assert lines == [f"klotski: downloading org/moe ({size} bytes of {len(WANTED)} files) into {hub_cache}, "
                     f"{lines[0].rsplit(', ', 1)[1]}"], err
    assert lines[0].endswith(" free")
    # now in the cache: no network, nothing said
    fake_hub.log.clear()
    assert registry.resolve("org/moe") == folder and fake_hub.log == []
    assert "downloading" not in capsys.readouterr().err


def test_a_rerun_fetches_only_the_files_not_finished(fake_hub, hub_cache, capsys):
    registry.resolve("org/moe")
    folder = hub_cache / "models--org--moe" / "snapshots" / _sha("org/moe")
    shard = folder / "model-00002-of-00002.safetensors"
    shard.resolve().unlink()  # as if the run was stopped while that shard came down
    shard.unlink()
    capsys.readouterr()
    fake_hub.log.clear()
    assert registry.resolve("org/moe") == folder and shard.read_bytes() == REPO_FILES[shard.name]
    assert fake_hub.downloads() == {shard.name}
    assert "(100 bytes of 1 file)" in capsys.readouterr().err


def test_a_plan_downloads_the_config_alone(fake_hub, hub_cache):
    folder = registry.resolve("org/moe", weights=False)
    assert [p.name for p in folder.iterdir()] == ["config.json"] and fake_hub.downloads() == {"config.json"}
    fake_hub.log.clear()
    assert registry.resolve("org/moe", weights=False) == folder and fake_hub.log == []
    registry.resolve("org/moe")  # a run then fetches the rest
    assert fake_hub.downloads() == WANTED - {"config.json"}


def test_too_small_a_disk_is_refused_before_a_byte_is_written(fake_hub, hub_cache, monkeypatch):
    monkeypatch.setattr(registry, "free_bytes", lambda path: 150)
    with pytest.raises(ModelNotFound) as e:
        registry.resolve("org/moe")
    text = _one_line(e)
    size = sum(len(REPO_FILES[n]) for n in WANTED)
    assert f"needs {size} bytes ({len(WANTED)} files)" in text and "150 bytes free" in text, text
    assert "HF_HUB_CACHE" in text and "HF_HOME" in text
    assert not hub_cache.exists() and fake_hub.downloads() == set()


@pytest.mark.parametrize("repo, words", [
    ("org/missing", ["not a model on the Hugging Face hub", "404", "check the name"]),
    ("org/private", ["refused access (401)", "`hf auth login`", "licence"]),
    ("org/gated", ["gated on the Hugging Face hub", "(403)", "accept its licence", "`hf auth login`"]),
    ("org/ggufs", ["ships no safetensors weights", "`hf download org/ggufs m-Q4_K_M.gguf`"]),
])
def test_hub_refusals_are_one_line(fake_hub, hub_cache, repo, words):
    with pytest.raises(ModelNotFound) as e:
        registry.resolve(repo)
    text = _one_line(e)
    assert all(w in text for w in words), text
    assert not (hub_cache / ("models--" + repo.replace("/", "--")) / "blobs").exists()


def test_a_disk_that_fills_midway_is_one_line(fake_hub, hub_cache, monkeypatch):
    import errno
    import huggingface_hub
    real = huggingface_hub.snapshot_download

    def full(*a, **kw):
        if kw.get("local_files_only"):
            return real(*a, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    with pytest.raises(ModelNotFound) as e:
        registry.resolve("org/moe")
    text = _one_line(e)
    assert "no space left on the device" in text and "rerun the same command" in text, text


def test_gated_at_the_file_is_one_line(fake_hub, hub_cache):
    """The hub lists a gated repository's files to anyone and refuses the files themselves."""
    real = fake_hub.send

    def gate_files(h, status, data, body, code=None, sha=None, etag=None):
        if "/resolve/" in h.path and status == 200:
            return real(h, 403, b"", body, code="GatedRepo")
        return real(h, status, data, body, code, sha, etag)
    fake_hub.send = gate_files
    with pytest.raises(ModelNotFound) as e:
        registry.resolve("org/moe")
    assert "gated on the Hugging Face hub" in _one_line(e) and "`hf auth login`" in str(e.value)


def test_no_network_is_one_line(hub_cache):
    with pytest.raises(ModelNotFound) as e:  # the fixture's hub: nothing listens on port 9
        registry.resolve("org/moe")
    text = _one_line(e)
    assert "cannot reach the Hugging Face hub at http://127.0.0.1:9" in text and "`hf download org/moe`" in text


def test_the_cli_downloads_and_runs(fake_hub, hub_cache, tmp_path, capsys):
    """`klotski check --model org/tiny` on a fresh cache: downloaded, then checked like a folder."""
    from klotski.builtin import tiny
    from klotski.cli import main
    built = Path(tiny.build_checkpoint(tmp_path / "tiny", "tiny"))
    files = {p.name: p.read_bytes() for p in built.iterdir() if p.is_file()}
    fake_hub.repos["org/tiny"] = files
    assert main.main(["check", "--model", "org/tiny", "--no-progress"]) == 0
    assert "klotski: downloading org/tiny (" in capsys.readouterr().err
    assert {"config.json", "tokenizer.json"} <= fake_hub.downloads()


def test_a_fresh_machine_plans_a_hub_id_through_the_environment(fake_hub, tmp_path):
    """As a user runs it: HF_ENDPOINT and HF_HUB_CACHE read by huggingface_hub at import, in a
    process of its own; `klotski plan` fetches the config alone."""
    import os
    import subprocess
    import sys
    from klotski.builtin import tiny
    built = Path(tiny.build_checkpoint(tmp_path / "tiny", "tiny"))
    fake_hub.repos["org/tiny"] = {p.name: p.read_bytes() for p in built.iterdir() if p.is_file()}
    cache = tmp_path / "fresh" / "hub"
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(cache), "NO_PROXY": "127.0.0.1"}
    env.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run([sys.executable, "-m", "klotski.cli", "plan", "--model", "org/tiny", "--hardware",
                        "rtx3090-pcie4"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "klotski: downloading org/tiny (" in r.stderr and f"of 1 file) into {cache}, " in r.stderr, r.stderr
    assert fake_hub.downloads() == {"config.json"}


# ---- (c) downloads off ------------------------------------------------------------------------
def test_c_offline_and_no_download_refuse_in_one_line(fake_hub, hub_cache, monkeypatch, capsys):
    from klotski.cli import main
    with registry.downloads(False), pytest.raises(ModelNotFound) as e:
        registry.resolve("mixtral-8x22b")
    text = _one_line(e)
    assert "--model 'mixtral-8x22b' (mistralai/Mixtral-8x22B-v0.1): not in the local Hugging Face cache" in text
    assert "--no-download" in text and "`hf download mistralai/Mixtral-8x22B-v0.1`" in text
    assert "huggingface-cli" not in text

    assert main.main(["check", "--model", "org/moe", "--no-download"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--no-download" in err and "`hf download org/moe`" in err, err
    assert main.main(["plan", "--model", "org/moe", "--no-download", "--hardware", "rtx3090-pcie4"]) == 2
    assert "`hf download org/moe config.json`" in capsys.readouterr().err  # a plan reads the config alone

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as e:
        registry.resolve("org/moe")
    assert "HF_HUB_OFFLINE=1" in _one_line(e) and "`hf download org/moe`" in str(e.value)
    assert fake_hub.log == []  # nothing asked of the hub
