"""Optional packages (issue 47): each is installed by one of pyproject.toml's extras, and a
command that needs a missing one stops with one line naming the extra to install.

All cases run in one child process that imports the CLI once and then forks a process per
case, where the package cannot be imported (every import finder is told to find nothing under
its name, as when it is not installed); each case's stderr and exit status are read back."""
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The child: the CLI imported once; per case a fork that hides `blocked` from every finder, then
# runs the CLI with `argv` in the case's folder, its stderr into the folder's `stderr` file.
CHILD = """
import importlib.abc, json, os, sys
from klotski.cli.main import main

class Hide(importlib.abc.MetaPathFinder):
    def __init__(self, finder, blocked):
        self.finder, self.blocked = finder, blocked
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == self.blocked:
            return None
        return self.finder.find_spec(name, path, target)
    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks here too: hide it there
        found = getattr(self.finder, "find_distributions", lambda *a, **k: [])(*args, **kwargs)
        return [d for d in found if (d.metadata["Name"] or "").lower().replace("-", "_") != self.blocked]
    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()

for blocked, argv, folder in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.chdir(folder)
        os.dup2(os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        if blocked in sys.modules:  # the CLI imported it already: nothing can hide it
            print("imported by klotski.cli.main itself", file=sys.stderr)
            os._exit(97)
        sys.meta_path[:] = [Hide(f, blocked) for f in sys.meta_path]
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(folder, "rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


def run_without_each(cases: list, tmp_path) -> list[subprocess.CompletedProcess]:
    """Each (package, argv, folder) of `cases` run with `package` missing: what it printed and returned."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", CHILD, json.dumps([[p, a, str(f)] for p, a, f in cases])], cwd=tmp_path,
                   env=env, check=True, timeout=600)
    return [subprocess.CompletedProcess(argv, int((folder / "rc").read_text()), "", (folder / "stderr").read_text())
            for _, argv, folder in cases]


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


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case's run, keyed by its index in CASES."""
    root = tmp_path_factory.mktemp("extras")
    cases = []
    for i, (package, _, argv, _) in enumerate(CASES):
        folder = root / f"case{i}"
        folder.mkdir()
        cases.append((package, argv(folder), folder))
    return dict(enumerate(run_without_each(cases, root)))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_missing_optional_package_is_one_line_naming_its_extra(outcomes, case):
    package, extra, _, words = CASES[case]
    done = outcomes[case]
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
