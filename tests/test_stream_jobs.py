"""Job files streamed in windows (issue 20): what is read before the first record, what a
window holds, resume through the hashed finished set, late duplicates, a longer prompt
after the planned window. Behaviour is counted (lines pulled from the reader, records
written), never timed."""
import json
from pathlib import Path

import pytest

from klotski.io import idset, jobs, output
from klotski import generate as run
from klotski.schedule import sequences
from klotski.config import RunConfig
from klotski.io.idset import IdSet
from klotski.io.jobs import count_lines, stream_jobs, windows
from klotski.io.output import OutputWriter
from klotski.io.records import _KLOTSKI, classify, error_record, is_error, parse, record_key, result_record
from klotski.io.requests import CHAT_URL, LineError, Request


class Stop(BaseException):
    """Raised by a patched writer to end a run once it has shown what the test needs."""


def write_job(path: Path, n: int, *, first=0, extra=()) -> Path:
    with open(path, "w") as f:
        for i in range(first, first + n):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"the river number {i} flows past the old mill"}) + "\n")
        for obj in extra:
            f.write(json.dumps(obj) + "\n")
    return path


@pytest.fixture
def lines_read(monkeypatch):
    """Counts lines the job reader has pulled from the file so far."""
    count = {"n": 0}
    real = jobs._numbered_lines

    def counting(path, *at):
        for item in real(path, *at):
            count["n"] += 1
            yield item
    monkeypatch.setattr(jobs, "_numbered_lines", counting)
    return count


def config_for(model, **kw):
    return RunConfig(model=str(model), max_new_tokens=1, progress=False, **kw)


# ---------------------------------------------------------------- the reader


def test_windows_are_read_lazily_and_hold_at_most_their_size(tmp_path, lines_read):
    path = write_job(tmp_path / "j.jsonl", 1000)
    stream = windows(stream_jobs(path), 64)
    first = next(stream)
    assert len(first) == 64 and lines_read["n"] == 64  # nothing beyond the first window was read
    sizes = [len(w) for w in stream]
    assert max(sizes) == 64 and sum(sizes) + 64 == 1000 and lines_read["n"] == 1000


def test_count_lines_counts_newlines_and_an_unterminated_last_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(b"")
    assert count_lines(p) == 0
    p.write_bytes(b"a\nb\n\nc")
    assert count_lines(p) == 4
    p.write_bytes(b"a\n" * 5000)
    assert count_lines(p, block=7) == 5000


def test_idset_membership_and_size_survive_flushes_and_merges(monkeypatch):
    monkeypatch.setattr(idset, "PENDING", 8)
    s = IdSet()
    ids = [f"id-{i}" for i in range(1000)]
    assert all(s.add(rid) for rid in ids)
    assert not any(s.add(rid) for rid in ids[::7])  # already there
    assert len(s) == 1000 and all(rid in s for rid in ids)
    assert not any(f"other-{i}" in s for i in range(1000))
    assert len(s._runs) <= 12  # merged: O(log n) runs, each sorted
    assert all(list(r) == sorted(r) for r in s._runs)
    assert sorted(s.hashes()) == sorted(idset.id_hash(rid) for rid in ids)
    assert s.nbytes() < 20 * len(ids)


def test_duplicate_far_after_the_first_window_is_an_error_not_a_second_request(tmp_path):
    path = write_job(tmp_path / "j.jsonl", 500, extra=[{"id": "q3", "prompt": "again"}])
    items = [x for w in windows(stream_jobs(path), 16) for x in w]
    names = [x.id for x in items]
    assert len(names) == len(set(names)) == 501
    late = items[-1]
    assert isinstance(late, LineError) and late.id == "q3#line501" and "duplicate id 'q3'" in late.message


def test_fast_record_reading_agrees_with_the_full_parse():
    class Seq:
        def __init__(self, rid, openai=None, n=1):
            self.request = Request(rid, 1, "p", None, openai=openai, n=n)
            self.prompt_ids, self.out, self.text, self.finish_reason = [1], [2], 'a "quoted"\nline é', "stop"
    err = LineError('we"ird\\id é', 3, "bad", openai=CHAT_URL)
    records = [result_record(Seq('x"\\y é'), fmt="auto", model="m"),
               result_record(Seq("oa", openai=CHAT_URL), fmt="auto", model="m"),
               result_record([Seq("n2", n=2), Seq("n2", n=2)], fmt="auto", model="m"),  # a line of n: one record
               error_record(err, fmt="klotski"), error_record(err, fmt="openai")]
    for rec in records:
        raw = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        assert classify(raw) == parse(raw) == ("error" if is_error(rec) else "ok", record_key(rec))
        assert "custom_id" in rec or _KLOTSKI.match(raw)  # klotski's own records, a line of n too: found unparsed
        assert classify(raw[:-5] + b"\n")[0] == "corrupt"  # a record cut short is never taken as done


