"""The progress sidecar (klotski/io/progress.py): a rerun seeks past the finished lines and
reads only the output's tail, and whatever does not match falls back to the full pass.
What is checked is what a user relies on — every id exactly once, the same records as an
uninterrupted run, error lines retried — and that the sidecar was (or was not) used."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from klotski.io import progress
from klotski import generate as run
from klotski.config import RunConfig
from klotski.io.records import is_error, record_key

HOSTILE = {5: b'{"id": "bad", "prompt": \n', 9: b'{"id": "q3", "prompt": "a late duplicate"}\n',
           12: b'{"id": "empty", "prompt": ""}\n', 14: b"\n"}


def write_job(path, n):
    with open(path, "wb") as f:
        for i in range(n):
            f.write(HOSTILE.get(i) or json.dumps({"id": f"q{i}", "prompt": f"the river {i} flows past the mill"}).encode() + b"\n")
    return path


def records(path):
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        assert record_key(rec) not in out, f"{record_key(rec)} twice"
        out[record_key(rec)] = rec
    return out


def generate(model, jobs, out, tmp_path, **kw):
    report = tmp_path / "report.json"
    config = RunConfig(model=str(model), max_new_tokens=2, progress=False, report=str(report), **kw)
    run.generate(config, jobs, str(out))
    return json.loads(report.read_text())


@pytest.fixture
def every_window(monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)


class Stop(BaseException):
    pass


def stop_after(monkeypatch, n):
    from klotski.io.output import OutputWriter
    real, count = OutputWriter.write, {"n": 0}

    def write(self, record):
        count["n"] += 1
        if count["n"] > n:
            raise Stop
        return real(self, record)
    monkeypatch.setattr(OutputWriter, "write", write)
    return lambda: monkeypatch.setattr(OutputWriter, "write", real)


def test_rerun_seeks_past_the_watermark_and_retries_error_lines(checkpoints, tmp_path, monkeypatch, every_window):
    jobs = write_job(tmp_path / "j.jsonl", 48)
    full = tmp_path / "full.jsonl"
    generate(checkpoints["gqa"], jobs, full, tmp_path, window=8)
    expected = records(full)
    assert len(expected) == 47 and sum(is_error(r) for r in expected.values()) == 3

    out = tmp_path / "out.jsonl"
    undo = stop_after(monkeypatch, 30)
    with pytest.raises(Stop):
        generate(checkpoints["gqa"], jobs, out, tmp_path, window=8)
    undo()
    state = json.loads((progress.sidecar(out) / "state.json").read_text())
    assert state["line"] == 25 and len(state["errors"]) == 3  # three whole windows (line 15 is blank)

    parsed = []
    real_decode = __import__("klotski.io.jobs", fromlist=["_decode"])._decode
    monkeypatch.setattr("klotski.io.jobs._decode", lambda raw, first: parsed.append(raw) or real_decode(raw, first))
    r = generate(checkpoints["gqa"], jobs, out, tmp_path, window=8)
    assert r["resume"] == {"sidecar": True, "skipped_by_watermark": 25, "replayed_errors": 3}
    assert len(parsed) == 3 + 48 - 25  # the error lines again, then only the lines after the watermark
    got = records(out)
    assert got.keys() == expected.keys()
    for rid, rec in expected.items():
        assert got[rid] == rec, rid  # same completions, same error records (retried, not kept)

    # A rerun of a finished job, twice: nothing but the error lines is read or written again.
    for _ in range(2):
        parsed.clear()
        r = generate(checkpoints["gqa"], jobs, out, tmp_path, window=8)
        assert r["resume"]["skipped_by_watermark"] == 48 and len(parsed) == 3
        assert records(out) == expected


CHANGES = ["job touched", "job edited", "output cut", "output edited", "torn seen", "torn state"]


def test_anything_inconsistent_means_the_full_pass(checkpoints, tmp_path, monkeypatch, every_window):
    import shutil
    jobs = write_job(tmp_path / "j.jsonl", 40)
    out = tmp_path / "out.jsonl"
    undo = stop_after(monkeypatch, 26)
    with pytest.raises(Stop):
        generate(checkpoints["gqa"], jobs, out, tmp_path, window=8)
    undo()
    assert progress.load(out, jobs) is not None
    for change in CHANGES:
        d = tmp_path / change.replace(" ", "-")
        d.mkdir()
        j, o = d / jobs.name, d / out.name
        shutil.copy2(jobs, j)
        shutil.copy2(out, o)
        shutil.copytree(progress.sidecar(out), progress.sidecar(o))
        assert progress.load(o, j) is not None, change  # a copy, unchanged, still matches
        text = o.read_bytes()
        if change == "job touched":
            os.utime(j, ns=(time.time_ns(), time.time_ns() + 10**9))
        elif change == "job edited":  # same size, one id changed
            j.write_bytes(j.read_bytes().replace(b'"q30"', b'"q03"'))
        elif change == "output cut":
            o.write_bytes(text[: len(text) // 2])
        elif change == "output edited":  # a record before the recorded end now answers another id
            o.write_bytes(text.replace(b'{"id": "q1",', b'{"id": "x1",', 1))
        elif change == "torn seen":
            with open(progress.sidecar(o) / "seen", "r+b") as f:
                f.truncate(8)
        else:
            state = progress.sidecar(o) / "state.json"
            state.write_bytes(state.read_bytes()[:50])
        assert progress.load(o, j) is None, change
        if change in ("job edited", "output edited"):
            r = generate(checkpoints["gqa"], j, o, tmp_path, window=8)
            assert r["resume"]["sidecar"] is False
            ids = {f"q{i}" for i in range(40) if i not in HOSTILE} | {"6", "q3#line10", "empty"}
            ids = ids - {"q30"} | {"q03"} if change == "job edited" else ids | {"x1"}
            assert set(records(o)) == ids  # (records() fails on an id twice)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_then_rerun_uses_the_sidecar_and_writes_every_id_once(checkpoints, tmp_path):
    n = 600
    jobs = write_job(tmp_path / "j.jsonl", n)
    out, report = tmp_path / "out.jsonl", tmp_path / "r.json"
    args = ["generate", str(jobs), "--model", str(checkpoints["gqa"]), "--max-new-tokens", "1",
            "--window", "16", "--no-progress", "-o", str(out), "--report", str(report)]
    code = ("import sys, klotski.io.progress as p; p.INTERVAL_S = 0.0; from klotski.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = progress.sidecar(out) / "state.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (state.exists() and out.stat().st_size > 5_000):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the kill should land mid-run"
    assert len(records(out)) < n - 1

    r = subprocess.run([sys.executable, "-m", "klotski.cli", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr  # the hostile lines failed, everything else ran
    resume = json.loads(report.read_text())["resume"]
    assert resume["sidecar"] and resume["skipped_by_watermark"] >= 16 and resume["replayed_errors"] == 3
    got = records(out)  # every id once
    assert set(got) == {f"q{i}" for i in range(n) if i not in HOSTILE} | {"6", "q3#line10", "empty"}
    assert sum(is_error(rec) for rec in got.values()) == 3
