"""Optional packages (issue 47): each is installed by one of pyproject.toml's extras, and a
command that needs a missing one stops with one line naming the extra to install.

Each case runs the CLI in a subprocess where the package cannot be imported (every import
finder is told to find nothing under its name, as when it is not installed) and reads stderr."""
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in the child: hide `blocked` from every finder, then the CLI with `argv`.
CHILD = """
import importlib.abc, sys
blocked, argv = {blocked!r}, {argv!r}

class Hide(importlib.abc.MetaPathFinder):
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == blocked:
            return None
        return self.finder.find_spec(name, path, target)
    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks here too: hide it there
        found = getattr(self.finder, "find_distributions", lambda *a, **k: [])(*args, **kwargs)
        return [d for d in found if (d.metadata["Name"] or "").lower().replace("-", "_") != blocked]
    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()

sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
from klotski.cli.main import main
sys.exit(main(argv))
"""


def run_without(package: str, argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", CHILD.format(blocked=package, argv=argv)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def jobs(tmp_path) -> str:
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    return str(path)


# (package, extra, the command that needs it, what the line says it was doing)
CASES = [
    ("gguf", "gguf", lambda t: ["check", "--model", str(_file(t, "m.gguf"))], "reading the GGUF file"),
    ("gguf", "gguf", lambda t: ["plan", "--model", str(_file(t, "m.gguf"))], "reading the GGUF file"),
    ("datasets", "datasets", lambda t: ["generate", str(_file(t, "jobs.parquet")), "-o", str(t / "o.jsonl")],
     "reading the dataset file"),
    ("pyarrow", "datasets", lambda t: ["generate", jobs(t), "-o", str(t / "out.parquet")],
     "writing the Parquet output"),
    ("openai", "serve", lambda t: ["serve", "--data-dir", str(t / "d")], "klotski serve needs"),
    ("fastapi", "serve", lambda t: ["serve", "--data-dir", str(t / "d")], "klotski serve needs"),
    ("uvicorn", "serve", lambda t: ["serve", "--data-dir", str(t / "d")], "klotski serve needs"),
    ("python_multipart", "serve", lambda t: ["serve", "--data-dir", str(t / "d")], "klotski serve needs"),
    ("ray", "ray", lambda t: ["generate", jobs(t), "--ray", "-o", str(t / "o.jsonl")], "--ray needs Ray"),
]


def _file(tmp_path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(b"not read: the import comes first")
    return path


@pytest.mark.parametrize("package, extra, argv, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_missing_optional_package_is_one_line_naming_its_extra(tmp_path, package, extra, argv, words):
    done = run_without(package, argv(tmp_path), tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = lines[-1]
    assert last.startswith("klotski: error: ") and words in last, last
    assert package in last and f"pip install 'klotski[{extra}]'" in last, last


def test_every_extra_named_by_an_error_installs_that_package():
    """The extra a missing package's line names really lists it (pip names are the import
    names here, but for python-multipart), and `serve` holds everything klotski/serve imports."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {req.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for req in reqs}
             for extra, reqs in extras.items()}
    for package, extra, _, _ in CASES:
        assert package in names[extra], (package, extra, extras[extra])
    assert {"fastapi", "uvicorn", "python_multipart", "openai"} <= names["serve"]