# ---------------------------------------------------------------- generate, streamed


def stop_after(monkeypatch, records: int, seen: list, lines_read=None):
    """Patch the writer: remember what is written (and how many job lines had been read by
    then); stop the run after `records` records."""
    real = OutputWriter.write

    def write(self, record):
        wrote = real(self, record)
        seen.append((record_key(record), is_error(record), lines_read["n"] if lines_read else None))
        if len(seen) >= records:
            raise Stop
        return wrote
    monkeypatch.setattr(OutputWriter, "write", write)


def test_first_record_comes_before_the_file_is_read(checkpoints, tmp_path, monkeypatch, lines_read):
    path = write_job(tmp_path / "big.jsonl", 20_000)
    seen = []
    stop_after(monkeypatch, 1, seen, lines_read)
    with pytest.raises(Stop):
        run.generate(config_for(checkpoints["gqa"], window=32), path, str(tmp_path / "out.jsonl"))
    ((rid, failed, read),) = seen
    # the window that ran, and at most the next one, read in the background meanwhile
    assert not failed and read <= 64
    assert rid in {f"q{i}" for i in range(32)}


def test_resume_skips_finished_lines_without_tokenizing_them(checkpoints, tmp_path, monkeypatch):
    path = write_job(tmp_path / "j.jsonl", 3000)
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:  # an earlier run finished the first 2,000 lines
        for i in range(2000):
            w.write({"id": f"q{i}", "completion": "x", "finish_reason": "length",
                     "prompt_tokens": 1, "completion_tokens": 1})
    tokenized = []
    real_prepare = sequences.prepare

    def prepare(requests, *a, **kw):
        tokenized.extend(r.id for r in requests)
        return real_prepare(requests, *a, **kw)
    monkeypatch.setattr("klotski.schedule.sequences.prepare", prepare)
    seen = []
    stop_after(monkeypatch, 3, seen)
    with pytest.raises(Stop):
        run.generate(config_for(checkpoints["gqa"], window=100), path, str(out))
    assert tokenized and all(int(rid[1:]) >= 2000 for rid in tokenized)
    assert all(not failed and int(rid[1:]) >= 2000 for rid, failed, _ in seen)
    assert isinstance(output.read_output(out).ok, IdSet) and len(output.read_output(out).ok) == 2003
    ids = [record_key(json.loads(line)) for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 2003


def test_late_duplicate_and_late_long_prompt_in_a_streamed_run(checkpoints, tmp_path):
    long_prompt = " ".join(["the old mill by the river"] * 60)  # far longer than the first window's prompts
    path = write_job(tmp_path / "j.jsonl", 6, extra=[{"id": "q1", "prompt": "a late duplicate"},
                                                     {"id": "long", "prompt": long_prompt},
                                                     "not an object"])
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    code = run.generate(config_for(checkpoints["gqa"], window=2, report=str(report)), path, str(out))
    assert code == 1  # the duplicate and the bad line failed, the rest ran
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {record_key(r): r for r in records}
    assert len(by_id) == len(records) == 9
    assert not is_error(by_id["q1"]) and "duplicate id 'q1'" in by_id["q1#line7"]["error"]["message"]
    assert is_error(by_id["9"]) and not is_error(by_id["long"])
    r = json.loads(report.read_text())
    assert by_id["long"]["prompt_tokens"] > r["plan"]["prefill_chunk"]  # planned from window one, chunked later
    assert "windows of 2 lines" in r["order"] and r["requests"] == {"ok": 7, "failed": 2, "skipped": 0}


def test_writer_reuses_the_read_only_scan_unless_the_file_changed(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a", "completion": "x"}) + "\n"
                   + json.dumps({"id": "b", "error": {"line": 2, "message": "bad"}}) + "\n")
    scan = output.read_output(out)
    assert "a" in scan.ok and "b" not in scan.ok and len(scan.errors) == 1
    scans = []
    real = output.scan_file
    monkeypatch.setattr(output, "scan_file", lambda f: scans.append(1) or real(f))
    with OutputWriter(out, known=scan) as w:  # unchanged: no second pass over the file
        assert scans == [] and "a" in w.done_ids and w.retried == 1
    assert out.read_text().count("\n") == 1  # the error record was dropped, to be retried
    scan = output.read_output(out)
    with open(out, "a") as f:  # changed after the scan: it is read again
        f.write(json.dumps({"id": "c", "completion": "y"}) + "\n")
    with OutputWriter(out, known=scan) as w:
        assert len(scans) == 2 and "c" in w.done_ids and len(w.done_ids) == 2
