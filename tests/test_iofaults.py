"""I/O faults during a run: a full disk under the output or the offload directory, a report
that cannot be written, a cache that cannot be saved, SIGTERM. Each is one line (no
traceback), loses nothing, leaves no partial copy that a rerun would trust, and a rerun
finishes with every id once and the tokens of an uninterrupted run."""
import errno
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import PROMPTS
from klotski.cli import main as cli
from klotski.io import output

PROMPT_SET = [f"{p} number {i}" for i in range(10) for p in PROMPTS[:4]]  # ~8 KB of output


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPT_SET)))
    return path


def _args(job, model, out, *extra):
    return ["generate", str(job), "--model", str(model), "-o", str(out), "--batch-size", "2",
            "--max-new-tokens", "6", "--include-token-ids", "--no-progress", *extra]


def _records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.fixture
def uninterrupted(job, checkpoints, tmp_path, capsys):
    full = tmp_path / "full.jsonl"
    assert cli.main(_args(job, checkpoints["gqa"], full)) == 0
    capsys.readouterr()
    return _records(full)


class _DiskFullFor:
    """The `os` module as output.py sees it, except that a write that would take `path`
    past `limit` bytes fails with ENOSPC, as a full disk does."""  # (no attribute may shadow os.path)

    def __init__(self, target, limit):
        self.target, self.limit = target, limit

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        st = os.fstat(fd)
        t = self.target
        if t.exists() and st.st_ino == os.stat(t).st_ino and st.st_size + len(data) > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)


def _one_line(err: str) -> str:
    """The one error line (progress notes such as 'quantizing ...' may come before it)."""
    lines = err.strip().splitlines()
    errors = [x for x in lines if x.startswith("klotski: error:")]
    assert errors == lines[-1:] and "Traceback" not in err, err
    assert all(x.startswith("klotski: ") for x in lines), err
    return lines[-1]


