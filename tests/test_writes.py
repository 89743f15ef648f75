"""util.writes.replacing, the one atomic write (issue 59): a file or a directory written to a
temporary sibling, fsynced (the file, or the directory and every file in it, then the parent
directory), renamed over the target; a failure leaves the old target and no temporary; a
killed run's temporaries are removed by the next write of the same target, a live run's kept."""
import os
from pathlib import Path

import pytest

from klotski.io import output as output_mod
from klotski.util.writes import replace_atomically, replacing


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync was called on, in order."""
    seen, real = [], os.fsync

    def fsync(fd):
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _only(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_file_is_replaced_whole_and_synced_before_its_rename(tmp_path, synced, monkeypatch):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    renames, real = [], os.replace

    def replace(src, dst):
        renames.append((Path(src), Path(dst), list(synced)))
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    replace_atomically(target, b"new")
    assert target.read_bytes() == b"new" and _only(tmp_path) == ["state.json"]
    [(src, dst, before)] = renames
    assert dst == target and src.parent == tmp_path and src.name.startswith(".state.json.")
    assert before == [src]               # the new file's data is on disk before it takes the name
    assert synced == [src, tmp_path]     # ...and the rename itself after


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.parquet"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed midway")
    assert target.read_bytes() == b"old" and _only(tmp_path) == ["out.parquet"]


def test_a_directory_replaces_a_full_one_and_every_file_is_synced(tmp_path, synced):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.bin").write_bytes(b"x")
    with replacing(target) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "weights.bin").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
    assert _only(target) == ["config.json", "sub"] and _only(tmp_path) == ["model"]
    names = [p.name for p in synced]
    assert names.index("weights.bin") < names.index("sub") and "config.json" in names
    assert synced[-1] == tmp_path  # the parent, after the rename


def test_keep_drops_ours_when_another_process_built_it_first(tmp_path):
    target = tmp_path / "model"
    with replacing(target, keep=lambda p: (p / "done").exists()) as tmp:
        tmp.mkdir()
        (tmp / "ours").write_text("")
        target.mkdir()  # another process finishes first, meanwhile
        (target / "done").write_text("")
    assert _only(target) == ["done"] and _only(tmp_path) == ["model"]


def test_leftovers_of_killed_runs_go_live_ones_stay(tmp_path):
    target = tmp_path / "state.json"
    dead = [tmp_path / ".state.json.999999999.0a1b2c3d.tmp", tmp_path / ".state.json.999999999.tmp"]
    live = tmp_path / f".state.json.{os.getpid()}.0a1b2c3d.tmp"
    other = tmp_path / ".state.json.x.999999999.0a1b2c3d.tmp"  # another file's ("state.json.x")
    for p in (*dead, live, other):
        p.write_bytes(b"")
    old_dir = tmp_path / ".state.json.999999999.0a1b2c3d.old"
    old_dir.mkdir()
    replace_atomically(target, b"{}")
    assert not any(p.exists() for p in (*dead, old_dir)) and live.exists() and other.exists()


def test_the_output_rewrite_keeps_the_files_mode(tmp_path):
    from klotski.io.records import error_record
    from klotski.io.requests import LineError
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "completion": "x", "finish_reason": "stop", "prompt_tokens": 1, '
                   '"completion_tokens": 1}\n')
    with output_mod.OutputWriter(str(out)) as w:
        w.write(error_record(LineError("b", 2, "bad"), fmt="klotski"))
    os.chmod(out, 0o640)
    with output_mod.OutputWriter(str(out), resume=True):  # the error line is dropped: a rewrite
        pass
    assert (out.stat().st_mode & 0o777) == 0o640 and '"b"' not in out.read_text()
    assert _only(tmp_path) == ["out.jsonl"]
