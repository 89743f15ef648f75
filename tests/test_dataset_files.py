"""Dataset files in (Parquet, CSV, save_to_disk) and a Parquet output (issue 15): rows go
through the JSONL lines' checks and windows, streamed; a Parquet output keeps the input's
columns and resumes after a SIGKILL with every id once and the same tokens."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from klotski.io import dataset_files  # noqa: E402
from klotski import generate as run
from klotski.config import RunConfig  # noqa: E402
from klotski.io.jobs import windows  # noqa: E402
from klotski.io.requests import LineError, Request  # noqa: E402
from klotski.io.parquet_output import ParquetOutput  # noqa: E402

FIELDS = ("text", "messages", "id")


def prompt(i):
    return f"the river number {i} flows past the old mill"


def config_for(model, **kw):
    return RunConfig(model=str(model), max_new_tokens=2, progress=False, include_token_ids=True, **kw)


def jsonl_records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_parquet_input_streams_in_windows(tmp_path, monkeypatch):
    n = 3000
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "text": [prompt(i) for i in range(n)]}),
                   path, row_group_size=250)
    pulled = {"n": 0}
    real = dataset_files.open_rows

    def counting(p):
        rows = real(p)
        assert isinstance(rows, datasets.IterableDataset)  # streamed, not loaded

        class Rows:
            features = rows.features

            def __iter__(self):
                for row in rows:
                    pulled["n"] += 1
                    yield row
        return Rows()
    monkeypatch.setattr(dataset_files, "open_rows", counting)
    stream = windows(dataset_files.job_rows(path, FIELDS, None, None), 100)
    first = next(stream)
    assert [r.id for r in first] == [f"r{i}" for i in range(100)] and first[5].prompt == prompt(5)
    assert pulled["n"] < 1000  # the first window came before the file was read
    assert sum(len(w) for w in stream) + 100 == n and pulled["n"] == n
    assert dataset_files.count_rows(path) == n


def test_csv_rows_get_the_jsonl_checks_ids_and_completions(checkpoints, tmp_path):
    csv = tmp_path / "rows.csv"
    rows = [("1", prompt(1)), ("", prompt(2)), ("3", ""), ("1", prompt(4)), ("x5", prompt(5))]
    csv.write_text("id,text,max_new_tokens\n" + "".join(f'{i},"{p}",{1 + k % 2}\n' for k, (i, p) in enumerate(rows)))
    out = tmp_path / "out.jsonl"
    code = run.generate(config_for(checkpoints["gqa"], prompt_field="text"), csv, str(out))
    assert code == 1
    got = jsonl_records(out)
    assert set(got) == {"1", "2", "3", "1#line4", "x5"}  # a row without an id is its row number
    # (an empty CSV cell is a missing value) the error names the row and the column
    assert got["3"]["error"]["message"].startswith('missing "prompt"') and got["3"]["error"]["line"] == 3
    assert "row 3; prompt is column 'text'" in got["3"]["error"]["message"]
    assert "duplicate id '1'" in got["1#line4"]["error"]["message"]
    # the same jobs as a JSONL file give the same records (one path for both)
    jl = tmp_path / "same.jsonl"
    jl.write_text("".join(json.dumps({**({"id": i} if i else {}), "prompt": p, "max_new_tokens": 1 + k % 2}) + "\n"
                          for k, (i, p) in enumerate(rows) if p))
    ref = tmp_path / "ref.jsonl"
    run.generate(config_for(checkpoints["gqa"]), jl, str(ref))
    ref_records = jsonl_records(ref)
    for rid in ("1", "2", "x5"):
        assert got[rid]["token_ids"] == ref_records[rid]["token_ids"] and got[rid]["completion_tokens"] == 1 + (rid == "2")


def test_a_save_to_disk_directory_with_chat_messages(tmp_path):
    d = tmp_path / "saved"
    datasets.Dataset.from_dict({
        "messages": [[{"role": "user", "content": "Hi"}], [{"role": "robot", "content": "?"}], None],
        "topic": ["a", "b", "c"]}).save_to_disk(str(d))
    items = list(dataset_files.job_rows(d, ("prompt", "messages", "id"), None, None))
    assert isinstance(dataset_files.open_rows(d), datasets.Dataset)  # memory-mapped, not a copy
    assert isinstance(items[0], Request) and items[0].messages == (("user", "Hi"),) and items[0].id == "1"
    assert items[0].row["topic"] == "a"
    assert isinstance(items[1], LineError) and "messages[0].role" in items[1].message and items[1].line == 2
    assert isinstance(items[2], LineError) and 'missing "prompt"' in items[2].message
    assert dataset_files.count_rows(d) == 3


def test_a_file_without_the_prompt_column_is_refused_in_one_line(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": ["a", "b"]}), path)
    from klotski.errors import UserError
    with pytest.raises(UserError, match="no column 'prompt'.*'question'.*--prompt-field"):
        next(dataset_files.job_rows(path, ("prompt", "messages", "id"), None, None))


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_parquet_output_resumes_after_sigkill_with_every_id_once_and_the_same_tokens(checkpoints, tmp_path):
    n = 240
    src = tmp_path / "rows.parquet"
    texts = [prompt(i) for i in range(n)]
    texts[3] = ""  # an error row: retried on the rerun, once in the end
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "text": texts, "topic": [i % 5 for i in range(n)]}),
                   src, row_group_size=60)
    args = ["generate", str(src), "--model", str(checkpoints["gqa"]), "--max-new-tokens", "2", "--window", "16",
            "--prompt-field", "text", "--include-token-ids", "--no-progress"]
    code = ("import sys, klotski.io.parquet_output as p; p.ROWS_PER_PART = 8; from klotski.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "out.parquet"
    proc = subprocess.Popen([sys.executable, "-c", code, *args, "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = tmp_path / "out.parquet.parts"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(list(parts.glob("part-*"))) < 3:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists(), "the kill should land mid-run"
    assert 0 < len(ParquetOutput.finished(out)) < n

    r = subprocess.run([sys.executable, "-m", "klotski.cli", *args, "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr  # the empty prompt
    assert not parts.exists()
    table = pq.read_table(out).to_pylist()
    ids = [row["id"] for row in table]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # every id exactly once
    by_id = {row["id"]: row for row in table}
    assert by_id["r3"]["error"] and by_id["r7"]["topic"] == 2 and by_id["r7"]["text"] == prompt(7)

    ref = tmp_path / "ref.jsonl"
    r = subprocess.run([sys.executable, "-m", "klotski.cli", *args, "-o", str(ref)],
                       capture_output=True, text=True, timeout=600)
    expected = jsonl_records(ref)
    for rid, rec in expected.items():
        if "error" not in rec:
            assert by_id[rid]["token_ids"] == rec["token_ids"] and by_id[rid]["completion"] == rec["completion"], rid