def test_output_disk_full_mid_run_then_resume(job, checkpoints, tmp_path, monkeypatch, capsys, uninterrupted):
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(output, "os", _DiskFullFor(out, 1500))
    assert cli.main(_args(job, checkpoints["gqa"], out)) == cli.EXIT_STOPPED
    line = _one_line(capsys.readouterr().err)
    kept = _ids(out)
    assert 1 <= len(kept) < len(PROMPT_SET)
    assert line.startswith(f"klotski: error: {out}: cannot write the output: no space left on the device")
    assert f"{len(kept)} whole records are in it" in line and "rerun the same command to resume" in line
    monkeypatch.setattr(output, "os", os)  # room again
    assert cli.main(_args(job, checkpoints["gqa"], out)) == 0
    assert sorted(_ids(out)) == sorted(uninterrupted)  # every id once
    assert _records(out) == uninterrupted


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs, where this machine lets the test mount one (root with
    CAP_SYS_ADMIN); other machines run the injected-ENOSPC tests above only."""
    where = tmp_path / "small"
    where.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_output_on_a_real_full_tmpfs(job, checkpoints, small_tmpfs, capsys, uninterrupted):
    out = small_tmpfs / "out.jsonl"
    args = _args(job, checkpoints["gqa"], out)
    (small_tmpfs / "ballast").write_bytes(b"x" * (60 << 10))  # one 4 KiB page left: about half the records
    assert cli.main(args) == cli.EXIT_STOPPED
    line = _one_line(capsys.readouterr().err)
    assert "cannot write the output: no space left on the device" in line
    assert 1 <= len(_ids(out)) < len(PROMPT_SET)
    (small_tmpfs / "ballast").unlink()
    assert cli.main(args) == 0
    assert _records(out) == uninterrupted


def test_quantized_copy_that_cannot_fit_is_refused_before_output(job, checkpoints, tmp_path, monkeypatch, capsys):
    from klotski.util import writes
    out, copy = tmp_path / "out.jsonl", tmp_path / "offload" / "q"
    monkeypatch.setattr(writes, "free_bytes", lambda path: 10_000)
    rc = cli.main(_args(job, checkpoints["gqa"], out, "--quantize", "hqq4", "--offload-dir", str(copy)))
    line = _one_line(capsys.readouterr().err)
    assert rc == cli.EXIT_USAGE
    assert "not enough free space for the HQQ 4-bit copy" in line and "9.8 KiB is free" in line
    assert "--offload-dir" in line
    assert not out.exists() and not copy.exists()


def test_quantized_copy_failing_midway_leaves_nothing_to_trust(job, checkpoints, tmp_path, monkeypatch, capsys):
    from klotski.util.safetensors import SafetensorsWriter  # the streaming writer the HQQ copy uses
    out, copy = tmp_path / "out.jsonl", tmp_path / "offload" / "q"
    args = _args(job, checkpoints["gqa"], out, "--quantize", "hqq4", "--offload-dir", str(copy))
    real, calls = SafetensorsWriter.add, []

    def add(self, key, t):
        if str(copy.parent) in str(self.path):  # the copy only (built-in models are written by the same writer)
            calls.append(key)
        if len(calls) > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, key, t)
    monkeypatch.setattr(SafetensorsWriter, "add", add)
    assert cli.main(args) == cli.EXIT_STOPPED
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"klotski: error: {copy}: cannot write the HQQ 4-bit copy of the model: no space left")
    assert "the partial copy was removed" in line
    assert list(copy.parent.iterdir()) == []  # no copy, no temporary a rerun could trust
    assert not out.exists()  # and no empty output file
    monkeypatch.setattr(SafetensorsWriter, "add", real)
    assert cli.main(args) == 0
    clean = tmp_path / "clean.jsonl"
    assert cli.main(_args(job, checkpoints["gqa"], clean, "--quantize", "hqq4",
                          "--offload-dir", str(tmp_path / "other"))) == 0
    assert _records(out) == _records(clean)


def test_report_that_cannot_be_written_is_one_line_and_output_is_whole(job, checkpoints, tmp_path, capsys,
                                                                       uninterrupted):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    out = tmp_path / "out.jsonl"
    assert cli.main(_args(job, checkpoints["gqa"], out, "--report", str(blocker / "report.json"))) == cli.EXIT_STOPPED
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"klotski: error: {blocker / 'report.json'}: cannot write the run report")
    assert f"every record is in {out}" in err[-1]
    assert _records(out) == uninterrupted


def test_correlation_cache_that_cannot_be_saved_warns_once_and_the_run_goes_on(job, checkpoints, tmp_path,
                                                                                monkeypatch, capsys, uninterrupted):
    from klotski.util import cachedir
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(cachedir, "correlation_table", lambda key: blocker / f"{key}.json")
    out = tmp_path / "out.jsonl"
    assert cli.main(_args(job, checkpoints["gqa"], out)) == 0
    warnings = [w for w in capsys.readouterr().err.splitlines() if "warning" in w]
    assert len(warnings) == 1 and "cannot write the expert-correlation table" in warnings[0]
    assert "the run goes on" in warnings[0]
    assert _records(out) == uninterrupted
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_sigterm_mid_run_says_so_and_the_rerun_resumes(job, checkpoints, tmp_path, uninterrupted):
    from test_cli import KLOTSKI, run
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    args = _args(job, checkpoints["gqa"], out, "--report", str(report))
    proc = subprocess.Popen(KLOTSKI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == cli.EXIT_TERMINATED, err
    assert err.strip().splitlines()[-1] == "klotski: terminated; rerun the same command to resume"
    assert "Traceback" not in err
    assert 2 <= len(_ids(out)) < len(PROMPT_SET), "the signal should land mid-run"
    # the report covers the part that ran, and says it stopped (a benchmark's row cut at its time
    # limit keeps its figures)
    stopped = json.loads(report.read_text())
    assert stopped["stopped"] == "interrupted" and "error" not in stopped
    assert stopped["requests"]["ok"] == len(_ids(out)) and stopped["tokens"]["generated"] > 0
    r = run(args)
    assert r.returncode == 0, r.stderr
    assert sorted(_ids(out)) == sorted(uninterrupted)
    assert _records(out) == uninterrupted


def test_a_temporary_left_by_a_killed_run_is_removed_by_the_next_write(tmp_path):
    """A run SIGKILLed while saving (the correlation table, the report) leaves its temporary;
    the next save of that file removes it, and leaves a live process's alone."""
    import subprocess
    import sys
    from klotski.util.writes import replace_atomically
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    target = tmp_path / "table.json"
    stale, live = tmp_path / f".table.json.{dead}.tmp", tmp_path / f".table.json.{os.getppid()}.tmp"
    stale.write_text("half")
    live.write_text("being written")
    replace_atomically(target, b"{}")
    assert target.read_bytes() == b"{}"
    assert not stale.exists() and live.exists()


def test_a_stopped_runs_report_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """The interrupted run's report goes where --report says; where it cannot be written the
    user reads why in one line (and the stop itself is still raised by the caller)."""
    from klotski.config import RunConfig
    from klotski.generate import Job
    report = tmp_path / "a-directory"
    report.mkdir()
    job = Job(RunConfig(model="m", report=str(report)), tmp_path / "jobs.jsonl", tmp_path / "out.jsonl", 0.0)
    job.engine = object()  # a run had begun
    job.report = lambda: {"tokens_per_s": 1.0}
    job.save_stopped("interrupted")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"klotski: --report {report}: the part that ran was not reported")
    assert report.is_dir()
